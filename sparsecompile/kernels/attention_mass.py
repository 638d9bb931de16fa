"""Attention mass: the softmax probability each slot of an AttentionView receives from a set of queries.

Shared by SnapKV's window scores (``snapkv_scores``: per query head, summed over the window queries),
H2O's accumulation (``h2o_accumulate[_lse]``: averaged over a KV head's query group, added to a
pool-shaped score buffer) and KVzip's scores (``kvzip_scores``: maximum over the group and the
queries). Visibility is exactly :func:`paged_attention.visibility`: a query sees a slot iff it is
inside the view's ``lengths``, holds a token, is not in the query's future and is inside the sliding
window. Probabilities are computed in fp32 whatever the pool dtype; a query that sees no slot gives
nothing.

On CUDA the work is two kernels, neither with atomics:

1. :func:`attention_lse_triton`: each query row's natural-log log-sum-exp over the slots it sees,
   split over the slots (split-K) so that few queries over many keys still fill the GPU; the splits
   are merged with ``torch.logsumexp``. H2O takes the lse from the attention and skips this pass.
2. :func:`attention_mass_triton`: one program per (sequence, kv_head, slot tile) loads its keys once
   and loops over the query rows, ``p = exp(scale * q.k - lse)`` (computed transposed, keys by queries, and
   without the per-element mask where a whole group of query tiles sees the whole slot tile); every output
   element belongs to one program, so it is written with a plain store (or read-add-write into the
   pool-shaped buffer).

The torch references (the CPU path, and what the kernels are tested against) are ``attention_mass_reference.py``.
"""

from __future__ import annotations

import torch

from .attention_mass_reference import MAX, TO_HEAD, TO_KV_HEAD, TO_POOL
from .pool import launch_inputs
from .tiles import FP_FUSION, load_rows, query_rows, view_rows, visible

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    _MAX = tl.constexpr(MAX)
    _TO_POOL, _TO_HEAD, _TO_KV_HEAD = tl.constexpr(TO_POOL), tl.constexpr(TO_HEAD), tl.constexpr(TO_KV_HEAD)

    @triton.jit
    def _key_tile(K, POS, INDEX, h, start, length, d, dmask, KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        """The view slots ``start + [0, BLOCK_N)`` of one (sequence, kv_head) list (``INDEX`` points at it):
        keys ``[BLOCK_N, BLOCK_D]``, positions (-1 past ``length``), pool rows and the in-list mask."""
        base, row_ptr, jmask = view_rows(INDEX, start, length, h, KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
        k = load_rows(K, row_ptr, jmask, d, dmask)
        kpos = tl.load(POS + base, mask=jmask, other=-1).to(tl.int32)  # int32 compares are cheaper than int64
        return k, kpos, base, jmask

    @triton.jit
    def _log2_logits(q, k, kpos, qpos, c, window, IEEE: tl.constexpr):
        """``[rows, BLOCK_N]`` fp32 logits in log2 units (``c = scale * log2(e)``) and their visibility."""
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        # (a Python float arrives as fp64 under inductor)
        return (s.to(tl.float32) * c).to(tl.float32), visible(kpos, qpos, window)

    @triton.jit
    def _lse_kernel(Q, K, POS, INDEX, LENGTHS, QPOS, MID, stride_qb, stride_qh, stride_qt, stride_ib, stride_ih,
                    stride_lb, stride_lh, stride_pb, c, window, num_queries,
                    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """One program: BLOCK_M (query, head-in-group) rows of one (sequence, kv_head) over one split of its
        slots (``c = scale * log2(e)``); writes their partial log-sum-exp to
        ``MID [batch, q_heads, queries, NUM_SPLITS]``."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        split = tl.program_id(2)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query * GROUP + head-in-group
        q, qpos, t, qh, row_ok, d, dmask = query_rows(Q, QPOS, b, h, rows, stride_qb, stride_qh, stride_qt, stride_pb,
                                                      num_queries, GROUP, HEAD_DIM, BLOCK_D)
        qpos = qpos.to(tl.int32)
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N  # page-aligned split bounds
        lo = split * per_split
        hi = tl.minimum(length, lo + per_split)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            k, kpos, _, _ = _key_tile(K, POS, INDEX + b * stride_ib + h * stride_ih, h, start, hi, d, dmask,
                                      KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
            s, vis = _log2_logits(q, k, kpos, qpos, c, window, IEEE)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
        tl.store(MID + ((b * (KV_HEADS * GROUP) + qh) * num_queries + t) * NUM_SPLITS + split, lse, mask=row_ok)

    @triton.jit
    def _dot_t(k, q, IEEE: tl.constexpr):
        """``[BLOCK_N, BLOCK_M]`` fp32 raw logits ``K Q^T``."""
        if IEEE:
            return tl.dot(k, tl.trans(q), input_precision="ieee")
        return tl.dot(k, tl.trans(q))

    @triton.jit
    def _row_tile(Q, QPOS, LSE, b, h, g, r0, rows_total, d, dmask, stride_qb, stride_qh, stride_qt, stride_pb,
                  stride_eb, stride_eh, stride_et, GROUP: tl.constexpr, TARGET: tl.constexpr, BLOCK_M: tl.constexpr):
        """Query rows ``r0 + [0, BLOCK_M)``: ``q [BLOCK_M, BLOCK_D]`` (0 past ``rows_total``), positions (-1 there)
        and the log-sum-exp in log2 units (+inf there, so that those rows give exp2(-inf) = 0)."""
        r = r0 + tl.arange(0, BLOCK_M)
        row_ok = r < rows_total
        if TARGET == _TO_HEAD:
            t = r
            qh = h * GROUP + g + r * 0
        else:
            t = r // GROUP
            qh = h * GROUP + r % GROUP
        qpos = tl.load(QPOS + b * stride_pb + t, mask=row_ok, other=-1).to(tl.int32)
        q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        lse = tl.load(LSE + b * stride_eb + qh * stride_eh + t * stride_et, mask=row_ok, other=float("inf"))
        return q, qpos, lse * 1.4426950408889634

    @triton.jit
    def _mass_kernel(Q, K, POS, INDEX, LENGTHS, QPOS, LSE, OUT, stride_qb, stride_qh, stride_qt, stride_ib,
                     stride_ih, stride_lb, stride_lh, stride_pb, stride_eb, stride_eh, stride_et, stride_ob,
                     stride_oh, c, weight, window, num_queries,
                     KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr, REDUCE: tl.constexpr, TARGET: tl.constexpr, HEADS_OUT: tl.constexpr,
                     SKIP: tl.constexpr, SUPER: tl.constexpr):
        """One program: BLOCK_N view slots of one (sequence, kv_head), their keys loaded once, every query row
        looped over in BLOCK_M tiles (per head of the group for ``TARGET == TO_HEAD``, else all rows at once),
        grouped in super tiles of ``SUPER`` tiles for the visibility decisions.

        The logits are computed transposed, ``s^T = K Q^T [BLOCK_N, BLOCK_M]``, as the backward pass of flash
        attention computes dK: the loop-invariant keys are the register operand and the streamed queries the
        shared-memory one, and the reduction over queries is along the tile's second axis. A super tile that every
        one of its rows sees whole (no causal, window or padding cut; slots that hold no token are dropped per
        column at the end) runs ``exp2(c s - lse)`` and an add per element, without the per-element mask."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // KV_HEADS
        h = pid_bh % KV_HEADS
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        c = tl.cast(c, tl.float32)  # (a Python float arrives as fp64 under inductor)
        length = tl.load(LENGTHS + b * stride_lb + h * stride_lh)
        start = pid_n * BLOCK_N
        k, kpos, base, jmask = _key_tile(K, POS, INDEX + b * stride_ib + h * stride_ih, h, start, length, d, dmask,
                                         KV_HEADS, PAGE, BLOCK, HEAD_DIM, BLOCK_N)
        k = k.to(Q.dtype.element_ty)
        j = start + tl.arange(0, BLOCK_N)
        kmin = tl.min(tl.where(kpos >= 0, kpos, 1 << 30), 0)
        kmax = tl.max(kpos, 0)
        if TARGET == _TO_HEAD:
            rows_total = num_queries  # rows of one head (HEADS_OUT = GROUP)
        else:
            rows_total = num_queries * GROUP  # row = query * GROUP + head-in-group (HEADS_OUT = 1)
        rows_total = tl.where(start < length, rows_total, 0)  # a tile past the list does nothing
        total = tl.zeros([BLOCK_N], tl.float32)
        SUPER_ROWS: tl.constexpr = BLOCK_M * SUPER
        for g in tl.static_range(HEADS_OUT):
            # reduced over the rows once at the end: a per-tile row reduction would cross warps every iteration
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s0 in range(0, rows_total, SUPER_ROWS):
                live = True
                whole = False
                if SKIP:  # one vector load of the super tile's positions decides for all its rows
                    rs = s0 + tl.arange(0, SUPER_ROWS)
                    if TARGET == _TO_HEAD:
                        ts = rs
                    else:
                        ts = rs // GROUP
                    in_rows = rs < rows_total
                    qps = tl.load(QPOS + b * stride_pb + ts, mask=in_rows, other=-1).to(tl.int32)
                    qhi = tl.max(qps, 0)
                    qlo = tl.min(tl.where(qps >= 0, qps, 1 << 30), 0)
                    unpadded = tl.min(tl.where(in_rows, qps, 0), 0) >= 0
                    live = (qhi >= kmin) & ((window <= 0) | (kmax > qlo - window))
                    whole = (kmax <= qlo) & ((window <= 0) | (kmin > qhi - window)) & unpadded
                if live:
                    hi = tl.minimum(s0 + SUPER_ROWS, rows_total)
                    if whole:
                        for r0 in range(s0, hi, BLOCK_M):
                            q, qpos, lse2 = _row_tile(Q, QPOS, LSE, b, h, g, r0, rows_total, d, dmask, stride_qb,
                                                      stride_qh, stride_qt, stride_pb, stride_eb, stride_eh,
                                                      stride_et, GROUP, TARGET, BLOCK_M)
                            s = _dot_t(k, q, IEEE)
                            p = tl.exp2(s * c - lse2[None, :])
                            if REDUCE == _MAX:
                                acc = tl.maximum(acc, p)
                            else:
                                acc += p
                    else:
                        for r0 in range(s0, hi, BLOCK_M):
                            q, qpos, lse2 = _row_tile(Q, QPOS, LSE, b, h, g, r0, rows_total, d, dmask, stride_qb,
                                                      stride_qh, stride_qt, stride_pb, stride_eb, stride_eh,
                                                      stride_et, GROUP, TARGET, BLOCK_M)
                            s = _dot_t(k, q, IEEE)
                            vis = (kpos[:, None] >= 0) & (kpos[:, None] <= qpos[None, :])
                            if window > 0:
                                vis = vis & (kpos[:, None] > qpos[None, :] - window)
                            # where(), not a product: exp2 of an invisible logit can overflow
                            p = tl.where(vis, tl.exp2(s * c - lse2[None, :]), 0.0)
                            if REDUCE == _MAX:
                                acc = tl.maximum(acc, p)
                            else:
                                acc += p
            if REDUCE == _MAX:
                col = tl.max(acc, 1)
            else:
                col = tl.sum(acc, 1)
            col = tl.where(kpos >= 0, col, 0.0)  # a slot without a token got terms from the unmasked tiles
            if TARGET == _TO_HEAD:
                tl.store(OUT + b * stride_ob + (h * GROUP + g) * stride_oh + j, col, mask=jmask)
            else:
                total = col
        if TARGET == _TO_KV_HEAD:
            tl.store(OUT + b * stride_ob + h * stride_oh + j, total, mask=jmask)
        if TARGET == _TO_POOL:
            # each pool slot appears in one (sequence, kv_head) list once, so one program owns it
            old = tl.load(OUT + base, mask=jmask, other=0.0)
            total = (total * weight).to(tl.float32)
            if REDUCE == _MAX:
                new = tl.maximum(old, total)
            else:
                new = old + total
            tl.store(OUT + base, new, mask=jmask)

# Launch configurations (benchmarks/kernel_bench.py --only mass --sweep times the alternatives on the H200);
# the mass pass also takes "skip": False to test every query tile instead of skipping invisible ones, and
# "super": S to decide skipping and masking once per S query tiles. The prefill default is the fastest of 24 at
# H2O's 8192-token chunk (benchmarks/sessions/mass_ab.py, results/mass_ab2_h200.jsonl: 1.59 ms, 260 TFLOP/s of
# QK^T, against 3.41 ms for the kernel before the transposed tiles); super tiles of 16 let the inner loop run
# long enough for its query loads to be pipelined (same tiles and warps: 2.93 ms with super 1, 1.70 with 4).
# The decode default is the fastest of 97 at H2O's decode shape (batch 64, budget 2048; benchmarks/kernel_bench.py
# --only mass_decode --sweep, results/kernels_mass_decode_h200.jsonl): 85.6 us, 71 % of the bandwidth, against 94.9 us
# for 128-slot tiles in 2 stages.
LSE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "target_programs": 528}
MASS_DECODE_CONFIG = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 1}
MASS_PREFILL_CONFIG = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "super": 16}
_MIN_PROGRAMS = 264  # two waves over the H200's 132 SMs
_LOG2E = 1.4426950408889634  # the kernels work in exp2 / log2


def attention_lse_triton(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                         lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                         sliding_window: int, config: dict | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`attention_lse_reference` (``[batch, q_heads, queries]`` fp32)."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    cfg = {**LSE_CONFIG, **(config or {})}
    query, index, q_positions = launch_inputs(query, index, q_positions)
    block_m = 16 if queries * group <= 16 else 64
    m_blocks = triton.cdiv(queries * group, block_m)
    programs = m_blocks * batch * kv_heads
    span = index.shape[2] * block_size
    splits = 1 if programs >= cfg["target_programs"] else max(1, min(triton.cdiv(cfg["target_programs"], programs),
                                                                     triton.cdiv(span, cfg["block_n"])))
    mid = torch.empty(batch, q_heads, queries, splits, dtype=torch.float32, device=query.device)
    _lse_kernel[(m_blocks, batch * kv_heads, splits)](
        query, k_pool, pos_pool, index, lengths, q_positions, mid,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0), float(scale) * _LOG2E, int(sliding_window),
        queries,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=cfg["block_n"],
        NUM_SPLITS=splits, IEEE=query.dtype == torch.float32, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **FP_FUSION,
    )
    return mid[..., 0] if splits == 1 else torch.logsumexp(mid, -1)


def attention_mass_triton(out: torch.Tensor, query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor,
                          index: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor, lse: torch.Tensor,
                          block_size: int, scale: float, sliding_window: int, reduce: int, target: int,
                          weight: float = 1.0, config: dict | None = None) -> None:
    """Triton launch: reduce ``p = exp(scale * q.k - lse)`` over queries (and group heads) into ``out``.

    ``target``: ``TO_HEAD`` stores ``out [batch, q_heads, >= span]`` (per query head), ``TO_KV_HEAD`` stores
    ``out [batch, kv_heads, >= span]`` (over the group too), both indexed by view column (last dim contiguous;
    columns past ``lengths`` are left as they are); ``TO_POOL`` combines ``weight`` x the result into the
    pool-shaped ``out [num_pages, kv_heads, page_size]`` (contiguous) at each view slot (add for ``SUM``).
    ``lse``: ``[batch, q_heads, queries]`` fp32, any strides.
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    query, index, q_positions = launch_inputs(query, index, q_positions)
    rows = queries if target == TO_HEAD else queries * group
    cfg = {**(MASS_DECODE_CONFIG if rows <= 16 else MASS_PREFILL_CONFIG), **(config or {})}
    block_m = min(cfg["block_m"], max(16, triton.next_power_of_2(rows)))
    block_n = cfg["block_n"]
    span = index.shape[2] * block_size
    while block_n > 32 and batch * kv_heads * triton.cdiv(span, block_n) < _MIN_PROGRAMS:
        block_n //= 2  # few long lists (one prompt): smaller slot tiles for more programs
    _mass_kernel[(triton.cdiv(span, block_n), batch * kv_heads)](
        query, k_pool, pos_pool, index, lengths, q_positions, lse, out,
        query.stride(0), query.stride(1), query.stride(2), index.stride(0), index.stride(1),
        lengths.stride(0), lengths.stride(1), q_positions.stride(0), lse.stride(0), lse.stride(1), lse.stride(2),
        out.stride(0) if target != TO_POOL else 0, out.stride(1) if target != TO_POOL else 0,
        float(scale) * _LOG2E, float(weight), int(sliding_window), queries,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, BLOCK=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32, REDUCE=reduce, TARGET=target,
        HEADS_OUT=group if target == TO_HEAD else 1, SKIP=cfg.get("skip", True) and rows > block_m,
        SUPER=cfg.get("super", 1),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **FP_FUSION,
    )


def view_scores_triton(query: torch.Tensor, k_pool: torch.Tensor, pos_pool: torch.Tensor, index: torch.Tensor,
                       lengths: torch.Tensor, q_positions: torch.Tensor, block_size: int, scale: float,
                       sliding_window: int, reduce: int, target: int, lse_config: dict | None = None,
                       mass_config: dict | None = None) -> torch.Tensor:
    """Triton launches (the queries' lse, then the mass pass) with the semantics of :func:`view_scores_reference`."""
    heads = k_pool.shape[1] if target == TO_KV_HEAD else query.shape[1]
    out = torch.zeros(query.shape[0], heads, index.shape[-1] * block_size, dtype=torch.float32, device=query.device)
    lse = attention_lse_triton(query, k_pool, pos_pool, index, lengths, q_positions, block_size, scale,
                               sliding_window, config=lse_config)
    attention_mass_triton(out, query, k_pool, pos_pool, index, lengths, q_positions, lse, block_size, scale,
                          sliding_window, reduce, target, config=mass_config)
    return out
