"""Ops: the torch references against naive math, the Triton kernels (interpreter on CPU) against the
references at toy sizes, and torch.library.opcheck on every op."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecompile.kernels import dense_attention, kv_write, kv_write_reference, paged_attention
from sparsecompile.kernels.library import triton_available
from sparsecompile.kernels.paged_attention import paged_attention_reference
from sparsecompile.kernels.paged_attention_variants import (
    decode_logits_reference,
    paged_attention_lse_reference,
    token_max_reference,
)
from sparsecompile.kernels.pool import gather_slots, view_slots, visibility

NUM_PAGES, HEADS, PAGE, DIM, GROUP = 10, 2, 4, 16, 3


def _pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_PAGES, HEADS, PAGE, DIM, generator=g)
    v = torch.randn(NUM_PAGES, HEADS, PAGE, DIM, generator=g)
    pos = torch.randint(-1, 40, (NUM_PAGES, HEADS, PAGE), generator=g, dtype=torch.int32)
    return k, v, pos


def _case(block_size, entries, queries, seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    batch = 2
    index = torch.randint(0, NUM_PAGES * PAGE // block_size, (batch, HEADS, entries), generator=g, dtype=torch.int32)
    lengths = torch.randint(0, entries * block_size + 1, (batch, HEADS), generator=g, dtype=torch.int32)
    query = torch.randn(batch, HEADS * GROUP, queries, DIM, generator=g)
    qpos = torch.randint(-1, 45, (batch, queries), generator=g)
    return query, index, lengths, qpos


def _naive(query, k_pool, v_pool, pos_pool, index, lengths, qpos, block_size, scale, window):
    """Loop-by-loop attention over the view, in float64."""
    batch, q_heads, queries, dim = query.shape
    out = torch.zeros(batch, queries, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        for qh in range(q_heads):
            h = qh // GROUP
            for t in range(queries):
                keys, vals = [], []
                for j in range(int(lengths[b, h])):
                    slot = int(index[b, h, j // block_size]) * block_size + j % block_size
                    page, off = divmod(slot, PAGE)
                    p = int(pos_pool[page, h, off])
                    q_p = int(qpos[b, t])
                    if p < 0 or p > q_p or (window and p <= q_p - window):
                        continue
                    keys.append(k_pool[page, h, off].double())
                    vals.append(v_pool[page, h, off].double())
                if keys:
                    s = torch.stack(keys) @ query[b, qh, t].double() * scale
                    out[b, t, qh] = torch.softmax(s, 0) @ torch.stack(vals)
    return out


@pytest.mark.parametrize("block_size,entries", [(PAGE, 5), (1, 17)])
@pytest.mark.parametrize("queries", [1, 6])
@pytest.mark.parametrize("window", [0, 5])
def test_reference_matches_naive(block_size, entries, queries, window):
    k, v, pos = _pool()
    query, index, lengths, qpos = _case(block_size, entries, queries)
    got = paged_attention(query, k, v, pos, index, lengths, qpos, block_size, 0.3, window)
    want = _naive(query, k, v, pos, index, lengths, qpos, block_size, 0.3, window)
    assert got.shape == (2, queries, HEADS * GROUP, DIM) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_kv_write_reference():
    k, v, pos = _pool()
    key, value = torch.randn(2, HEADS, 3, DIM), torch.randn(2, HEADS, 3, DIM)
    slots = torch.tensor([[0, 9, -1], [17, -1, 39]])
    positions = torch.tensor([[5, 6, 7], [1, 2, 3]])
    k2, v2, p2 = k.clone(), v.clone(), pos.clone()
    kv_write(k2, v2, p2, key, value, slots, positions)
    for b in range(2):
        for t in range(3):
            s = int(slots[b, t])
            if s < 0:
                continue
            page, off = divmod(s, PAGE)
            assert torch.equal(k2[page, :, off], key[b, :, t]) and torch.equal(v2[page, :, off], value[b, :, t])
            assert p2[page, :, off].tolist() == [int(positions[b, t])] * HEADS
    touched = torch.zeros(NUM_PAGES, PAGE, dtype=torch.bool)
    for s in slots[slots >= 0].tolist():
        touched[s // PAGE, s % PAGE] = True
    assert torch.equal(k2.permute(0, 2, 1, 3)[~touched], k.permute(0, 2, 1, 3)[~touched])


def test_opcheck_all_ops():
    k, v, pos = _pool()
    query, index, lengths, qpos = _case(PAGE, 5, 3)
    torch.library.opcheck(torch.ops.sparsecompile.paged_attention.default,
                          (query, k, v, pos, index, lengths, qpos, PAGE, 0.25, 0))
    key, value = torch.randn(2, HEADS, 3, DIM), torch.randn(2, HEADS, 3, DIM)
    torch.library.opcheck(torch.ops.sparsecompile.kv_write.default,
                          (k.clone(), v.clone(), pos.clone(), key, value, torch.tensor([[0, 9, -1], [17, -1, 39]]),
                           torch.tensor([[5, 6, 7], [1, 2, 3]])))
    q, kk, vv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    torch.library.opcheck(torch.ops.sparsecompile.dense_attention.default, (q, kk, vv, None, 0.0, True, None, True))
    assert torch.allclose(dense_attention(q, kk, vv, None, 0.0, True, None, True),
                          torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True))


triton_only = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@triton_only
@pytest.mark.parametrize("block_size,entries,queries,window",
                         [(PAGE, 5, 1, 0), (1, 17, 6, 5), (PAGE, 3, 7, 0), (1, 600, 1, 0), (PAGE, 160, 1, 7)])
def test_triton_paged_attention_matches_reference(block_size, entries, queries, window):
    from sparsecompile.kernels.paged_attention import paged_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v, pos = (t.to(device) for t in _pool(3))
    query, index, lengths, qpos = (t.to(device) for t in _case(block_size, entries, queries, seed=3))
    if entries * block_size > 512:
        lengths = lengths.clamp(min=entries * block_size - 40)  # long lists: the split-KV path with several splits
    want = paged_attention_reference(query, k, v, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM), window)
    got = paged_attention_triton(query, k, v, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM), window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the log-sum-exp variant (H2O's decode scoring reads it): single-split and merged-split paths
    got, lse = paged_attention_triton(query, k, v, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM), window,
                                      with_lse=True)
    want_out, want_lse = paged_attention_lse_reference(query, k, v, pos, index, lengths, qpos, block_size,
                                                       1 / math.sqrt(DIM), window)
    torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-5)
    seen = ~want_lse.isneginf()
    assert torch.equal(lse.isneginf(), ~seen)
    torch.testing.assert_close(lse[seen], want_lse[seen], atol=1e-5, rtol=1e-5)
    if queries == 1:  # the token-max variant (OmniKV's filter layers read it), -inf past every list
        got, token_max = paged_attention_triton(query, k, v, pos, index, lengths, qpos, block_size,
                                                1 / math.sqrt(DIM), window, with_token_max=True)
        torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(token_max, token_max_reference(query, k, index, lengths, block_size),
                                   atol=1e-5, rtol=1e-5)
        # the logits variant (H2O's decode scoring reads it; its own launch config), -inf where unseen and past
        # every list
        want_logits = decode_logits_reference(query, k, pos, index, lengths, qpos, block_size, 1 / math.sqrt(DIM),
                                              window)
        finite = ~want_logits.isneginf()
        got, lse, logits = paged_attention_triton(query, k, v, pos, index, lengths, qpos, block_size,
                                                  1 / math.sqrt(DIM), window, with_logits=True)
        torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[seen], want_lse[seen], atol=1e-5, rtol=1e-5)
        assert torch.equal(logits.isneginf(), want_logits.isneginf())
        torch.testing.assert_close(logits[finite], want_logits[finite], atol=1e-5, rtol=1e-5)


def _opchecked_attention(op, seed: int) -> tuple[tuple, torch.Tensor]:
    """``op`` (an attention op with further outputs) opcheck'd on a one-query paged case, its attention output
    checked against the reference: returns the arguments and the last output."""
    k, v, pos = _pool(seed + 1)
    query, index, lengths, qpos = _case(PAGE, 5, 1, seed=seed)
    args = (query, k, v, pos, index, lengths, qpos, PAGE, 1 / math.sqrt(DIM), 0)
    torch.library.opcheck(op.default, args)
    out, *extra = op(*args)
    torch.testing.assert_close(out, paged_attention_reference(*args))
    return args, extra[-1]


def test_paged_attention_token_max_op():
    args, token_max = _opchecked_attention(torch.ops.sparsecompile.paged_attention_token_max, seed=5)
    query, k, index, lengths = args[0], args[1], args[4], args[5]
    assert token_max.shape == (query.shape[0], HEADS, 5 * PAGE)
    for b in range(query.shape[0]):  # independent: slot by slot, every query head of the KV head, no scale or mask
        for h in range(HEADS):
            for j in range(5 * PAGE):
                if j >= lengths[b, h]:
                    assert token_max[b, h, j] == float("-inf")
                    continue
                key = k[index[b, h, j // PAGE], h, j % PAGE]
                want = max(float(query[b, h * GROUP + g, 0] @ key) for g in range(GROUP))
                assert abs(float(token_max[b, h, j]) - want) < 1e-4
    with pytest.raises(ValueError, match="one query per sequence"):
        torch.ops.sparsecompile.paged_attention_token_max(query.expand(-1, -1, 2, -1).contiguous(), *args[1:])


def _masked_logits(args: tuple) -> torch.Tensor:
    """Independently of the ops: ``[batch, q_heads, view positions]`` scaled logits, -inf where unseen."""
    query, k, pos, index, lengths, qpos = args[0], args[1], args[3], args[4], args[5], args[6]
    slots, valid = view_slots(index, lengths, PAGE)
    keys = gather_slots(k, slots).float()  # [batch, kv_heads, slots, dim]
    visible = visibility(gather_slots(pos, slots), valid, qpos, 0)[:, :, 0]  # [batch, kv_heads, slots]
    q = query[:, :, 0].float().view(query.shape[0], HEADS, -1, DIM)  # [batch, kv_heads, group, dim]
    logits = torch.einsum("bhgd,bhsd->bhgs", q, keys) / math.sqrt(DIM)
    return logits.masked_fill(~visible[:, :, None], float("-inf")).flatten(1, 2)


def test_paged_attention_lse_op():
    args, lse = _opchecked_attention(torch.ops.sparsecompile.paged_attention_lse, seed=4)
    want = torch.logsumexp(_masked_logits(args), -1)
    torch.testing.assert_close(lse[:, :, 0], want, atol=1e-5, rtol=1e-5)


def test_paged_attention_logits_op():
    op = torch.ops.sparsecompile.paged_attention_logits
    args, logits = _opchecked_attention(op, seed=6)
    lse = op(*args)[1]
    want = _masked_logits(args)
    assert logits.shape == want.shape == (args[0].shape[0], HEADS * GROUP, 5 * PAGE)
    assert torch.equal(logits.isneginf(), want.isneginf())  # unseen and past-the-list positions
    seen = ~want.isneginf()
    torch.testing.assert_close(logits[seen], want[seen], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, 0], torch.logsumexp(want, -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one query per sequence"):
        op(args[0].expand(-1, -1, 2, -1).contiguous(), *args[1:])


@triton_only
def test_triton_kv_write_matches_reference():
    from sparsecompile.kernels.kv_write import kv_write_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v, pos = (t.to(device) for t in _pool(4))
    key = torch.randn(2, HEADS, 5, DIM, device=device).transpose(2, 3).contiguous().transpose(2, 3)  # odd strides
    value = torch.randn(2, HEADS, 5, DIM, device=device)
    slots = torch.tensor([[0, 5, -1, 9, 2], [30, 31, -1, -1, 39]], device=device)
    positions = torch.arange(10, device=device).view(2, 5)
    a = [t.clone() for t in (k, v, pos)]
    b = [t.clone() for t in (k, v, pos)]
    kv_write_reference(*a, key, value, slots, positions)
    kv_write_triton(*b, key, value, slots, positions)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
