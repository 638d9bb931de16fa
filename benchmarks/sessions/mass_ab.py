r"""H2O's prefill mass pass, before / after the transposed kernel (issue #13: h2o prefill 1.30x vanilla at 32K).

    python benchmarks/sessions/mass_ab.py [--before PATH] [--quick] > mass_ab_h200.jsonl

``--before``: a copy of an earlier ``kernels/attention_mass.py`` with absolute imports, e.g.

    git show 952b650:sparsecompile/kernels/attention_mass.py | sed 's/^from \.\(pool\|tiles\) import/from
    sparsecompile.kernels.\1 import/' > benchmarks/sessions/attention_mass_before.py   (untracked: it travels)

At H2O's prefill points (8192-token chunk over the kept 2,048 plus itself; 2,048 over 32K; 2,048 over 4K) each
launch configuration of the current kernel (``--quick``: 13; ``--grid``: the given ones), and the earlier kernel's
default and super-4 configs, adds one chunk's mass into a pool-shaped score buffer. Rows: median microseconds
of CUDA-graph replays (``mass_kernels._row``), QK^T TFLOP/s, the largest difference from the earlier kernel's
default result (the same sums in another order: fp32 rounding only). The last line names the fastest configuration of
the current kernel at the 8192-chunk point (``best``); ``--apply-best`` makes it the default in this checkout (the
device's disposable copy), so that the stage's prefill runs that follow use it. A summary goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mass_kernels import GROUP, KV_HEADS, PAGE, SCALE, _queries, _row, sequence_pool  # noqa: E402

from sparsecompile.kernels import attention_mass  # noqa: E402

POINTS = [(10240, 8192), (32768, 2048), (4096, 2048)]


def _load(path: str):
    spec = importlib.util.spec_from_file_location("attention_mass_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _configs(quick: bool, grid: str | None) -> list[dict]:
    base = attention_mass.MASS_PREFILL_CONFIG
    out = [dict(base)]
    if grid:  # "SUPERS;STAGES;MxNxWARPS,...", e.g. "4,8,16;2,3;64x128x4,64x64x4"
        supers, stages, tiles = grid.split(";")
        for tile in tiles.split(","):
            bm, bn, w = (int(x) for x in tile.split("x"))
            for sup in (int(x) for x in supers.split(",")):
                for st in (int(x) for x in stages.split(",")):
                    cfg = {**base, "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st, "super": sup}
                    if cfg not in out:
                        out.append(cfg)
        return out
    for sup in ((1, 2, 4) if not quick else (1, 4)):
        for bm, bn in ((64, 128), (128, 128), (64, 64)) + (((128, 64),) if not quick else ()):
            for w in (4, 8):
                for st in ((2, 3) if not quick else (2,)):
                    cfg = {**base, "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st, "super": sup}
                    if cfg not in out:
                        out.append(cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--grid", default=None, help='explicit configs: "SUPERS;STAGES;MxNxWARPS,..."')
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--apply-best", action="store_true",
                        help="write the fastest config at the 8192-chunk point into kernels/attention_mass.py")
    args = parser.parse_args()
    before = _load(args.before) if args.before else None
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "default": attention_mass.MASS_PREFILL_CONFIG}), flush=True)
    best, rows_seen = None, []
    for context, chunk in POINTS:
        sets = []
        for k, pos, index, lengths in sequence_pool(1, context, 2):
            q, qpos = _queries(1, context - chunk, chunk)
            lse = attention_mass.attention_lse_triton(q, k, pos, index, lengths, qpos, PAGE, SCALE, 0)
            sets.append((q, k, pos, index, lengths, qpos, lse))
        flops = 2.0 * KV_HEADS * GROUP * chunk * (context - chunk / 2) * 128
        mb = context * KV_HEADS * (128 * 2 + 8) / 1e6

        def call(module, cfg, a, out):
            module.attention_mass_triton(out, *a, PAGE, SCALE, 0, module.SUM, module.TO_POOL, weight=1.0 / GROUP,
                                         config=cfg)

        ref = None
        if before is not None:
            ref = torch.zeros(sets[0][1].shape[:3], device="cuda")
            call(before, None, sets[0], ref)
        variants = [("before", before, None), ("before", before, {**before.MASS_PREFILL_CONFIG, "super": 4})] \
            if before is not None else []
        variants += [("after", attention_mass, cfg) for cfg in _configs(args.quick, args.grid)]
        for name, module, cfg in variants:
            try:
                outs = [torch.zeros(a[1].shape[:3], device="cuda") for a in sets]
                row = _row(f"h2o mass pass, chunk {chunk} over {context}",
                           [lambda a=a, o=o, m=module, c=cfg: call(m, c, a, o) for a, o in zip(sets, outs)], mb,
                           flops, iters=args.iters, kernel_version=name, config=cfg or "default",
                           context=context, chunk=chunk)
                if ref is not None:
                    check = torch.zeros_like(ref)
                    call(module, cfg, sets[0], check)
                    row["max_abs_diff_vs_before"] = float((check - ref).abs().max())
                    row["max_rel_diff_vs_before"] = float(((check - ref).abs() / ref.abs().clamp_min(1e-6)).max())
            except Exception as err:  # noqa: BLE001 - one config's failure must not lose the others
                row = {"kernel_version": name, "config": cfg, "context": context, "chunk": chunk,
                       "error": f"{type(err).__name__}: {err}"[:400]}
            print(json.dumps(row), flush=True)
            rows_seen.append(row)
            if name == "after" and chunk == 8192 and "us" in row and (best is None or row["us"] < best["us"]):
                best = row
        del sets
        torch.cuda.empty_cache()
    print(json.dumps({"best": best and best["config"], "best_us": best and best["us"]}), flush=True)
    _summary(rows_seen)
    if args.apply_best and best:
        _apply(best["config"])


def _summary(rows: list[dict]) -> None:
    """Per point (to stderr): the previous kernel's default, the current default and the fastest current config."""
    for point in sorted({(r["context"], r["chunk"]) for r in rows if "us" in r}):
        pts = [r for r in rows if (r.get("context"), r.get("chunk")) == point and "us" in r]
        after = [r for r in pts if r["kernel_version"] == "after"]
        picks = [("before default", [r for r in pts if r["kernel_version"] == "before"][:1]),
                 ("after default", after[:1]), ("after best", sorted(after, key=lambda r: r["us"])[:1])]
        for label, sel in picks:
            for r in sel:
                print(point, label, f"{r['us']:.1f} us {r['TFLOPs_qk']:.1f} TF/s", r["config"],
                      r.get("max_abs_diff_vs_before"), file=sys.stderr)
    print("errors:", sum("error" in r for r in rows), file=sys.stderr)


def _apply(config: dict) -> None:
    """Make ``config`` the default in this checkout's kernel file (the device's disposable copy)."""
    path = attention_mass.__file__
    with open(path) as handle:
        text = handle.read()
    text = re.sub(r"MASS_PREFILL_CONFIG = \{[^}]*\}", "MASS_PREFILL_CONFIG = " + repr(config), text)
    with open(path, "w") as handle:
        handle.write(text)
    print("default now", config, file=sys.stderr)


if __name__ == "__main__":
    main()
