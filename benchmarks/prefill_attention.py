"""Prefill attention over the paged KV pool: every implementation of ``paged_prefill_attention`` against SDPA.

    python benchmarks/prefill_attention.py [--quick] [--sweep] [--no-flex] [--out benchmarks/results]

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16, page 16), prefill steps laid out
as the engine lays them out (tests/prefill_cases.py: page view, new tokens in the last slots, pages scattered over
the pool). Points: whole prompts of 8K and 32K; chunks of 2048 / 8192 / 16384 at the end of a 32K and a 128K
prompt (the prefix is everything before); batch 1 and 4; a sliding-window chunk, an evicted chunk (per-head
positions in random slot order, 2% empty slots) and H2O's default step (an 8192-token chunk after 2,048 kept
slots per head).

Rows per point: ``triton`` (the new kernel), ``sdpa`` (gather + flash; it says when it fell back), ``split``
(cuDNN causal over the step's own K/V + cuDNN over the gathered older slots, merged by log-sum-exp; points without
a window or holes, the own K/V given as the controller gives them), ``flex`` (gather
+ FlexAttention; batch 1 only, as each new shape may recompile), ``paged_attention`` (today's prefill path, batch 1
only) and the SDPA ceilings on contiguous q/k/v of the same sizes (``ceiling_flash``: the flash kernel with native
GQA, lower-right causal; ``ceiling_default``: public SDPA with enable_gqa, whatever backend it picks;
``ceiling_cudnn``: cuDNN, whole prompts only). Time: median of CUDA-event timed calls after two warm-up calls,
inputs rotated over copies when they fit in L2. TFLOP/s = 4 * head_dim * (visible query-key pairs over all query
heads) / time; ``pct_sdpa`` is against the best ceiling of the point. ``diff_vs_triton``: largest |out - out_triton|
(a sanity check; the GPU tests check against the reference). JSON lines to ``--out/prefill_attention.jsonl``, a
table last.
Runtime on one H200: about 3 minutes (``--quick``: about 1 minute; ``--sweep`` adds about 1 minute).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from prefill_cases import prefill_case  # noqa: E402

import sparsecompile  # noqa: E402,F401  (registers the ops)
from sparsecompile.kernels import prefill_attention as pa  # noqa: E402
from sparsecompile.kernels.paged_attention import paged_attention_triton  # noqa: E402

KV_HEADS, GROUP, DIM, PAGE = 8, 4, 128, 16
K = 1024

# (name, batch, context, chunk (0 = whole prompt), extra prefill_case options)
DEFAULT_POINTS = [
    *[(f"whole {c // K}K", b, c, 0, {}) for c in (8 * K, 32 * K) for b in (1, 4)],
    *[(f"chunk {n} @ {c // K}K", b, c, n, {}) for c in (32 * K, 128 * K) for n in (2048, 8192, 16384) for b in (1, 4)],
    ("window 4096, chunk 2048 @ 32K", 1, 32 * K, 2048, {"window": 4096}),
    ("evicted 8K of 16K, chunk 2048", 1, 8 * K + 2048, 2048, {"evict": True, "holes": 0.02}),
    ("evicted 8K of 16K, chunk 2048", 4, 8 * K + 2048, 2048, {"evict": True, "holes": 0.02}),
    ("h2o: chunk 8192 after 2048 kept", 1, 10 * K, 8 * K, {"evict": True}),  # H2O's default chunk, per-head kept
]
QUICK_POINTS = [p for p in DEFAULT_POINTS if (p[0], p[1]) in {
    ("whole 8K", 1), ("chunk 2048 @ 32K", 1), ("chunk 2048 @ 32K", 4), ("chunk 2048 @ 128K", 1),
    ("window 4096, chunk 2048 @ 32K", 1), ("evicted 8K of 16K, chunk 2048", 1),
    ("h2o: chunk 8192 after 2048 kept", 1)}]
SWEEP_CONFIGS = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                 for m, n, w, s in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3),
                                    (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4)]]


def _time_ms(fn, inputs: list, budget_s: float = 1.0) -> float:
    """Median ms of ``fn(inputs[i % len])`` over CUDA-event timed calls, after two warm-up calls."""
    for i in range(2):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(inputs[0])
    torch.cuda.synchronize()
    reps = max(3, min(20, int(budget_s / max(time.perf_counter() - start, 1e-4))))
    times = []
    for i in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def visible_pairs(case: dict) -> int:
    """Visible (query, key) pairs summed over query heads."""
    index, lengths, block = case["index"], case["lengths"], case["block_size"]
    span = index.shape[-1] * block
    kpos = pa.gather_view(case["pos_pool"], index, block, span).long()
    j = torch.arange(span, device=kpos.device)
    kpos = torch.where((j < lengths[..., None]) & (kpos >= 0), kpos, 2**62).sort(-1).values
    qpos = case["q_positions"][:, None, :].expand(-1, kpos.shape[1], -1).contiguous()
    count = torch.searchsorted(kpos, qpos, right=True)
    if case["sliding_window"] > 0:
        count = count - torch.searchsorted(kpos, qpos - case["sliding_window"], right=True)
    count = torch.where(qpos >= 0, count, 0)
    return int(count.sum()) * (case["query"].shape[1] // kpos.shape[1])


def _variants(batch: int, flex: bool) -> dict:
    def run(fn):
        return lambda c: fn(**c)

    variants = {"triton": run(pa.prefill_attention_triton), "sdpa": run(pa.prefill_attention_sdpa)}
    if flex and batch == 1:  # each new shape can cost a flex recompile: batch 1 only keeps the run short
        variants["flex"] = run(pa.prefill_attention_flex)
    if batch == 1:
        variants["paged_attention"] = lambda c: paged_attention_triton(
            **{k: v for k, v in c.items() if k != "num_new"})
    return variants


def _ceilings(batch: int, queries: int, keys: int) -> tuple[dict, list]:
    """SDPA on contiguous q [B, Hq, T, D] (HF's transposed layout) and k/v [B, Hkv, N, D]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    inputs = []
    for _ in range(2 if keys * batch <= 16 * K else 1):
        q = torch.randn(batch, queries, KV_HEADS * GROUP, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(batch, KV_HEADS, keys, DIM, device="cuda", dtype=torch.bfloat16)
        inputs.append((q, k, torch.randn_like(k)))
    mask = None if queries == keys else causal_lower_right(queries, keys)

    def default(a):
        return F.scaled_dot_product_attention(*a, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    def cudnn(a):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True)

    rows = {"ceiling_flash": lambda a: torch.ops.aten._scaled_dot_product_flash_attention(
        *a, 0.0, True, False, scale=DIM ** -0.5), "ceiling_default": default}
    if queries == keys:
        rows["ceiling_cudnn"] = cudnn
    return rows, inputs


def bench_point(name: str, batch: int, context: int, chunk: int, options: dict, flex: bool,
                sweep: bool) -> list[dict]:
    queries = chunk or context
    prefix = context - queries
    cases = [prefill_case([prefix] * batch, [queries] * batch, kv_heads=KV_HEADS, group=GROUP, head_dim=DIM,
                          page=PAGE, dtype=torch.bfloat16, device="cuda", seed=s, extra_entries=0, **options)
             for s in range(2 if context * batch <= 16 * K else 1)]  # rotate only what L2 could hold
    pairs = visible_pairs(cases[0])
    base = {"point": name, "batch": batch, "context": context, "chunk": chunk, "prefix": prefix,
            "window": options.get("window", 0), "evicted": bool(options.get("evict")), "visible_pairs": pairs}
    rows, reference = [], None
    variants = _variants(batch, flex)
    if not options.get("window") and not options.get("holes"):  # cuDNN split: dense steps (as the dispatch takes it)
        own = {id(c): tuple(pa.gather_view(c[p], c["index"], PAGE, context)[:, :, prefix:].contiguous()
                            for p in ("k_pool", "v_pool")) for c in cases}
        variants["split"] = lambda c: pa.prefill_attention_split(c["query"], c["k_pool"], c["v_pool"], c["index"],
                                                                 PAGE, c["scale"], context, *own[id(c)])
    for variant, fn in variants.items():
        row = {**base, "variant": variant}
        try:
            if variant == "sdpa":
                c = cases[0]
                ok = pa.sdpa_applicable(c["index"], c["lengths"], c["pos_pool"], c["num_new"], queries, PAGE)
                exact = int(ok[0]) and c["sliding_window"] <= 0
                row["path"] = "gather+flash" if exact else "fell back to triton"
            ms = _time_ms(fn, cases)
            out = fn(cases[0])[0]
            if reference is None:
                reference = out
            row.update(ms=ms, tflops=4 * DIM * pairs / ms / 1e9,
                       diff_vs_triton=float((out.float() - reference.float()).abs().max()))
        except Exception as err:  # one failing variant does not lose the others
            row["error"] = f"{type(err).__name__}: {err}"[:500]
        rows.append(row)
        torch.cuda.empty_cache()
    if sweep:
        for config in SWEEP_CONFIGS:
            row = {**base, "variant": "triton_sweep", "config": config}
            try:
                row["ms"] = _time_ms(lambda c, cfg=config: pa.prefill_attention_triton(**c, config=cfg), cases)
                row["tflops"] = 4 * DIM * pairs / row["ms"] / 1e9
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
    del cases, reference
    gc.collect()
    torch.cuda.empty_cache()
    ceilings, inputs = _ceilings(batch, queries, context)
    dense_pairs = batch * KV_HEADS * GROUP * (queries * prefix + queries * (queries + 1) // 2)
    for variant, fn in ceilings.items():
        row = {**base, "variant": variant, "visible_pairs": dense_pairs}
        try:
            row["ms"] = _time_ms(fn, inputs)
            row["tflops"] = 4 * DIM * dense_pairs / row["ms"] / 1e9
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    del inputs
    best = max((r.get("tflops", 0.0) for r in rows if r["variant"].startswith("ceiling")), default=0.0)
    for row in rows:
        if best and "tflops" in row:
            row["pct_sdpa"] = 100 * row["tflops"] / best
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    cols = ["triton", "sdpa", "split", "flex", "paged_attention", "ceiling_flash", "ceiling_default", "ceiling_cudnn"]
    lines = [f"{'point':32} {'B':>2} " + " ".join(f"{c[:15]:>21}" for c in cols),
             " " * 36 + " ".join(f"{'ms  TF/s  %sdpa':>21}" for _ in cols)]
    points = []
    for r in rows:
        if (r["point"], r["batch"]) not in points:
            points.append((r["point"], r["batch"]))
    for point, batch in points:
        mine = {r["variant"]: r for r in rows if (r["point"], r["batch"]) == (point, batch)}
        cells = []
        for c in cols:
            r = mine.get(c)
            if r is None:
                cells.append(f"{'-':>21}")
            elif "ms" not in r:
                cells.append(f"{'error':>21}")
            else:
                mark = "*" if r.get("path", "").startswith("fell") else " "
                cells.append(f"{r['ms']:8.2f}{mark}{r['tflops']:5.0f} {r.get('pct_sdpa', 0):5.0f}%")
        lines.append(f"{point:32} {batch:>2} " + " ".join(cells))
    lines.append("* the sdpa variant fell back to the Triton kernel (window, padding or empty slots)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="six points, batch 1 mostly")
    parser.add_argument("--sweep", action="store_true", help="also time Triton launch configs at two points")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take a while)")
    parser.add_argument("--points", default="", help="only points whose name contains one of these (comma list)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prefill_attention.jsonl")
    points = QUICK_POINTS if args.quick else DEFAULT_POINTS
    if args.points:
        points = [p for p in points if any(s in p[0] for s in args.points.split(","))]
    rows, started = [], time.perf_counter()
    with open(path, "w") as out:
        out.write(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda_impl": pa.CUDA_IMPL}) + "\n")
        for name, batch, context, chunk, options in points:
            sweep = args.sweep and batch == 1 and name in ("whole 8K", "chunk 2048 @ 32K")
            try:
                got = bench_point(name, batch, context, chunk, options, not args.no_flex, sweep)
            except Exception as err:  # e.g. out of memory building the point
                got = [{"point": name, "batch": batch, "variant": "all", "error": f"{type(err).__name__}: {err}"}]
                gc.collect()
                torch.cuda.empty_cache()
            for row in got:
                out.write(json.dumps(row) + "\n")
                out.flush()
                brief = {k: row[k] for k in ("variant", "ms", "tflops", "pct_sdpa", "path", "error") if k in row}
                print(json.dumps({"point": name, "batch": batch, **brief})[:400], flush=True)
            rows.extend(got)
            print(f"# {time.perf_counter() - started:.0f}s elapsed", flush=True)
    print(table([r for r in rows if r["variant"] not in ("triton_sweep", "all")]))
    sweeps = [r for r in rows if r["variant"] == "triton_sweep" and "ms" in r]
    for r in sorted(sweeps, key=lambda r: (r["point"], r["ms"])):
        print(f"sweep {r['point']:20} {json.dumps(r['config'])} {r['ms']:.2f} ms {r['tflops']:.0f} TF/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
