"""``sparsecompile::paged_attention``: attention over the slots an AttentionView names.

One op serves prefill chunks (causal by logical position, padding queries carry position -1) and
decode (one query per sequence). The view names, per ``(sequence, kv_head)``, a list of *entries*:
with ``block_size == page_size`` an entry is a page id (dense and page-selection views), with
``block_size == 1`` an entry is a global slot id (token-selection views). Entry ``e`` covers global
slots ``index[e] * block_size + [0, block_size)``, and ``lengths`` says how many slots are read.

A key slot is visible to a query iff it is inside ``lengths``, holds a token (position >= 0), is
not in the query's future (``k_pos <= q_pos``) and, with a sliding window ``w > 0``, is inside it
(``k_pos > q_pos - w``, transformers' convention). A query that sees no key returns zeros.

The same launch also returns statistics of the attention (log-sum-exp, per-slot token max, logits): those ops are
``paged_attention_variants.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define_op
from .pool import gather_slots, launch_inputs, used_view_slots, visibility
from .tiles import FP_FUSION, load_rows, natural_lse, query_rows, softmax_step, view_rows, visible

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Above this many fp32 score elements the reference processes queries in blocks to bound memory.
_REFERENCE_SCORE_ELEMENTS = 1 << 26


def paged_attention_reference(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor,
                              index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                              block_size: int, scale: float, sliding_window: int) -> torch.Tensor:
    """Torch reference (gathers the view, then SDPA with a boolean mask).

    Args:
        query: ``[batch, q_heads, queries, head_dim]``.
        k_pool, v_pool: ``[num_pages, kv_heads, page_size, head_dim]``; pos_pool ``[num_pages, kv_heads, page_size]``.
        index, lengths: the view (see :func:`view_slots`).
        q_positions: ``[batch, queries]`` logical positions (-1 for padding queries).
    Returns:
        ``[batch, queries, q_heads, head_dim]`` contiguous, in ``query.dtype``.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    group = q_heads // kv_heads
    slots, valid = used_view_slots(index, lengths, block_size)
    # The reference computes in fp32 (a bf16 SDPA with a boolean mask was seen off by up to 3.7 on CUDA).
    keys = gather_slots(k_pool, slots).float()  # [batch, kv_heads, slots, head_dim]
    values = gather_slots(v_pool, slots).float()
    kpos = gather_slots(pos_pool, slots)
    # Fold each GQA group into the query axis (row = g * queries + t): no K/V repetition, one mask pass.
    folded = query.float().reshape(batch, kv_heads, group * queries, head_dim)
    out = torch.empty_like(folded)
    step = max(1, _REFERENCE_SCORE_ELEMENTS // max(1, batch * kv_heads * group * slots.shape[-1]))
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        rows = torch.arange(group, device=query.device)[:, None] * queries + torch.arange(start, stop,
                                                                                          device=query.device)
        rows = rows.reshape(-1)
        mask = visibility(kpos, valid, q_positions[:, start:stop].repeat(1, group), sliding_window)
        part = F.scaled_dot_product_attention(folded[:, :, rows], keys, values, attn_mask=mask, scale=scale)
        out[:, :, rows] = torch.nan_to_num(part, nan=0.0)  # a query that sees no key returns zeros
    return out.reshape(batch, q_heads, queries, head_dim).transpose(1, 2).to(query.dtype).contiguous()


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(Q, K, V, POS, INDEX, LENGTHS, QPOS, OUT, MID_O, MID_LSE, LSE, TOKEN_MAX, LOGITS,
                                stride_qb, stride_qh, stride_qt, stride_ib, stride_ih, stride_lb, stride_lh,
                                stride_pb, stride_ob, stride_ot, stride_oh,
                                scale, window, num_queries, span,
                                KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                                IEEE: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_MAX: tl.constexpr,
                                WRITE_LOGITS: tl.constexpr):
        """One program: BLOCK_M (query, group head) rows of one (sequence, kv_head) over one split of its slots.

        With NUM_SPLITS > 1 (decode, split-KV) it writes a partial output and its log-sum-exp for
        :func:`_combine_kernel`; otherwise the final output. ``WRITE_MAX`` (one row block, so no two programs
        write one entry): per view position, the largest raw logit of the block's rows, ``-inf`` past the list.
        ``WRITE_LOGITS`` (one query): every row's scaled, masked logits per view position, ``-inf`` past the list
        (stored as the [BLOCK_M, BLOCK_N] tile; a row at a time, a reduction per group head, was never the fastest
        of the 48 launches swept on the H200, 2026-12-04).
        """
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        split = tl.program_id(2)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query * GROUP + head-in-group
        q, qpos, t, qh, row_ok, d, dmask = query_rows(Q, QPOS, b, h, rows, stride_qb, stride_qh, stride_qt, stride_pb,
                                                      num_queries, GROUP, HEAD_DIM, BLOCK_D)
        qpos = qpos.to(tl.int64)
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        # Split this list's actual length evenly (in BLOCK_N multiples): work follows lengths, not capacity.
        tokens_per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * tokens_per_split
        hi = tl.minimum(length, lo + tokens_per_split)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        token_max = TOKEN_MAX + pid_bh.to(tl.int64) * span  # (WRITE_MAX) this list's row of the output
        logits = LOGITS + (b * (KV_HEADS * GROUP) + qh).to(tl.int64)[:, None] * span  # (WRITE_LOGITS) rows' outputs
        for start in range(lo, hi, BLOCK_N):
            base, row_ptr, jmask = view_rows(INDEX + b * stride_ib + h * stride_ih, start, hi, h, KV_HEADS, PAGE,
                                             BLOCK, HEAD_DIM, BLOCK_N)
            k = load_rows(K, row_ptr, jmask, d, dmask)
            v = load_rows(V, row_ptr, jmask, d, dmask)
            kpos = tl.load(POS + base, mask=jmask, other=-1).to(tl.int64)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            s = s.to(tl.float32)
            if WRITE_MAX:  # raw logits, before the scale and the visibility mask (OmniKV's filter score)
                j = start + tl.arange(0, BLOCK_N)
                tl.store(token_max + j, tl.max(tl.where(row_ok[:, None], s, float("-inf")), 0), mask=jmask)
            s = s * scale
            s = tl.where(jmask[None, :] & visible(kpos, qpos, window), s, float("-inf"))
            if WRITE_LOGITS:  # [batch, q_heads, span]: qh is the row's q head (one query per sequence)
                j = start + tl.arange(0, BLOCK_N)
                tl.store(logits + j[None, :], s, mask=row_ok[:, None] & jmask[None, :])
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        if WRITE_MAX and split == NUM_SPLITS - 1:  # the positions past the list (no split reads them)
            for start in range(length, span, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                tl.store(token_max + j, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=j < span)
        if WRITE_LOGITS and split == NUM_SPLITS - 1:
            for start in range(length, span, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                tl.store(logits + j[None, :], tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32),
                         mask=row_ok[:, None] & (j < span)[None, :])
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if NUM_SPLITS == 1:
            tl.store(OUT + b * stride_ob + t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
                     out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
            if WRITE_LSE:  # [batch, q_heads, queries], natural log; -inf where the query sees nothing
                tl.store(LSE + (b * (KV_HEADS * GROUP) + qh) * num_queries + t, natural_lse(m_i, l_i), mask=row_ok)
        else:
            # partials laid out [batch, q_heads, queries, NUM_SPLITS, (HEAD_DIM)]
            mid = ((b * (KV_HEADS * GROUP) + qh) * num_queries + t) * NUM_SPLITS + split
            tl.store(MID_LSE + mid, natural_lse(m_i, l_i), mask=row_ok)
            tl.store(MID_O + mid[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & dmask[None, :])

    @triton.jit
    def _combine_kernel(MID_O, MID_LSE, OUT, LSE, stride_ob, stride_ot, stride_oh, num_queries,
                        Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
        """Merge the split partials of one (sequence, query, q_head) row by their log-sum-exp."""
        row = tl.program_id(0)  # (b * Q_HEADS + qh) * num_queries + t
        t = row % num_queries
        qh = (row // num_queries) % Q_HEADS
        b = row // (num_queries * Q_HEADS)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = sp < NUM_SPLITS
        lse = tl.load(MID_LSE + row * NUM_SPLITS + sp, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top)
        o = tl.load(MID_O + (row * NUM_SPLITS + sp)[:, None] * HEAD_DIM + d[None, :],
                    mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(OUT + b * stride_ob + t * stride_ot + qh * stride_oh + d, out.to(OUT.dtype.element_ty),
                 mask=d < HEAD_DIM)
        if WRITE_LSE:
            tl.store(LSE + row, tl.where(total == 0.0, float("-inf"), top + tl.log(tl.where(total == 0.0, 1.0, total))))


def _num_splits(programs: int, span: int, block_n: int, target: int) -> int:
    """Splits per (sequence, kv_head) list: about ``target`` programs (a few waves over the SMs), no more
    than the capacity allows."""
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(span, block_n)))


# Launch configurations, tuned on the H200 with benchmarks/kernel_bench.py --sweep (results in benchmarks/results):
# long decode work (>= 2^20 list slots in the call) prefers 128-slot tiles and fewer, longer splits
# (95% of HBM bandwidth at 32K x 16, 94% at 128K x 4); short work prefers more, shorter splits.
DECODE_LONG_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 3, "target_programs": 264}
DECODE_SHORT_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3, "target_programs": 528}
PREFILL_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2, "target_programs": 528}
# Long decode work that also writes the per-slot max logit (OmniKV's filter layers): twice the splits, 2 stages. At 128K
# x 4: 644 us against 821 with DECODE_LONG_CONFIG, and against 524 + 257 for the attention and a separate score pass
# (results/token_max_ab_h200.jsonl, 48 configs).
DECODE_TOKEN_MAX_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 2, "target_programs": 528}
# Decode that also stores its logits (H2O's update reads them), per work regime: overrides of the long / short config
# above. The fp32 tile's stores need its layout converted out of the MMA's a loop step, which 64-slot tiles on 2 warps
# absorb best: at batch 16 x 2,048 slots 49.6 us against 59.0 with the short config (47.1 without the stores), at batch
# 64 145.2 against 150.4 (137.9) (H200, 48 configs, results/kernels_mass_decode_logits_sweep_h200.jsonl).
DECODE_LOGITS_CONFIGS: dict[str, dict] = {
    "long": {"block_n": 64, "num_warps": 2, "num_stages": 3, "target_programs": 264},
    "short": {"block_n": 64, "num_warps": 2, "num_stages": 2, "target_programs": 264},
}


def paged_attention_triton(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor,
                           index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                           block_size: int, scale: float, sliding_window: int, *, num_splits: int | None = None,
                           config: dict | None = None, with_lse: bool = False, with_token_max: bool = False,
                           with_logits: bool = False):
    """Triton launch with the semantics of :func:`paged_attention_reference`.

    Decode-sized calls (``queries * group <= 16`` rows per KV head) split each slot list across
    programs (flash-decoding) and merge the partials; larger calls tile the query rows. ``with_lse``: also return
    each query's log-sum-exp ``[batch, q_heads, queries]`` fp32 (the merge step has it anyway). ``with_token_max``
    (one query per sequence): also return :func:`token_max_reference`'s ``[batch, kv_heads, span]``. ``with_logits``
    (one query per sequence, implies ``with_lse``): return ``(out, lse, logits)`` with :func:`decode_logits_reference`'s
    ``[batch, q_heads, span]``.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    query, index, q_positions = launch_inputs(query, index, q_positions)
    out = torch.empty(batch, queries, q_heads, head_dim, dtype=query.dtype, device=query.device)
    block_m = 16 if queries * group <= 16 else 64
    m_blocks = triton.cdiv(queries * group, block_m)
    span = index.shape[2] * block_size
    if block_m == 16:
        long_work = batch * kv_heads * span >= 1 << 20
        base = DECODE_LONG_CONFIG if long_work else DECODE_SHORT_CONFIG
        base = DECODE_TOKEN_MAX_CONFIG if with_token_max and long_work else base
        if with_logits:
            base = {**base, **DECODE_LOGITS_CONFIGS["long" if long_work else "short"]}
    else:
        base = PREFILL_CONFIG
    cfg = {**base, **(config or {})}
    block_n = cfg["block_n"]
    splits = num_splits or _num_splits(m_blocks * batch * kv_heads, span, block_n, cfg["target_programs"])
    if splits > 1:
        mid_o = torch.empty(batch, q_heads, queries, splits, head_dim, dtype=torch.float32, device=query.device)
        mid_lse = torch.empty(batch, q_heads, queries, splits, dtype=torch.float32, device=query.device)
    else:
        mid_o = mid_lse = out
    block_d = max(16, triton.next_power_of_2(head_dim))
    with_lse = with_lse or with_logits
    lse = torch.empty(batch, q_heads, queries, dtype=torch.float32, device=query.device) if with_lse else out
    if with_logits:
        check_one_query(query)
        logits = torch.empty(batch, q_heads, span, dtype=torch.float32, device=query.device)
    else:
        logits = out
    if with_token_max:
        check_one_query(query)
        if m_blocks > 1:
            raise ValueError(f"paged_attention_token_max supports up to 64 query heads per KV head, got {group}")
        token_max = torch.empty(batch, kv_heads, span, dtype=torch.float32, device=query.device)
    else:
        token_max = out
    _paged_attention_kernel[(m_blocks, batch * kv_heads, splits)](
        query, k_pool, v_pool, pos_pool, index, lengths, q_positions, out, mid_o, mid_lse, lse, token_max, logits,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        float(scale), int(sliding_window), queries, span,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, IEEE=query.dtype == torch.float32,
        WRITE_LSE=with_lse, WRITE_MAX=with_token_max, WRITE_LOGITS=with_logits,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **FP_FUSION,
    )
    if splits > 1:
        _combine_kernel[(batch * q_heads * queries,)](
            mid_o, mid_lse, out, lse, out.stride(0), out.stride(1), out.stride(2), queries,
            Q_HEADS=q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), WRITE_LSE=with_lse,
            **FP_FUSION,
        )
    if with_logits:
        return out, lse, logits
    if with_token_max:
        return (out, lse, token_max) if with_lse else (out, token_max)
    return (out, lse) if with_lse else out


def check_one_query(query: torch.Tensor) -> None:
    if query.shape[2] != 1:
        raise ValueError(f"this attention variant takes one query per sequence (decode), got {query.shape[2]}")


def _fake(query, k_pool, v_pool, pos_pool, index, lengths, q_positions, block_size, scale, sliding_window):
    batch, q_heads, queries, head_dim = query.shape
    return query.new_empty(batch, queries, q_heads, head_dim)


paged_attention = define_op(
    "paged_attention(Tensor query, Tensor k_pool, Tensor v_pool, Tensor pos_pool, Tensor index, Tensor lengths, "
    "Tensor q_positions, int block_size, float scale, int sliding_window) -> Tensor",
    cpu=paged_attention_reference,
    cuda=paged_attention_triton if triton is not None else None,
    fake=_fake,
)
