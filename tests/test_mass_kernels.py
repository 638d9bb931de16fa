"""The attention-mass ops added for one-pass H2O and KVzip (``h2o_accumulate_lse``, ``kvzip_scores``) and the
log-sum-exp pass: references against float64 loops or a dense torch formula, Triton kernels (interpreter on
CPU) against the references at toy sizes with launch configurations that exercise every path, and opcheck."""

from __future__ import annotations

import math

import pytest
import torch
from test_eviction_kernels import GROUP, HEADS, NUM_PAGES, PAGE, _case, _naive_mass, _pool

from sparsecompile.kernels import (
    attention_lse_reference,
    h2o_accumulate_lse,
    h2o_accumulate_reference,
    kvzip_scores,
    kvzip_scores_reference,
)
from sparsecompile.kernels.library import triton_available

DIM = 16


def _naive_lse(query, k_pool, pos_pool, index, lengths, qpos, block_size, scale, window):
    """``[batch, q_heads, queries]`` float64 log-sum-exp over the visible logits, by loops."""
    batch, q_heads, queries, _ = query.shape
    out = torch.full((batch, q_heads, queries), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for qh in range(q_heads):
            h = qh // GROUP
            for t in range(queries):
                logits = []
                for j in range(int(lengths[b, h])):
                    slot = int(index[b, h, j // block_size]) * block_size + j % block_size
                    page, off = divmod(slot, PAGE)
                    p, q_p = int(pos_pool[page, h, off]), int(qpos[b, t])
                    if p < 0 or p > q_p or (window and p <= q_p - window):
                        continue
                    logits.append(float(k_pool[page, h, off].double() @ query[b, qh, t].double()) * scale)
                if logits:
                    out[b, qh, t] = torch.logsumexp(torch.tensor(logits, dtype=torch.float64), 0)
    return out


@pytest.mark.parametrize("block_size,entries,window", [(PAGE, 5, 0), (1, 17, 5)])
def test_attention_lse_reference_matches_naive(block_size, entries, window):
    k, pos = _pool(2)
    query, index, lengths, qpos = _case(block_size, entries, 4, seed=2)
    got = attention_lse_reference(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    want = _naive_lse(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    assert torch.isinf(want).any() and torch.isfinite(want).any()  # the case has rows that see nothing
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,entries,window", [(PAGE, 5, 0), (1, 17, 5)])
def test_h2o_accumulate_lse_matches_h2o_accumulate(block_size, entries, window):
    """Fed the reference lse, the one-pass op adds exactly what the softmax op adds."""
    k, pos = _pool(1)
    query, index, lengths, qpos = _case(block_size, entries, 3, seed=1)
    args = (k, pos, index, lengths, qpos)
    lse = attention_lse_reference(query, *args, block_size, 0.25, window)
    want = torch.rand(NUM_PAGES + 1, HEADS, PAGE)
    got = want.clone()
    h2o_accumulate_reference(want, query, *args, block_size, 0.25, window)
    h2o_accumulate_lse(got, query, *args, lse, block_size, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size,entries,window", [(PAGE, 5, 0), (1, 17, 5)])
def test_kvzip_scores_match_naive(block_size, entries, window):
    k, pos = _pool(4)
    query, index, lengths, qpos = _case(block_size, entries, 1, seed=4)
    got = kvzip_scores(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    assert got.shape == (2, HEADS, entries * block_size) and got.dtype == torch.float32
    # one query: the maximum over the group is the maximum of the per-head summed mass
    mass, _ = _naive_mass(query, k, pos, index, lengths, qpos, block_size, 0.3, window)
    want = torch.zeros_like(got, dtype=torch.float64)
    for (b, qh, j), value in mass.items():
        want[b, qh // GROUP, j] = max(float(want[b, qh // GROUP, j]), value)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _kvzip_layout(seed=0, sink=3, chunk=9, repeat=7, window=0):
    """A KVzip scoring call built from dense per-head keys ``[sink | chunk | repeat]`` (positions: the sink at 0..,
    the chunk in the middle of a longer context, the repeat tokens after the context), scattered into the pool at
    random slots and named by a slot-list view in that order; returns the op's arguments and the dense scores."""
    g = torch.Generator().manual_seed(seed)
    n = sink + chunk + repeat
    keys = torch.randn(HEADS, n, DIM, generator=g)
    kpos = torch.cat([torch.arange(sink), 20 + torch.arange(chunk), 50 + torch.arange(repeat)])
    # the repeat tokens are the queries; their own keys are in the view
    query = torch.randn(1, HEADS * GROUP, repeat, DIM, generator=g)
    qpos = kpos[-repeat:][None]
    k_pool = torch.randn(NUM_PAGES + 1, HEADS, PAGE, DIM, generator=g)
    pos_pool = torch.randint(-1, 100, (NUM_PAGES + 1, HEADS, PAGE), generator=g, dtype=torch.int32)
    slots = torch.stack([torch.randperm((NUM_PAGES + 1) * PAGE, generator=g)[:n] for _ in range(HEADS)])
    for h in range(HEADS):
        k_pool[slots[h] // PAGE, h, slots[h] % PAGE] = keys[h]
        pos_pool[slots[h] // PAGE, h, slots[h] % PAGE] = kpos.int()
    width = n + 3  # spare view columns past lengths
    index = torch.cat([slots, torch.zeros(HEADS, 3, dtype=torch.long)], 1)[None].int()
    lengths = torch.full((1, HEADS), n, dtype=torch.int32)
    # dense: per query head, softmax over the keys the query sees, then max over (group, repeat queries)
    logits = torch.einsum("hgtd,hnd->hgtn", query[0].view(HEADS, GROUP, repeat, DIM).double(), keys.double()) * 0.3
    mask = kpos[None, :] <= qpos[0][:, None]
    if window:
        mask &= kpos[None, :] > qpos[0][:, None] - window
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    dense = torch.zeros(1, HEADS, width, dtype=torch.float64)
    dense[0, :, :n] = probs.amax(dim=(1, 2))
    return (query, k_pool, pos_pool, index, lengths, qpos, 1, 0.3, window), dense


@pytest.mark.parametrize("window", [0, 12])
def test_kvzip_scores_match_dense_formula(window):
    args, dense = _kvzip_layout(window=window)
    torch.testing.assert_close(kvzip_scores(*args).double(), dense, atol=1e-6, rtol=1e-5)


def test_opcheck_mass_ops():
    k, pos = _pool()
    query, index, lengths, qpos = _case(PAGE, 5, 3)
    lse = attention_lse_reference(query, k, pos, index, lengths, qpos, PAGE, 0.25, 3)
    torch.library.opcheck(torch.ops.sparsecompile.h2o_accumulate_lse.default,
                          (torch.zeros(NUM_PAGES + 1, HEADS, PAGE), query, k, pos, index, lengths, qpos, lse, PAGE,
                           0.25, 3))
    torch.library.opcheck(torch.ops.sparsecompile.kvzip_scores.default,
                          (query, k, pos, index, lengths, qpos, PAGE, 0.25, 0))


triton_only = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# Small tiles so that toy sizes take several slot tiles, query tiles and lse splits.
SMALL = {"block_m": 16, "block_n": 16}
SPLIT = {"block_n": 16, "target_programs": 64}


def _prefill_case(device, window=0, queries=11):
    """A chunk of ``queries`` queries at the end of a 40-token sequence whose pages hold positions in view order
    (so some query tiles see none of a slot tile and are skipped, and some see all of it: the unmasked path); the
    second row's list is shorter and its first two queries are padding; slot 1 of both lists holds no token (a hole
    inside a slot tile that the first row's queries otherwise see whole)."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(NUM_PAGES + 1, HEADS, PAGE, DIM, generator=g)
    pos = torch.full((NUM_PAGES + 1, HEADS, PAGE), -1, dtype=torch.int32)
    order = torch.randperm(NUM_PAGES, generator=g)  # the pool pages holding positions 0-3, 4-7, ...
    pos[order] = (torch.arange(NUM_PAGES * PAGE).view(NUM_PAGES, 1, PAGE).expand(-1, HEADS, -1)).int()
    pos[order[0], :, 1] = -1
    index = order[None, None].expand(2, HEADS, -1).int().contiguous()
    lengths = torch.tensor([[40, 40], [37, 40]], dtype=torch.int32)
    query = torch.randn(2, HEADS * GROUP, queries, DIM, generator=g)
    qpos = (40 - queries + torch.arange(queries)).repeat(2, 1)
    qpos[1, :2] = -1  # left padding
    return tuple(t.to(device) for t in (query, k, pos, index, lengths, qpos)) + (PAGE, 1 / math.sqrt(DIM), window)


@triton_only
@pytest.mark.parametrize("window,super_tiles", [(0, 1), (9, 1), (9, 2)])
def test_triton_mass_ops_prefill_paths(window, super_tiles):
    """Several query tiles per slot tile (skipped where invisible, per tile or per super tile of two), per-head
    tiles, split lse."""
    small = {**SMALL, "super": super_tiles}
    from sparsecompile.kernels.attention_mass import attention_lse_triton
    from sparsecompile.kernels.h2o_scores import h2o_accumulate_lse_triton, h2o_accumulate_triton
    from sparsecompile.kernels.kvzip_scores import kvzip_scores_triton
    from sparsecompile.kernels.snapkv_scores import snapkv_scores_reference, snapkv_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, *args = _prefill_case(device, window, queries=17)
    lse = attention_lse_reference(query, *args)
    torch.testing.assert_close(attention_lse_triton(query, *args, config=SPLIT), lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kvzip_scores_triton(query, *args, lse_config=SPLIT, mass_config=small),
                               kvzip_scores_reference(query, *args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(snapkv_scores_triton(query, *args, mass_config=small),
                               snapkv_scores_reference(query, *args), atol=1e-5, rtol=1e-5)
    want = torch.rand(NUM_PAGES + 1, HEADS, PAGE, generator=torch.Generator().manual_seed(0)).to(device)
    got, got_lse = want.clone(), want.clone()
    h2o_accumulate_reference(want, query, *args)
    h2o_accumulate_triton(got, query, *args, lse_config=SPLIT, mass_config=small)
    h2o_accumulate_lse_triton(got_lse, query, *args[:5], lse, *args[5:], mass_config=small)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want, atol=1e-5, rtol=1e-5)


@triton_only
@pytest.mark.parametrize("block_size,entries,queries,window", [(PAGE, 5, 1, 0), (1, 17, 2, 5)])
def test_triton_mass_ops_random_views(block_size, entries, queries, window):
    """Decode-sized (one query tile) calls on random views, including rows and lists that see nothing."""
    from sparsecompile.kernels.attention_mass import attention_lse_triton
    from sparsecompile.kernels.h2o_scores import h2o_accumulate_lse_triton
    from sparsecompile.kernels.kvzip_scores import kvzip_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, pos = (t.to(device) for t in _pool(3))
    query, index, lengths, qpos = (t.to(device) for t in _case(block_size, entries, queries, seed=3))
    args = (k, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM), window)
    lse = attention_lse_reference(query, *args)
    torch.testing.assert_close(attention_lse_triton(query, *args, config=SPLIT), lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kvzip_scores_triton(query, *args, mass_config=SMALL),
                               kvzip_scores_reference(query, *args), atol=1e-5, rtol=1e-5)
    want = torch.rand(NUM_PAGES + 1, HEADS, PAGE, generator=torch.Generator().manual_seed(0)).to(device)
    got = want.clone()
    h2o_accumulate_reference(want, query, *args)
    # an lse with other strides than the kernel's own output (the attention's may be a view)
    lse_t = lse.transpose(1, 2).contiguous().transpose(1, 2)
    h2o_accumulate_lse_triton(got, query, *args[:5], lse_t, *args[5:], mass_config=SMALL)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@triton_only
def test_triton_kvzip_matches_dense_formula():
    from sparsecompile.kernels.kvzip_scores import kvzip_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args, dense = _kvzip_layout(seed=1, window=0)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    got = kvzip_scores_triton(*args, lse_config=SPLIT, mass_config=SMALL)
    torch.testing.assert_close(got.double().cpu(), dense, atol=1e-5, rtol=1e-5)
