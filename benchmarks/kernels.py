"""Kernel microbenchmarks on CUDA: each sparsecompile kernel's achieved GB/s on the bytes it must read.

    python benchmarks/kernels.py [--out benchmarks/results]

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

import sparsecompile  # noqa: E402,F401  (registers ops)
from sparsecompile.kernels.paged_attention import paged_attention_triton  # noqa: E402


def decode_inputs(batch: int, context: int, selected: int | None, block: int, copies: int = 3,
                  kv_heads: int = 8, group: int = 4, dim: int = 128, page: int = 16) -> tuple[list[tuple], dict]:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = measure_read_bandwidth()
    print(json.dumps(bw))
    rows = []
    cases = [(1, 32768, None, 16), (16, 32768, None, 16), (4, 131072, None, 16), (4, 131072, 2048, 16),
             (4, 131072, 2048, 1), (16, 32768, 2048, 16), (64, 131072, 2048, 16)]
    configs = [None]
    if args.sweep:
        configs += [{"block_n": bn, "num_warps": w, "num_stages": st, "target_programs": tp}
                    for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4) for tp in (264, 528)]
    for batch, context, selected, block in cases:
        best = None
        sets, info = decode_inputs(batch, context, selected, block)
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
        if args.sweep:
            best["best_of_sweep"] = True
            rows.append(best)
            print(json.dumps(best))
        del sets
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "kernels.jsonl"), "w") as handle:
        for row in [{"bandwidth": bw}, *rows]:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
