"""Session experiment (#14, OmniKV at 128K x 4): the filter layer's dense decode attention with the per-slot max raw
logit written by the kernel (``paged_attention_triton(..., with_token_max=True)``) against the attention alone plus
the separate score pass (``omnikv_scores_triton``), at the Llama-3.1-8B shape, over launch configs. One JSON line per
timing on stdout. A fused-logits kernel measured slower on 2026-11-30 (850 us against 521 + 259, commit 69cb0cd);
this times the current kernel's form before it is adopted.

    python3 benchmarks/sessions/token_max_ab.py [--batch 4] [--context 131072]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton

from sparsecompile.kernels.omnikv_scores import omnikv_scores_triton
from sparsecompile.kernels.paged_attention import paged_attention_triton
from sparsecompile.methods.omnikv import _prompt_scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=131072)
    args = ap.parse_args()
    batch, heads, group, dim, page = args.batch, 8, 4, 128, 16
    pages = args.context // page + 16
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = batch * pages + 1
    k_pool = torch.randn(pool, heads, page, dim, device="cuda", generator=g).to(torch.bfloat16)
    v_pool = torch.randn(pool, heads, page, dim, device="cuda", generator=g).to(torch.bfloat16)
    pos_pool = torch.zeros(pool, heads, page, device="cuda", dtype=torch.int32)
    table = torch.randperm(pool - 1, device="cuda", generator=g)[: batch * pages].view(batch, pages).to(torch.int32)
    index = table[:, None, :].expand(-1, heads, -1)
    lengths = torch.full((batch, heads), args.context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, heads * group, 1, dim, device="cuda", generator=g).to(torch.bfloat16)
    qpos = torch.full((batch, 1), args.context, device="cuda")
    prompt = torch.full((batch,), args.context - 64, device="cuda")
    scale = dim ** -0.5
    kv_bytes = batch * heads * args.context * dim * 2 * 2

    def emit(**row) -> None:
        print(json.dumps(row), flush=True)

    base = triton.testing.do_bench(lambda: paged_attention_triton(query, k_pool, v_pool, pos_pool, index, lengths,
                                                                  qpos, page, scale, 0), warmup=50, rep=300)
    scores = triton.testing.do_bench(lambda: omnikv_scores_triton(query[:, :, 0], k_pool, table, prompt),
                                     warmup=50, rep=300)
    emit(variant="attention", us=base * 1e3, GBps=kv_bytes / base / 1e6)
    emit(variant="omnikv_scores", us=scores * 1e3)
    emit(variant="separate", us=(base + scores) * 1e3)
    want = omnikv_scores_triton(query[:, :, 0], k_pool, table, prompt)
    for block_n, warps, stages, target in itertools.product((64, 128), (4, 8), (2, 3, 4), (264, 528)):
        config = dict(block_n=block_n, num_warps=warps, num_stages=stages, target_programs=target)
        try:
            fn = functools.partial(paged_attention_triton, query, k_pool, v_pool, pos_pool, index, lengths, qpos,
                                   page, scale, 0, config=config, with_token_max=True)
            _, token_max = fn()
            err = (_prompt_scores(token_max, prompt)[:, : args.context - 64]
                   - want[:, : args.context - 64]).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=30, rep=200)
            plain = triton.testing.do_bench(functools.partial(
                paged_attention_triton, query, k_pool, v_pool, pos_pool, index, lengths, qpos, page, scale, 0,
                config=config), warmup=30, rep=200)
            emit(variant="fused", config=config, us=ms * 1e3, plain_us=plain * 1e3, max_err=err)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end of the sweep
            emit(variant="fused", config=config, error=str(e)[:200])


if __name__ == "__main__":
    main()
