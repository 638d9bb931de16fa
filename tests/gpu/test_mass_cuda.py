"""CUDA-only (skipped without a GPU): the attention-mass kernels (log-sum-exp pass,
``h2o_accumulate[_lse|_logits]``, ``snapkv_scores``, ``kvzip_scores``) against their torch references at the
benchmark's sizes in bf16, and the H2O ops captured in a CUDA graph (no host synchronisation) replaying to the eager
result.

Tolerance: the kernels multiply bf16 queries and keys with fp32 accumulation, the references upcast them and
multiply in fp32, so the logits agree to about 1e-6 relative and every probability, sum or maximum to
``rtol=2e-3`` (``atol`` well below one probability at these lengths).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KV_HEADS, GROUP, DIM, PAGE = 8, 4, 128, 16
SCALE = DIM ** -0.5
RTOL, ATOL = 2e-3, 1e-7


def _pool(batch, tokens, seed, block=PAGE):
    """``batch`` sequences of ``tokens`` tokens on shuffled pages (positions in page order; bf16 keys with a few
    large "heavy" keys so the softmax is peaked), and their page view or, with ``block == 1``, a token view of a
    random half of each sequence's slots in shuffled order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-tokens // PAGE)
    k = torch.randn(batch * pages + 1, KV_HEADS, PAGE, DIM, device="cuda", generator=g)
    k[torch.rand(k.shape[:3], device="cuda", generator=g) < 0.01] *= 4
    k = k.to(torch.bfloat16)
    pos = torch.full(k.shape[:3], -1, device="cuda", dtype=torch.int32)
    owned = (torch.randperm(batch * pages, device="cuda", generator=g) + 1).view(batch, pages)
    pos[owned] = torch.arange(pages * PAGE, device="cuda", dtype=torch.int32).view(1, pages, 1, PAGE).expand(
        batch, -1, KV_HEADS, -1)
    pos[pos >= tokens] = -1
    if block == PAGE:
        index = owned[:, None, :].expand(batch, KV_HEADS, pages).to(torch.int32).contiguous()
        lengths = torch.full((batch, KV_HEADS), tokens, device="cuda", dtype=torch.int32)
    else:
        slots = (owned[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(batch, -1)[:, :tokens]
        keep = tokens // 2
        pick = torch.stack([torch.randperm(tokens, device="cuda", generator=g)[:keep] for _ in range(batch)])
        index = slots.gather(1, pick)[:, None].expand(batch, KV_HEADS, keep).to(torch.int32).contiguous()
        lengths = torch.full((batch, KV_HEADS), keep, device="cuda", dtype=torch.int32)
    lengths[0, 1] = lengths[0, 1] // 3  # lists of different lengths
    return k, pos, index, lengths, g


def _queries(batch, first, count, g):
    q = (2 * torch.randn(batch, KV_HEADS * GROUP, count, DIM, device="cuda", generator=g)).to(torch.bfloat16)
    return q, torch.arange(first, first + count, device="cuda").repeat(batch, 1)


@pytest.mark.parametrize("block,window", [(PAGE, 0), (1, 0), (PAGE, 1000)])
def test_h2o_decode_triton_vs_reference(block, window):
    """64 sequences x 2,048 slots, one query each: the lse pass, the one-pass op fed the reference lse, the op, and
    the update from the attention's logits."""
    from sparsecompile.kernels.attention_mass import attention_lse_triton
    from sparsecompile.kernels.attention_mass_reference import attention_lse_reference
    from sparsecompile.kernels.h2o_scores import (
        h2o_accumulate_logits_triton,
        h2o_accumulate_lse_triton,
        h2o_accumulate_reference,
        h2o_accumulate_triton,
    )
    from sparsecompile.kernels.paged_attention import paged_attention_triton

    tokens = 2048 if block == PAGE else 4096  # the token view reads half of them
    k, pos, index, lengths, g = _pool(64, tokens, seed=block + window, block=block)
    q, qpos = _queries(64, tokens - 1, 1, g)
    args = (k, pos, index, lengths, qpos, block, SCALE, window)
    lse = attention_lse_reference(q, *args)
    torch.testing.assert_close(attention_lse_triton(q, *args), lse, rtol=1e-5, atol=1e-4)
    want = torch.rand(k.shape[:3], device="cuda", generator=g)
    got, got_lse, got_logits_start = want.clone(), want.clone(), want.clone()
    h2o_accumulate_reference(want, q, *args)
    h2o_accumulate_lse_triton(got_lse, q, *args[:5], lse, *args[5:])
    h2o_accumulate_triton(got, q, *args)
    torch.testing.assert_close(got_lse, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # decode's path: the attention writes the logits and the lse (its DECODE_LOGITS_CONFIGS launch), the update reads
    # them instead of the keys
    _, attn_lse, logits = paged_attention_triton(q, k, torch.randn_like(k), pos, index, lengths, qpos, block,
                                                 SCALE, window, with_logits=True)
    h2o_accumulate_logits_triton(got_logits_start, logits, attn_lse, index, lengths, block)
    torch.testing.assert_close(got_logits_start, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("context,window", [(32768, 0), (4096, 1024)])
def test_h2o_prefill_chunk_triton_vs_reference(context, window):
    """A 2,048-query chunk at the end of ``context`` (causal inside the chunk; query tiles are skipped)."""
    from sparsecompile.kernels.attention_mass import attention_lse_triton
    from sparsecompile.kernels.attention_mass_reference import attention_lse_reference
    from sparsecompile.kernels.h2o_scores import h2o_accumulate_lse_triton, h2o_accumulate_reference

    k, pos, index, lengths, g = _pool(1, context, seed=context + window)
    q, qpos = _queries(1, context - 2048, 2048, g)
    qpos[0, :100] = -1  # padding queries
    args = (k, pos, index, lengths, qpos, PAGE, SCALE, window)
    lse = attention_lse_reference(q, *args)
    torch.testing.assert_close(attention_lse_triton(q, *args), lse, rtol=1e-5, atol=1e-4)
    want = torch.zeros(k.shape[:3], device="cuda")
    got = want.clone()
    h2o_accumulate_reference(want, q, *args)
    h2o_accumulate_lse_triton(got, q, *args[:5], lse, *args[5:])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_snapkv_scores_triton_vs_reference():
    """32 window queries over 32K keys (and a second sequence over fewer)."""
    from sparsecompile.kernels.snapkv_scores import snapkv_scores_reference, snapkv_scores_triton

    k, pos, index, lengths, g = _pool(2, 32768, seed=7)
    q, qpos = _queries(2, 32768 - 32, 32, g)
    args = (k, pos, index, lengths, qpos, PAGE, SCALE, 0)
    torch.testing.assert_close(snapkv_scores_triton(q, *args), snapkv_scores_reference(q, *args), rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("window", [0, 22000])
def test_kvzip_scores_triton_vs_reference(window):
    """2,064 repeat queries over a slot list of 4 sink + 2,048 chunk + the 2,064 repeat tokens of a 32K context."""
    from sparsecompile.kernels.kvzip_scores import kvzip_scores_reference, kvzip_scores_triton

    context, repeat = 32768, 2064
    k, pos, _, _, g = _pool(1, context + repeat, seed=11 + window)
    page_of = torch.argsort(torch.where(pos[:, 0, 0] >= 0, pos[:, 0, 0], 1 << 30))  # logical page -> pool page
    logical = torch.cat([torch.arange(4), 10000 + torch.arange(2048), context + torch.arange(repeat)]).cuda()
    slots = page_of[logical // PAGE] * PAGE + logical % PAGE
    index = slots[None, None].expand(1, KV_HEADS, -1).to(torch.int32).contiguous()
    lengths = torch.full((1, KV_HEADS), logical.numel(), device="cuda", dtype=torch.int32)
    q, qpos = _queries(1, context, repeat, g)
    args = (k, pos, index, lengths, qpos, 1, SCALE, window)
    want = kvzip_scores_reference(q, *args)
    assert (want[..., 4:2052] > 0).all() == (window == 0)  # every chunk slot is seen (the window hides some)
    torch.testing.assert_close(kvzip_scores_triton(q, *args), want, rtol=RTOL, atol=ATOL)


def test_h2o_ops_in_cuda_graph_replay_eager_result():
    """Both H2O ops capture into a CUDA graph (so no host synchronisation) and replay to the eager result."""
    from sparsecompile.kernels.attention_mass_reference import attention_lse_reference

    k, pos, index, lengths, g = _pool(8, 2048, seed=3)
    q, qpos = _queries(8, 2047, 1, g)
    lse = attention_lse_reference(q, k, pos, index, lengths, qpos, PAGE, SCALE, 0)
    ops = torch.ops.sparsecompile
    _, attn_lse, logits = ops.paged_attention_logits(q, k, torch.randn_like(k), pos, index, lengths, qpos, PAGE, SCALE,
                                                     0)

    def run(scores):
        ops.h2o_accumulate(scores[0], q, k, pos, index, lengths, qpos, PAGE, SCALE, 0)
        ops.h2o_accumulate_lse(scores[1], q, k, pos, index, lengths, qpos, lse, PAGE, SCALE, 0)
        ops.h2o_accumulate_logits(scores[2], logits, attn_lse, index, lengths, PAGE)

    eager = [torch.zeros(k.shape[:3], device="cuda") for _ in range(3)]
    run(eager)
    scores = [torch.zeros_like(e) for e in eager]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernels) outside the capture
        run(scores)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(scores)
    for s in scores:
        s.zero_()
    graph.replay()
    graph.replay()
    for s, e in zip(scores, eager):
        torch.testing.assert_close(s, 2 * e, rtol=1e-5, atol=1e-7)
