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
from bandwidth import measure_read_bandwidth  # noqa: E402

import sparsecompile  # noqa: E402,F401  (registers ops)
from sparsecompile.kernels.paged_attention import paged_attention_triton  # noqa: E402


def _time_cycle(fns, iters: int = 10) -> float:
    """Median seconds per call of ``fns`` (one list of closures over different buffers), graph-replayed."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def bench_decode_attention(batch: int, context: int, selected: int | None, block: int, copies: int = 3,
                           kv_heads: int = 8, group: int = 4, dim: int = 128, page: int = 16) -> dict:
    """Decode attention over ``context`` resident tokens per (sequence, kv_head), reading all of them
    (``selected=None``, page view) or ``selected`` of them (page view of selected pages or a token view)."""
    read = context if selected is None else selected
    pages_per_seq = -(-context // page)
    fns, bytes_read = [], 0
    for c in range(copies):
        num_pages = batch * pages_per_seq
        k = torch.randn(num_pages, kv_heads, page, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pos = torch.arange(page, device="cuda", dtype=torch.int32).repeat(num_pages, kv_heads, 1)
        owned = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
        if block == page:
            chosen = owned[:, torch.randperm(pages_per_seq, device="cuda")[: -(-read // page)]]
            index = chosen[:, None, :].expand(batch, kv_heads, -1).contiguous()
        else:  # token view: random slots of the sequence's pages
            slot = owned[:, :, None].long() * page + torch.arange(page, device="cuda")
            slot = slot.view(batch, -1)
            pick = torch.stack([torch.randperm(slot.shape[1], device="cuda")[:read] for _ in range(batch)])
            index = torch.gather(slot, 1, pick)[:, None, :].expand(batch, kv_heads, -1).to(torch.int32).contiguous()
        lengths = torch.full((batch, kv_heads), read, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, kv_heads * group, 1, dim, device="cuda", dtype=torch.bfloat16)
        qpos = torch.full((batch, 1), 10**6, device="cuda", dtype=torch.long)
        fns.append(lambda q=q, k=k, v=v, pos=pos, index=index, lengths=lengths, qpos=qpos: paged_attention_triton(
            q, k, v, pos, index, lengths, qpos, block, dim ** -0.5, 0))
        bytes_read = batch * kv_heads * read * (2 * dim * 2 + 4)  # K + V bf16 + int32 position
        del c
    seconds = _time_cycle(fns)
    return {"kernel": "paged_attention_decode", "batch": batch, "context": context, "read_tokens": read,
            "view": "page" if block == page else "token", "us": seconds * 1e6, "GBps": bytes_read / seconds / 1e9,
            "MB_read": bytes_read / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = measure_read_bandwidth()
    print(json.dumps(bw))
    rows = []
    for batch, context, selected, block in [(1, 32768, None, 16), (16, 32768, None, 16), (4, 131072, None, 16),
                                            (4, 131072, 2048, 16), (4, 131072, 2048, 1), (16, 32768, 2048, 16)]:
        row = bench_decode_attention(batch, context, selected, block)
        row["pct_of_bw"] = 100 * row["GBps"] / bw["best_GBps"]
        rows.append(row)
        print(json.dumps(row))
    with open(os.path.join(args.out, "kernels.jsonl"), "w") as handle:
        for row in [{"bandwidth": bw}, *rows]:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
