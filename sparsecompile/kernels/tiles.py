"""Triton building blocks shared by the attention kernels that read an AttentionView.

``@triton.jit`` helpers are inlined into their callers, so sharing them costs nothing at run time. Conventions
(see :mod:`.paged_attention`): the pools are ``[num_pages, kv_heads, page_size, (head_dim)]``, so slot ``s`` of
KV head ``h`` is the flat pool row ``((s // PAGE) * KV_HEADS + h) * PAGE + s % PAGE``; a view names, per
(sequence, kv_head), a list of entries (page ids when ``BLOCK == PAGE``, global slot ids when ``BLOCK == 1``);
a program's query rows pack a GQA group: row ``r`` is query ``r // GROUP`` of q head ``h * GROUP + r % GROUP``.
"""

from __future__ import annotations

#: Every launch's compile options: FMA contraction on, as Triton's default has been through 3.9 and as every kernel
#: here was measured and toleranced (3.9 warns that the default turns to off in 3.10; being explicit keeps the
#: kernels' speed and numerics across releases).
FP_FUSION = {"enable_fp_fusion": True}

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def query_rows(Q, QPOS, b, h, rows, stride_qb, stride_qh, stride_qt, stride_pb, num_queries,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """The queries of packed rows ``rows`` of (sequence ``b``, kv head ``h``): ``q [rows, BLOCK_D]`` (0 past
        ``HEAD_DIM`` and past the last query), their positions (-1 past the last query, in ``QPOS``'s dtype), and
        the row coordinates ``t`` (query), ``qh`` (q head), ``row_ok``, ``d`` (channels) and ``dmask``."""
        t = rows // GROUP
        qh = h * GROUP + rows % GROUP
        row_ok = t < num_queries
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        qpos = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1)
        return q, qpos, t, qh, row_ok, d, dmask

    @triton.jit
    def view_rows(INDEX, start, hi, h, KV_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        """Where list slots ``start + [0, BLOCK_N)`` of one (sequence, kv_head) list (``INDEX`` points at it) live:
        flat pool rows ``base [BLOCK_N]`` int64 (for the position pool), their element offsets ``row_ptr`` in the
        K/V pools, and the in-list mask ``j < hi`` (masked slots point at some valid row: load them masked)."""
        j = start + tl.arange(0, BLOCK_N)
        jmask = j < hi
        if BLOCK == PAGE and BLOCK_N % PAGE == 0 and (PAGE & (PAGE - 1)) == 0:
            # page view: one index load per page, PAGE contiguous slots each (start is page-aligned)
            e = start // PAGE + tl.arange(0, BLOCK_N // PAGE)
            page_ids = tl.load(INDEX + e, mask=e * PAGE < hi, other=0)
            first = (page_ids.to(tl.int64) * KV_HEADS + h) * PAGE
            base = tl.reshape(first[:, None] + tl.arange(0, PAGE)[None, :], (BLOCK_N,))
        else:
            entry = tl.load(INDEX + j // BLOCK, mask=jmask, other=0)
            slot = entry.to(tl.int64) * BLOCK + j % BLOCK
            base = ((slot // PAGE) * KV_HEADS + h) * PAGE + slot % PAGE
        row_ptr = tl.multiple_of(base * HEAD_DIM, HEAD_DIM)
        return base, row_ptr, jmask

    @triton.jit
    def load_rows(P, row_ptr, jmask, d, dmask):
        """``[BLOCK_N, BLOCK_D]`` rows of a K or V pool at :func:`view_rows`' ``row_ptr`` (0 where masked)."""
        return tl.load(P + row_ptr[:, None] + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)

    @triton.jit
    def visible(kpos, qpos, window):
        """``[rows, BLOCK_N]``: key position ``kpos`` holds a token (>= 0), is not in the future of query position
        ``qpos`` and, with ``window > 0``, is inside its sliding window (transformers' convention)."""
        vis = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            vis = vis & (kpos[None, :] > qpos[:, None] - window)
        return vis

    @triton.jit
    def softmax_step(s, m_i, l_i):
        """One online-softmax step over a tile of natural-log logits ``s [rows, BLOCK_N]`` (-inf = masked): the new
        running max, the factor ``alpha`` that rescales the old state, the tile's weights ``p`` and the new sum."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay NaN-free
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def natural_lse(m_i, l_i):
        """Log-sum-exp of a row from its running max and sum (natural log; -inf for a row that saw nothing)."""
        return tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
