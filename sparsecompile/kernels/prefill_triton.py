"""The Triton kernel of ``sparsecompile::paged_prefill_attention`` and its torch reference.

Semantics, the view contract the kernel relies on and the CUDA dispatch are in :mod:`.prefill_attention` (which
re-exports :func:`prefill_attention_reference` and :func:`prefill_attention_triton`).
"""

from __future__ import annotations

import os

import torch

from .pool import gather_slots, launch_inputs, used_view_slots
from .tiles import FP_FUSION, load_rows, query_rows, view_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_REFERENCE_SCORE_ELEMENTS = 1 << 26  # above this many fp32 logits the reference works in query blocks


def prefill_attention_reference(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                pos_pool: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                                q_positions: torch.Tensor, num_new: torch.Tensor, block_size: int, scale: float,
                                sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference in fp32 (``num_new`` is not needed: visibility follows positions alone).

    Args:
        query: ``[batch, q_heads, queries, head_dim]`` (any strides).
        k_pool, v_pool: ``[num_pages, kv_heads, page_size, head_dim]``; pos_pool ``[num_pages, kv_heads, page_size]``.
        index, lengths: the view (:func:`~.pool.view_slots`); q_positions ``[batch, queries]`` (-1 = padding).
    Returns:
        ``out [batch, queries, q_heads, head_dim]`` contiguous in ``query.dtype`` and ``lse [batch, q_heads,
        queries]`` fp32.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    group = q_heads // kv_heads
    slots, valid = used_view_slots(index, lengths, block_size)
    keys = gather_slots(k_pool, slots).float()  # [batch, kv_heads, n, head_dim]
    values = gather_slots(v_pool, slots).float()
    kpos = torch.where(valid, gather_slots(pos_pool, slots).long(), -1)[:, :, None, None, :]
    folded = query.float().reshape(batch, kv_heads, group, queries, head_dim)
    out = folded.new_empty(folded.shape)
    lse = folded.new_empty(folded.shape[:-1])
    step = max(1, _REFERENCE_SCORE_ELEMENTS // max(1, batch * q_heads * slots.shape[-1]))
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        qpos = q_positions[:, None, None, start:stop, None].long()
        mask = (kpos >= 0) & (kpos <= qpos)
        if sliding_window > 0:
            mask = mask & (kpos > qpos - sliding_window)
        logits = torch.einsum("bhgtd,bhnd->bhgtn", folded[:, :, :, start:stop], keys) * scale
        logits = logits.masked_fill(~mask, float("-inf"))
        part_lse = torch.logsumexp(logits, -1)
        weights = torch.exp(logits - torch.where(part_lse.isinf(), 0.0, part_lse)[..., None])  # 0 where masked
        out[:, :, :, start:stop] = torch.einsum("bhgtn,bhnd->bhgtd", weights, values)
        lse[:, :, :, start:stop] = part_lse
    out = out.reshape(batch, q_heads, queries, head_dim).transpose(1, 2).to(query.dtype).contiguous()
    return out, lse.reshape(batch, q_heads, queries)


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` accumulated in fp32: tensor cores on the inputs' dtype, or exact fp32 with ``IEEE`` (fp32
        inputs; and under TRITON_INTERPRET, whose bf16 dot is wrong in triton 3.9: fp32 copies of the bf16 values)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _tile(K, V, POS, INDEX, start, hi, h, d, dmask, KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
              BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys, values and positions of list slots ``[start, start + BLOCK_N)`` (-1 past ``hi``)."""
        base, row_ptr, jmask = view_rows(INDEX, start, hi, h, KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
        kpos = tl.load(POS + base, mask=jmask, other=-1)
        return load_rows(K, row_ptr, jmask, d, dmask), load_rows(V, row_ptr, jmask, d, dmask), kpos

    @triton.jit
    def _online_softmax(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
        """Fold one tile of base-2 logits ``s`` (-inf = masked) and its values into the running state."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay NaN-free
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        return m_new, l_i, acc

    @triton.jit
    def _prefill_kernel(Q, K, V, POS, INDEX, LENGTHS, QPOS, NUM_NEW, OUT, LSE,
                        stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_lb, stride_lh, stride_pb,
                        stride_ob, stride_ot, stride_oh,
                        scale, window, num_queries, num_m_blocks,
                        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL_SKIP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
        """One program: BLOCK_M rows (row = query * GROUP + head-in-group) of one (sequence, kv_head).

        With CAUSAL_SKIP (page views, the module's contract) the list is read in two loops: whole tiles of the
        prefix, visible to every real query (only empty slots are masked, by a per-column bias folded into the
        scale's multiply), then the rest up to the causal bound of the tile's last query with the full position
        test. Padding queries are zeroed at the end. Otherwise (windows, slot lists) one loop with the full test.
        """
        pid_bh = tl.program_id(0)
        m_block = num_m_blocks - 1 - tl.program_id(1)  # the latest queries (most keys) start first
        b = (pid_bh // KV_HEADS).to(tl.int64)  # batch offsets of q / out / lse can pass 2^31 elements
        h = pid_bh % KV_HEADS
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        q, qpos, t, qh, row_ok, d, dmask = query_rows(Q, QPOS, b, h, rows, stride_qb, stride_qh, stride_qt, stride_pb,
                                                      num_queries, GROUP, HEAD_DIM, BLOCK_D)
        qpos = qpos.to(tl.int32)
        qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634  # exp2 softmax; inductor passes floats as fp64
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh).to(tl.int32)
        index = INDEX + b * stride_ib + h * stride_ih
        hi = length
        split = 0
        if CAUSAL_SKIP:
            # new slots sit at the end in position order: query new-offset o sees slots < prefix + o + 1
            num_new = tl.load(NUM_NEW + b).to(tl.int32)
            last_t = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, num_queries - 1)
            last_offset = last_t - (num_queries - num_new)
            hi = tl.where(last_offset >= 0, tl.minimum(length, length - num_new + last_offset + 1), 0)
            if not HAS_WINDOW:
                split = tl.minimum((length - num_new) // BLOCK_N * BLOCK_N, hi)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, split, BLOCK_N):
            k, v, kpos = _tile(K, V, POS, index, start, hi, h, d, dmask, KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
            bias = tl.where(kpos >= 0, 0.0, float("-inf"))
            s = _dot(q, tl.trans(k), IEEE) * qk_scale + bias[None, :]
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
        for start in range(split, hi, BLOCK_N):
            k, v, kpos = _tile(K, V, POS, index, start, hi, h, d, dmask, KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
            kpos = tl.where(kpos >= 0, kpos, 2147483647)  # empty or outside the list: after every query
            vis = kpos[None, :] <= qpos[:, None]
            if HAS_WINDOW:
                vis = vis & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(vis, _dot(q, tl.trans(k), IEEE) * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
        seen = (l_i > 0.0) & (qpos >= 0)
        l_safe = tl.where(seen, l_i, 1.0)
        out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
        tl.store(OUT + b * stride_ob + t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + (b * (KV_HEADS * GROUP) + qh) * num_queries + t, lse, mask=row_ok)


# Launch configurations by shape (override with ``config=``; benchmarks/prefill_attention.py --sweep times others).
PREFILL_LARGE_CONFIG = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
PREFILL_SMALL_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
PREFILL_FP32_CONFIG = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}


def prefill_config(rows: int, dtype: torch.dtype) -> dict:
    """The default launch configuration for ``rows = queries * group`` query rows per KV head."""
    if dtype == torch.float32:
        return PREFILL_FP32_CONFIG
    return PREFILL_LARGE_CONFIG if rows >= 1024 else PREFILL_SMALL_CONFIG


def prefill_attention_triton(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor,
                             index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                             num_new: torch.Tensor, block_size: int, scale: float, sliding_window: int, *,
                             config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch with the semantics of :func:`prefill_attention_reference` (given the module's contract)."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    query, index, q_positions = launch_inputs(query, index, q_positions)
    num_new = num_new.contiguous()
    out = torch.empty(batch, queries, q_heads, head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(batch, q_heads, queries, dtype=torch.float32, device=query.device)
    cfg = {**prefill_config(queries * group, query.dtype), **(config or {})}
    m_blocks = triton.cdiv(queries * group, cfg["block_m"])
    if batch * queries == 0:
        return out, lse
    _prefill_kernel[(batch * kv_heads, m_blocks)](
        query, k_pool, v_pool, pos_pool, index, lengths, q_positions, num_new, out, lse,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        float(scale), int(sliding_window), queries, m_blocks,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        CAUSAL_SKIP=block_size == page_size, HAS_WINDOW=sliding_window > 0,
        IEEE=query.dtype == torch.float32 or _INTERPRET,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **FP_FUSION,
    )
    return out, lse
