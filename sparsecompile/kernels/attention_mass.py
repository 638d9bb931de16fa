"""Attention mass: how much softmax probability each slot of an AttentionView receives from a set of queries.

Shared by the SnapKV window scoring op (``snapkv_scores``: per query head, summed over the window
queries) and the H2O accumulation op (``h2o_accumulate``: averaged over a KV head's query group and
added to a pool-shaped score buffer). Visibility is exactly :func:`paged_attention.visibility`: a
query sees a slot iff it is inside the view's ``lengths``, holds a token, is not in the query's
future and is inside the sliding window. Probabilities are always computed in fp32, whatever the
pool dtype; a query that sees no slot contributes nothing.
"""

from __future__ import annotations

import torch

from .pool import gather_slots, launch_inputs, used_view_slots, visibility

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Above this many fp32 probability elements the reference processes queries in blocks to bound memory.
_REFERENCE_ELEMENTS = 1 << 24


def attention_mass_reference(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                             lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                             sliding_window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, queries, head_dim]`` (RoPE applied).
        k_pool: ``[num_pages, kv_heads, page_size, head_dim]``; pos_pool ``[num_pages, kv_heads, page_size]``.
        index, lengths: the view (see :func:`paged_attention.view_slots`).
        q_positions: ``[batch, queries]`` logical positions (-1: the query is padding and contributes nothing).
    Returns:
        ``mass [batch, q_heads, span]`` fp32 (the probability each of the first ``span`` view slots received,
        summed over the queries), and the view's ``slots, valid [batch, kv_heads, span]``.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    group = q_heads // kv_heads
    slots, valid = used_view_slots(index, lengths, block_size)
    keys_t = gather_slots(k_pool, slots).float().transpose(-1, -2)[:, :, None]  # [batch, kv_heads, 1, dim, slots]
    kpos = gather_slots(pos_pool, slots)
    q = query.float().reshape(batch, kv_heads, group, queries, head_dim)
    mass = torch.zeros(batch, kv_heads, group, 1, slots.shape[-1], dtype=torch.float32, device=query.device)
    step = max(1, _REFERENCE_ELEMENTS // max(1, batch * q_heads * slots.shape[-1]))
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        mask = visibility(kpos, valid, q_positions[:, start:stop], sliding_window)  # [batch, kv_heads, t, slots]
        logits = q[:, :, :, start:stop] @ keys_t
        # A finite fill keeps rows without any visible slot NaN-free; `seen` then zeroes them.
        logits.mul_(scale).masked_fill_(~mask[:, :, None], -1e30)
        seen = mask.any(-1).float()[:, :, None, None, :]  # [batch, kv_heads, 1, 1, t]
        mass += seen @ torch.softmax(logits, dim=-1)  # sum over the block's queries
    return mass.reshape(batch, q_heads, -1), slots, valid


if triton is not None:

    @triton.jit
    def _score_tile(q, qpos, K, POS, INDEX, h, j, jmask, d, dmask, scale, window, KV_HEADS: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
        """Scaled logits ``[rows, BLOCK_N]`` (fp32) of the view slots ``j`` of one (sequence, kv_head), their
        visibility and pool rows; ``INDEX`` points at this list's entries."""
        entry = tl.load(INDEX + j // BLOCK, mask=jmask, other=0)
        slot = entry.to(tl.int64) * BLOCK + j % BLOCK
        base = ((slot // PAGE) * KV_HEADS + h) * PAGE + slot % PAGE
        k = tl.load(K + base[:, None] * HEAD_DIM + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
        kpos = tl.load(POS + base, mask=jmask, other=-1).to(tl.int64)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = (s.to(tl.float32) * scale).to(tl.float32)
        vis = jmask[None, :] & (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            vis = vis & (kpos[None, :] > qpos[:, None] - window)
        return s, vis, base

    @triton.jit
    def _attention_mass_kernel(Q, K, POS, INDEX, LENGTHS, QPOS, OUT,
                               stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_lb, stride_lh,
                               stride_pb, stride_ob, stride_oh, scale, weight, window, num_queries,
                               KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                               PER_HEAD: tl.constexpr):
        # One program: a block of (query, head-in-group) rows of one (sequence, kv_head). Pass 1 finds each
        # row's softmax max and normaliser over every visible slot; pass 2 adds the probabilities per slot.
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query * GROUP + head-in-group
        t = rows // GROUP
        gi = rows % GROUP
        row_ok = t < num_queries
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + (h * GROUP + gi)[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        qpos = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1).to(tl.int64)
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, length, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jmask = j < length
            s, vis, _ = _score_tile(q, qpos, K, POS, INDEX + b * stride_ib + h * stride_ih, h, j, jmask, d, dmask,
                                    scale, window, KV_HEADS, PAGE, BLOCK, HEAD_DIM, IEEE)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        for start in range(0, length, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jmask = j < length
            s, vis, base = _score_tile(q, qpos, K, POS, INDEX + b * stride_ib + h * stride_ih, h, j, jmask, d, dmask,
                                    scale, window, KV_HEADS, PAGE, BLOCK, HEAD_DIM, IEEE)
            p = tl.where(vis, tl.exp(s - m_safe[:, None]) * inv[:, None], 0.0)
            if PER_HEAD:  # OUT [batch, q_heads, width]: one column sum per head of the group
                for g in tl.static_range(GROUP):
                    col = tl.sum(tl.where((gi == g)[:, None], p, 0.0), 0)
                    tl.atomic_add(OUT + b * stride_ob + (h * GROUP + g) * stride_oh + j, col, mask=jmask)
            else:  # OUT: the pool-shaped score buffer [num_pages, kv_heads, page_size], weighted group sum
                col = (tl.sum(p, 0) * weight).to(tl.float32)
                tl.atomic_add(OUT + base, col, mask=jmask)


def attention_mass_triton(out: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor,
                          index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int,
                          scale: float, sliding_window: int, per_head: bool, weight: float = 1.0) -> None:
    """Triton launch: add the attention mass to ``out`` in place.

    ``per_head``: ``out [batch, q_heads, entries * block_size]`` fp32 (contiguous), indexed by view column.
    Otherwise ``out`` is a pool-shaped ``[num_pages, kv_heads, page_size]`` fp32 buffer indexed by global
    slot, receiving ``weight`` x the sum over the query group.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    query, index, q_positions = launch_inputs(query, index, q_positions)
    block_m = 16 if queries * group <= 16 else 64
    grid = (triton.cdiv(queries * group, block_m), batch * kv_heads)
    _attention_mass_kernel[grid](
        query, k_pool, pos_pool, index, lengths, q_positions, out,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0),
        out.stride(0) if per_head else 0, out.stride(1) if per_head else 0,
        float(scale), float(weight), int(sliding_window), queries,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=32,
        IEEE=query.dtype == torch.float32, PER_HEAD=per_head,
    )
