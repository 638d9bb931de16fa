"""Kernel microbenchmarks on CUDA: each sparsecompile kernel's achieved GB/s on the bytes it must read.

    python benchmarks/kernel_bench.py [--out benchmarks/results] [--sweep] [--quick]
        [--only attention|ops|mass|kivi|pointwise]

Decode attention at the benchmark grid's shapes, then every other op at the size the decode benchmark
(Llama-3.1-8B shape, 128K x 4, budget 2048, page 16) or the 32K chunked prefill gives it, then the
attention-mass ops (``mass_kernels.py``: H2O decode and prefill chunks, SnapKV, KVzip), then the KIVI ops
(``kivi_kernels.py``: quantized decode attention at 32K and 128K, quantize-on-write), then the fused pointwise ops of
a prefill (RMSNorm, SiLU-and-multiply at 32K tokens of the 8B shape; GB/s on the bytes read and written) beside the
eager ops they replace. ``--only`` runs one
group and writes ``kernels_<group>.jsonl`` (the full run writes ``kernels.jsonl``); ``--sweep`` also times
launch configurations; a short table is printed last.

Times are medians of CUDA-graph replays cycling several inputs (so reads do not come from L2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bandwidth import measure_read_bandwidth, time_graph  # noqa: E402
from kivi_kernels import kivi_rows  # noqa: E402
from mass_kernels import mass_decode_rows, mass_rows  # noqa: E402

import sparsecompile  # noqa: E402,F401  (registers ops)
from sparsecompile.kernels.argmax import first_argmax  # noqa: E402
from sparsecompile.kernels.fused_pointwise import (  # noqa: E402
    rms_norm_reference,
    rms_norm_triton,
    silu_mul_reference,
    silu_mul_triton,
)
from sparsecompile.kernels.kv_write import kv_write_bounds_triton, kv_write_triton  # noqa: E402
from sparsecompile.kernels.omnikv_scores import omnikv_scores_triton  # noqa: E402
from sparsecompile.kernels.paged_attention import paged_attention_triton  # noqa: E402
from sparsecompile.kernels.quest_scores import quest_page_scores_triton  # noqa: E402
from sparsecompile.kernels.topk_select import topk_select_radix, topk_select_triton  # noqa: E402
from sparsecompile.runtime.row_ops import table_width  # noqa: E402

KV_HEADS, GROUP, DIM, PAGE = 8, 4, 128, 16


def decode_inputs(batch: int, context: int, selected: int | None, block: int, copies: int = 3,
                  kv_heads: int = KV_HEADS, group: int = GROUP, dim: int = DIM,
                  page: int = PAGE) -> tuple[list[tuple], dict]:
    """``copies`` independent decode-attention argument sets over ``context`` resident tokens per
    (sequence, kv_head), reading all of them (``selected=None``, page view) or ``selected`` of them
    (page view of selected pages, or a token view when ``block == 1``)."""
    read = context if selected is None else selected
    pages_per_seq = -(-context // page)
    sets = []
    for _ in range(copies):
        num_pages = batch * pages_per_seq
        k = torch.randn(num_pages, kv_heads, page, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pos = torch.arange(page, device="cuda", dtype=torch.int32).repeat(num_pages, kv_heads, 1)
        owned = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
        if block == page:
            chosen = owned[:, torch.randperm(pages_per_seq, device="cuda")[: -(-read // page)]]
            index = chosen[:, None, :].expand(batch, kv_heads, -1).contiguous()
        else:  # token view: random slots of the sequence's pages
            slot = (owned[:, :, None].long() * page + torch.arange(page, device="cuda")).view(batch, -1)
            pick = torch.stack([torch.randperm(slot.shape[1], device="cuda")[:read] for _ in range(batch)])
            index = torch.gather(slot, 1, pick)[:, None, :].expand(batch, kv_heads, -1).to(torch.int32).contiguous()
        lengths = torch.full((batch, kv_heads), read, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, kv_heads * group, 1, dim, device="cuda", dtype=torch.bfloat16)
        qpos = torch.full((batch, 1), 10**6, device="cuda", dtype=torch.long)
        sets.append((q, k, v, pos, index, lengths, qpos, block, dim ** -0.5, 0))
    info = {"kernel": "paged_attention_decode", "batch": batch, "context": context, "read_tokens": read,
            "view": "page" if block == page else "token",
            "MB_read": batch * kv_heads * read * (2 * dim * 2 + 4) / 1e6}  # K + V bf16 + int32 position
    return sets, info


def bench_config(sets: list[tuple], info: dict, config: dict | None) -> dict:
    seconds = time_graph([lambda a=a: paged_attention_triton(*a, config=config) for a in sets])
    return {**info, "config": config or "default", "us": seconds * 1e6, "GBps": info["MB_read"] * 1e6 / seconds / 1e9}


def _op_row(kernel: str, sets: list[tuple], fn, mb_read: float, **info) -> dict:
    seconds = time_graph([lambda a=a: fn(*a) for a in sets])
    return {"kernel": kernel, **info, "us": seconds * 1e6, "MB_read": mb_read,
            "GBps": mb_read * 1e6 / seconds / 1e9 if mb_read else None}


def op_rows(copies: int = 3) -> list[dict]:
    """Every selection / eviction / write op at the decode benchmark's 128K x 4 shapes (or the 32K prefill's)."""
    bf16, rows = torch.bfloat16, []
    batch, context = 4, 131072
    pages = table_width(context // PAGE + 11)  # the engine's table: context and generated tokens, 16-page multiple
    # Quest: page scores over each row's min/max, then top-128 pages of 8,208.
    sets = []
    for _ in range(copies):
        kmin = torch.randn(batch * pages + 1, KV_HEADS, DIM, device="cuda", dtype=bf16)
        kmax = torch.randn_like(kmin)
        q = torch.randn(batch, KV_HEADS * GROUP, DIM, device="cuda", dtype=bf16)
        table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        sets.append((q, kmin, kmax, table, torch.full((batch,), context // PAGE, device="cuda")))
    rows.append(_op_row("quest_page_scores", sets, quest_page_scores_triton,
                        batch * (context // PAGE) * KV_HEADS * DIM * 2 * 2 / 1e6, batch=batch, context=context))
    del sets
    for shape, k in (((batch, KV_HEADS, pages), 2048 // PAGE), ((batch, 1, context + 164), 2048)):
        sets = [(torch.randn(*shape, device="cuda"), torch.full(shape[:2], k, device="cuda")) for _ in range(copies)]
        if shape[2] <= 16384:
            variants = [("topk_select" + ("" if search == "bisect" else f" {search}"), {"search": search})
                        for search in ("bisect", "bit", "byte")]
            # Quest's 32 rows on 32 programs: whether the many-program radix select beats the one-program bisection
            variants += [(f"topk_select radix chunk {chunk}", {"chunk": chunk}) for chunk in (512, 1024, 2048)]
        else:  # longer rows: the torch path against the radix select (and its chunk per program)
            variants = [("topk_select long torch", {"long_search": "torch"})]
            variants += [(f"topk_select long radix chunk {chunk}", {"chunk": chunk}) for chunk in (2048, 4096, 8192)]
        for name, options in variants:
            select = topk_select_radix if "chunk" in options else topk_select_triton
            rows.append(_op_row(name, sets, lambda s, c, k=k, f=select, options=options: f(s, c, k, **options),
                                shape[0] * shape[1] * shape[2] * 4 / 1e6, shape=list(shape), k=k))
    # OmniKV's filter layer: dense decode attention, then its score pass over the same keys.
    sets, info = decode_inputs(batch, context, None, PAGE, copies=2)
    rows.append(_op_row("paged_attention_decode", sets, paged_attention_triton, info["MB_read"], batch=batch,
                        context=context))
    limit = torch.full((batch,), context, device="cuda")
    rows.append(_op_row("omnikv_scores", [(a[0][:, :, 0], a[1], a[4][:, 0], limit) for a in sets],
                        omnikv_scores_triton, batch * KV_HEADS * context * DIM * 2 / 1e6, batch=batch, context=context))
    del sets
    # KV write of one decode token per sequence (into a pool of 64 sequences x 2,048 tokens).
    big = 64
    sets, info = decode_inputs(big, 2048, None, PAGE, copies=1)
    k_pool, v_pool, pos_pool = sets[0][1], sets[0][2], sets[0][3]
    key = torch.randn(big, KV_HEADS, 1, DIM, device="cuda", dtype=bf16)
    value = torch.randn_like(key)
    slot = torch.randperm(k_pool.shape[0] * PAGE, device="cuda")[:big].view(big, 1)
    rows.append(_op_row("kv_write (decode)", [(k_pool, v_pool, pos_pool, key, value, slot, slot.clone())],
                        kv_write_triton, 0.0, batch=big))
    bounds = [torch.randn(k_pool.shape[0] + 1, KV_HEADS, DIM, device="cuda", dtype=bf16) for _ in range(2)]
    rows.append(_op_row("kv_write_bounds (decode)", [(k_pool, v_pool, pos_pool, *bounds, key, value, slot,
                                                      slot.clone())], kv_write_bounds_triton, 0.0, batch=big))
    del sets
    # Greedy sampling's argmax over Llama 3's vocabulary (fp32 logits, as generate() samples them): torch's one
    # reduction against first_argmax's two.
    for b in (1, 4, 16):
        logits = [(torch.randn(b, 128256, device="cuda"),) for _ in range(copies)]
        mb = b * 128256 * 4 / 1e6
        rows.append(_op_row("argmax torch", logits, lambda x: x.argmax(-1), mb, batch=b))
        rows.append(_op_row("argmax first_argmax", logits, first_argmax, mb, batch=b))
    torch.cuda.empty_cache()
    return rows


def pointwise_rows(copies: int = 3, tokens: int = 32768, hidden: int = 4096, width: int = 14336) -> list[dict]:
    """``rms_norm`` and ``silu_mul`` at a 32K-token prefill of the 8B shape, and the eager ops they replace (HF's
    formulas op by op); GB/s on the bytes the fused op reads and writes (the eager ops move several times more)."""
    bf16, rows = torch.bfloat16, []
    weight = torch.randn(hidden, device="cuda", dtype=bf16)
    sets = [(torch.randn(1, tokens, hidden, device="cuda", dtype=bf16), weight, 1e-5) for _ in range(copies)]
    moved = 2 * tokens * hidden * 2 / 1e6
    for name, fn in (("rms_norm", rms_norm_triton), ("rms_norm eager (HF)", rms_norm_reference)):
        rows.append(_op_row(name, sets, fn, moved, tokens=tokens, hidden=hidden))
    del sets
    sets = [(torch.randn(tokens, width, device="cuda", dtype=bf16), torch.randn(tokens, width, device="cuda",
                                                                               dtype=bf16)) for _ in range(copies)]
    moved = 3 * tokens * width * 2 / 1e6
    for name, fn in (("silu_mul", silu_mul_triton), ("silu_mul eager (HF)", silu_mul_reference)):
        rows.append(_op_row(name, sets, fn, moved, tokens=tokens, width=width))
    del sets
    torch.cuda.empty_cache()
    return rows


def attention_rows(bw: dict, sweep: bool, copies: int) -> list[dict]:
    """Decode paged attention at the benchmark grid's shapes (with ``sweep``, the best configuration too)."""
    rows = []
    cases = [(1, 32768, None, 16), (16, 32768, None, 16), (4, 131072, None, 16), (4, 131072, 2048, 16),
             (4, 131072, 2048, 1), (16, 32768, 2048, 16), (64, 131072, 2048, 16)]
    configs = [None]
    if sweep:
        configs += [{"block_n": bn, "num_warps": w, "num_stages": st, "target_programs": tp}
                    for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4) for tp in (264, 528)]
    for batch, context, selected, block in cases:
        best = None
        sets, info = decode_inputs(batch, context, selected, block, copies=copies)
        for config in configs:
            try:
                row = bench_config(sets, info, config)
            except Exception as err:  # a configuration the compiler rejects (e.g. out of shared memory)
                print(json.dumps({"config": config, "error": str(err)[:200]}))
                continue
            row["pct_of_bw"] = 100 * row["GBps"] / bw["best_GBps"]
            if config is None:
                rows.append(row)
                print(json.dumps(row))
            if best is None or row["GBps"] > best["GBps"]:
                best = row
        if sweep and best is not None:
            best["best_of_sweep"] = True
            rows.append(best)
            print(json.dumps(best))
        del sets
        torch.cuda.empty_cache()
    return rows


def _table(rows: list[dict]) -> str:
    lines = [f"{'kernel':62s} {'us':>10s} {'MB read':>9s} {'% bw':>6s} {'TFLOP/s':>8s}  config"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r.get('kernel', '?'):62s} ERROR {r['error'][:100]}")
        elif "us" in r:
            tf = f"{r['TFLOPs_qk']:8.1f}" if r.get("TFLOPs_qk") else " " * 8
            pct = f"{r['pct_of_bw']:6.1f}" if r.get("pct_of_bw") else " " * 6
            cfg = "" if r.get("config", "default") == "default" else json.dumps(r["config"])[:60]
            lines.append(f"{r['kernel'][:62]:62s} {r['us']:10.1f} {r['MB_read'] or 0:9.1f} {pct} {tf}  {cfg}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument("--quick", action="store_true", help="two input copies and 10 replays per row")
    parser.add_argument("--only", choices=("attention", "ops", "mass", "mass_decode", "kivi", "pointwise"),
                        help="run one group of rows")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    copies, iters = (2, 10) if args.quick else (3, 20)
    bw = measure_read_bandwidth()
    print(json.dumps(bw))
    rows = []
    groups = [args.only] if args.only else ["attention", "ops", "mass", "kivi", "pointwise"]
    for group in groups:
        try:
            if group == "attention":
                new = attention_rows(bw, args.sweep, copies)
            elif group == "ops":
                new = op_rows(copies)
            elif group == "kivi":
                new = kivi_rows(copies, iters, args.sweep)
            elif group == "mass_decode":
                new = mass_decode_rows(copies, iters, args.sweep)
            elif group == "pointwise":
                new = pointwise_rows(copies)
            else:
                new = mass_rows(copies, iters, args.sweep)
        except Exception as err:  # keep the other groups' rows if one fails
            new = [{"kernel": group, "error": f"{type(err).__name__}: {err}"[:500]}]
        for row in new:
            if row.get("GBps") and "pct_of_bw" not in row:
                row["pct_of_bw"] = 100 * row["GBps"] / bw["best_GBps"]
            if group not in ("attention", "kivi"):
                print(json.dumps(row))
        rows += new
    name = f"kernels_{args.only}.jsonl" if args.only else "kernels.jsonl"
    with open(os.path.join(args.out, name), "w") as handle:
        for row in [{"bandwidth": bw}, *rows]:
            handle.write(json.dumps(row) + "\n")
    print(f"bandwidth {bw['best_GBps']:.0f} GB/s")
    print(_table(rows))


if __name__ == "__main__":
    main()
