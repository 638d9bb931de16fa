"""KIVI on the H200, every variant in one invocation (issue #20 targets), on the Llama-3.1-8B shape.

    python benchmarks/kivi_bench.py --out benchmarks/results/kivi_h200.jsonl [--quick]
                                    [--stage all|points|capacity|kernels]

Stages (each variant in its own try/except, so one failure keeps the others' rows):

* ``points``: decode tok/s and % of the bytes roofline (``decode.py``'s ``engine_point``: synthetic KV at the size
  each method holds, compiled CUDA-graph decode) for ``vanilla``, ``kivi2``, ``kivi4`` at 32K x 1 / 16 and
  128K x 1 / 4, and ``snapkv`` / ``snapkv+kivi`` / ``quest`` / ``quest+kivi`` (budget 2048, 2 bits) at 32K x 16
  and 128K x 4. The bytes of a KIVI step are its codes, scales, zeros and residual (``kv_stats``; ``quest+kivi``:
  those of the slots it reads, and every key group's scales and zeros, which its page scores read), plus the
  weights.
* ``capacity``: the largest batch at 128K (``decode.py``'s ``max_batch``: allocation search, then decode at it)
  for ``vanilla``, ``kivi2``, ``snapkv``, ``snapkv+kivi`` and ``snapkv+kivi-r32`` (residual 32).
* ``kernels``: ``kivi_decode_attention`` at 32K and 128K and ``kivi_quantize`` (``kivi_kernels.py``), % of the
  bandwidth measured in the same run.

A table of the points and the targets (resident KV bytes at 32K <= 0.17x vanilla's, decode at 128K x 4 >= 2.5x,
largest batch at 128K >= 5x vanilla's and snapkv+kivi >= 4x snapkv's, the kernel >= 80 % of HBM bandwidth at 32K
and longer) is printed last. ``--quick``: fewer steps and points, and the README's vanilla / snapkv largest batches
(7, 443) instead of searching them again.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402
from bandwidth import measure_read_bandwidth  # noqa: E402
from kivi_kernels import kivi_rows  # noqa: E402

README_LARGEST = {"vanilla": 7, "snapkv": 443}  # benchmarks/results/decode_h200.jsonl


def _points(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [(m, c, b) for m in ("vanilla", "kivi2") for c, b in ((32768, 1), (131072, 4))] + \
            [("kivi4", 131072, 4), ("snapkv", 131072, 4), ("snapkv+kivi", 131072, 4), ("quest+kivi", 131072, 4)]
    dense = [(m, c, b) for m in ("vanilla", "kivi2", "kivi4")
             for c, b in ((32768, 1), (32768, 16), (131072, 1), (131072, 4))]
    return dense + [(m, c, b) for m in ("snapkv", "snapkv+kivi", "quest", "quest+kivi")
                    for c, b in ((32768, 16), (131072, 4))]


def _parse_points(text: str) -> list[tuple[str, int, int]]:
    """``method:CONTEXTxBATCH,...`` -> ``[(method, context, batch), ...]``."""
    points = []
    for item in text.split(","):
        method, point = item.rsplit(":", 1)
        context, batch = point.lower().split("x")
        points.append((method, int(context), int(batch)))
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "kivi_h200.jsonl"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stage", default="all", choices=("all", "points", "capacity", "kernels"))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    parser.add_argument("--points", default=None,
                        help="only these points, e.g. kivi2:131072x4,snapkv+kivi:131072x4 (default: the stage's list; "
                             "the capacity stage searches their methods)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "kivi_bench.py needs a CUDA device\n")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "w")
    rows: list[dict] = []

    def emit(row: dict) -> None:
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row)[:2000], flush=True)

    bw = measure_read_bandwidth()
    emit({"bandwidth": bw, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
    bandwidth = bw["best_GBps"]
    warmup, steps = (8, 32) if args.quick else (32, 128)
    model = wbytes = None
    if args.stage in ("all", "points", "capacity"):
        model = decode.build_model(args.layers)
        wbytes = decode.weight_bytes(model)
    if args.stage in ("all", "points"):
        for method, context, batch in _parse_points(args.points) if args.points else _points(args.quick):
            started = time.perf_counter()
            try:
                point = decode.engine_point(model, method, context, batch, warmup, steps, wbytes, bandwidth)
                point.extra["wall_s"] = round(time.perf_counter() - started, 1)
                emit({"stage": "points", **point.__dict__})
            except Exception as err:  # one failing point (a kernel error, out of memory) does not end the run
                emit({"stage": "points", "method": method, "context": context, "batch": batch,
                      "error": f"{type(err).__name__}: {err}"[:1500]})
            gc.collect()
            torch.cuda.empty_cache()
    if args.stage in ("all", "capacity"):
        searched = ["kivi2", "snapkv+kivi", "snapkv+kivi-r32"] + ([] if args.quick else ["vanilla", "snapkv"])
        if args.points:  # the methods of --points only (their contexts and batches are the search's own)
            searched = list(dict.fromkeys(method for method, _, _ in _parse_points(args.points)))
        for method in searched:
            try:
                found = decode.max_batch(model, method, 131072, wbytes, bandwidth, warmup, steps)
                point = found.pop("point")
                emit({"stage": "capacity", **found, **({"point": point.__dict__} if point else {})})
            except Exception as err:
                emit({"stage": "capacity", "method": method, "error": f"{type(err).__name__}: {err}"[:1500]})
            gc.collect()
            torch.cuda.empty_cache()
    if args.stage in ("all", "kernels"):
        del model
        gc.collect()
        torch.cuda.empty_cache()
        try:
            for row in kivi_rows(2 if args.quick else 3, 10 if args.quick else 20):
                if row.get("GBps"):
                    row["pct_of_bw"] = 100 * row["GBps"] / bandwidth
                emit({"stage": "kernels", **row})
        except Exception as err:
            emit({"stage": "kernels", "error": f"{type(err).__name__}: {err}"[:1500]})
    out.close()
    print(table(rows, args.quick))
    return 0


def _get(rows: list[dict], method: str, context: int, batch: int) -> dict | None:
    return next((r for r in rows if r.get("stage") == "points" and r.get("method") == method
                 and r.get("context") == context and r.get("batch") == batch and "tok_s" in r), None)


def table(rows: list[dict], quick: bool) -> str:
    lines = [f"{'method':18s} {'context':>8s} {'batch':>6s} {'tok/s':>10s} {'% roof':>7s} {'KV GB':>8s} "
             f"{'peak GiB':>9s}"]
    for r in rows:
        if r.get("stage") == "points":
            if "error" in r:
                lines.append(f"{r['method']:18s} {r['context']:8d} {r['batch']:6d} ERROR {r['error'][:80]}")
            else:
                lines.append(f"{r['method']:18s} {r['context']:8d} {r['batch']:6d} {r['tok_s']:10.1f} "
                             f"{r['pct_roofline']:7.1f} {r['extra'].get('kv_GB', 0):8.2f} {r['peak_GiB']:9.1f}")
    largest = {r["method"]: r.get("largest_batch") for r in rows if r.get("stage") == "capacity" and "error" not in r}
    for method, value in README_LARGEST.items():
        largest.setdefault(method, value if quick else None)
    lines.append("largest batch at 128K: " + ", ".join(f"{m} {b}" for m, b in largest.items()))
    for r in rows:
        if r.get("stage") == "kernels" and "us" in r:
            lines.append(f"  {r['kernel'][:44]:44s} b{r.get('batch', '-')!s:>3s} {r.get('context', '-')!s:>7s} "
                         f"{r['us']:9.1f} us {r.get('pct_of_bw', 0):5.1f} % of bandwidth")
    checks = []
    v32, k32 = _get(rows, "vanilla", 32768, 1), _get(rows, "kivi2", 32768, 1)
    if v32 and k32:
        ratio = k32["extra"]["kv_GB"] / v32["extra"]["kv_GB"]
        checks.append(f"kivi2 resident KV at 32K = {ratio:.4f}x vanilla's (target <= 0.17)")
    v128, k128 = _get(rows, "vanilla", 131072, 4), _get(rows, "kivi2", 131072, 4)
    if v128 and k128:
        checks.append(f"kivi2 decode at 128K x 4 = {k128['tok_s'] / v128['tok_s']:.2f}x vanilla (target >= 2.5)")
    if largest.get("kivi2") and largest.get("vanilla"):
        checks.append(f"kivi2 largest batch = {largest['kivi2'] / largest['vanilla']:.2f}x vanilla's (target >= 5)")
    for name in ("snapkv+kivi", "snapkv+kivi-r32"):
        if largest.get(name) and largest.get("snapkv"):
            checks.append(f"{name} largest batch = {largest[name] / largest['snapkv']:.2f}x snapkv's (target >= 4)")
    kernels = [r for r in rows if r.get("stage") == "kernels" and r.get("context", 0) >= 32768 and "pct_of_bw" in r]
    if kernels:
        checks.append(f"kivi decode kernel at >= 32K: {min(r['pct_of_bw'] for r in kernels):.1f}-"
                      f"{max(r['pct_of_bw'] for r in kernels):.1f} % of bandwidth (target >= 80)")
    return "\n".join(lines + ["targets:"] + [f"  {c}" for c in checks])


if __name__ == "__main__":
    raise SystemExit(main())
