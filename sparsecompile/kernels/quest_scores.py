"""``sparsecompile::quest_page_scores``: Quest's upper bound on a page's query-key logit.

For a query head ``q`` and a page whose keys have per-channel minimum ``lo`` and maximum ``hi``,
the score is ``sum_c max(q_c * lo_c, q_c * hi_c)``: no key of the page can reach a larger logit
``q . k``. With GQA the query heads of one KV head's group each score the page and the op keeps the
**maximum** over the group, so the KV-head score is still an upper bound on every logit the group
can produce, and a page that matters to any one query head of the group ranks high.

``quest_page_scores_affine`` takes the bounds from asymmetric quantization metadata instead: a page of ``groups``
quantization groups whose channel ``c`` in group ``g`` holds ``zero[g, c] + code * step[g, c]`` with integer codes
in ``[0, levels]`` (a KIVI key group: its minimum is the zero, its maximum ``zero + levels * step``) is bounded by
``lo = min_g zero``, ``hi = max_g (zero + levels * step)``; the same score follows.
"""

from __future__ import annotations

import torch

from .library import define_op
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def quest_page_scores_reference(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                                num_pages: torch.Tensor) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, head_dim]`` (one decode query per sequence).
        kmin, kmax: ``[pool_pages, kv_heads, head_dim]`` per-page, per-channel key minimum / maximum.
        pages: ``[batch, max_pages]`` integer pool page ids of each sequence's row-local pages (block-table row).
        num_pages: ``[batch]`` integer row-local pages in use; entries at or past it score ``-inf``.
    Returns:
        ``[batch, kv_heads, max_pages]`` float32 scores.
    """
    return _scores_from_bounds(query, kmin[pages.long()].float(), kmax[pages.long()].float(), num_pages)


def quest_page_scores_affine_reference(query: torch.Tensor, zero: torch.Tensor, step: torch.Tensor,
                                       pages: torch.Tensor, num_pages: torch.Tensor, levels: int) -> torch.Tensor:
    """Torch reference of the bounds from quantization metadata.

    Args:
        query, pages, num_pages: as :func:`quest_page_scores_reference`.
        zero, step: ``[pool_pages, kv_heads, groups, head_dim]`` per-group, per-channel zero point and step (scale).
        levels: the largest code (``2^bits - 1``).
    Returns:
        ``[batch, kv_heads, max_pages]`` float32 scores.
    """
    z = zero[pages.long()].float()  # [batch, max_pages, kv_heads, groups, dim]
    return _scores_from_bounds(query, z.amin(3), (z + levels * step[pages.long()].float()).amax(3), num_pages)


def _scores_from_bounds(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                        num_pages: torch.Tensor) -> torch.Tensor:
    """Scores of the gathered bounds ``lo, hi [batch, max_pages, kv_heads, dim]`` fp32."""
    batch, q_heads, dim = query.shape
    kv_heads = lo.shape[2]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, dim)
    # max(q*lo, q*hi) == q*hi where q >= 0, q*lo where q < 0: two matmuls instead of a 5-d product.
    per_head = (torch.einsum("bhgd,bphd->bhgp", q.clamp(min=0), hi)
                + torch.einsum("bhgd,bphd->bhgp", q.clamp(max=0), lo))
    scores = per_head.amax(dim=2)
    valid = torch.arange(lo.shape[1], device=lo.device)[None, :] < num_pages.long()[:, None]
    return torch.where(valid[:, None, :], scores, torch.full_like(scores, float("-inf")))


if triton is not None:

    @triton.jit
    def _quest_scores_kernel(Q, KMIN, KMAX, PAGES, NUM, OUT, stride_qb, stride_qh, stride_pb, stride_ob, stride_oh,
                             max_pages, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                             IEEE: tl.constexpr, LEVELS: tl.constexpr = 0, NG: tl.constexpr = 1):
        # One program: BLOCK_P pages of one sequence, all KV heads (a runtime loop, so loads pipeline). Per head,
        # sum_c max(q_c lo_c, q_c hi_c) = max(q, 0) . hi + min(q, 0) . lo: two tensor-core products
        # [group, dim] x [dim, pages], then the max over the group. LEVELS > 0: KMIN / KMAX are a page's NG groups'
        # zeros and steps [pages, heads, NG, dim], the bounds min_g zero and max_g (zero + LEVELS * step).
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        used = tl.load(NUM + b).to(tl.int64)
        valid = (j < max_pages) & (j < used)
        page = tl.load(PAGES + b * stride_pb + j, mask=valid, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        m2 = valid[:, None] & dmask[None, :]
        for h in range(KV_HEADS):
            if LEVELS == 0:
                offs = (page[:, None] * KV_HEADS + h) * HEAD_DIM + d[None, :]
                lo = tl.load(KMIN + offs, mask=m2, other=0.0)  # [BLOCK_P, BLOCK_D]
                hi = tl.load(KMAX + offs, mask=m2, other=0.0)
            else:
                lo32 = tl.full([BLOCK_P, BLOCK_D], float("inf"), tl.float32)
                hi32 = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
                for gi in tl.static_range(NG):
                    offs = ((page[:, None] * KV_HEADS + h) * NG + gi) * HEAD_DIM + d[None, :]
                    z = tl.load(KMIN + offs, mask=m2, other=0.0).to(tl.float32)
                    lo32 = tl.minimum(lo32, z)
                    hi32 = tl.maximum(hi32, z + LEVELS * tl.load(KMAX + offs, mask=m2, other=0.0).to(tl.float32))
                lo = lo32.to(KMIN.dtype.element_ty)
                hi = hi32.to(KMIN.dtype.element_ty)
            q = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0).to(lo.dtype)  # [BLOCK_G, BLOCK_D]
            zero = tl.zeros_like(q)
            # (Triton computes bf16 min / max in fp32: cast back for the tensor-core operands.)
            q_pos, q_neg = tl.maximum(q, zero).to(lo.dtype), tl.minimum(q, zero).to(lo.dtype)
            if IEEE:
                s = tl.dot(q_pos, tl.trans(hi), input_precision="ieee")
                s = tl.dot(q_neg, tl.trans(lo), s, input_precision="ieee")
            else:
                s = tl.dot(q_pos, tl.trans(hi))
                s = tl.dot(q_neg, tl.trans(lo), s)
            best = tl.max(tl.where(gmask[:, None], s, float("-inf")), 0)  # [BLOCK_P]
            best = tl.where(valid, best, float("-inf"))
            tl.store(OUT + b * stride_ob + h * stride_oh + j, best, mask=j < max_pages)


#: Launch configuration (``benchmarks/sessions/quest_ops_sweep.py`` times alternatives on the H200): pages per
#: program (up to this many; fewer for short tables), warps, pipeline stages.
QUEST_SCORES_CONFIG = {"block_p": 64, "num_warps": 4, "num_stages": 3}


def quest_page_scores_triton(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                             num_pages: torch.Tensor, config: dict | None = None, levels: int = 0) -> torch.Tensor:
    """Triton launch with the semantics of :func:`quest_page_scores_reference` (``config``: overrides of
    :data:`QUEST_SCORES_CONFIG`); ``levels > 0``: of :func:`quest_page_scores_affine_reference` (``kmin, kmax``
    the zeros and steps)."""
    batch, q_heads, dim = query.shape
    kv_heads = kmin.shape[1]
    max_pages = pages.shape[1]
    if query.stride(2) != 1:
        query = query.contiguous()
    if pages.stride(1) != 1:
        pages = pages.contiguous()
    kmin, kmax, num_pages = kmin.contiguous(), kmax.contiguous(), num_pages.contiguous()
    out = torch.empty(batch, kv_heads, max_pages, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    group = q_heads // kv_heads
    cfg = {**QUEST_SCORES_CONFIG, **(config or {})}
    block_p = min(cfg["block_p"], max(16, triton.next_power_of_2(max_pages)))
    _quest_scores_kernel[(batch, triton.cdiv(max_pages, block_p))](
        query, kmin, kmax, pages, num_pages, out, query.stride(0), query.stride(1), pages.stride(0),
        out.stride(0), out.stride(1), max_pages, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_P=block_p, IEEE=kmin.dtype == torch.float32, LEVELS=int(levels), NG=kmin.shape[2] if levels else 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **FP_FUSION,
    )
    return out


def _fake(query, kmin, kmax, pages, num_pages):
    return query.new_empty(query.shape[0], kmin.shape[1], pages.shape[1], dtype=torch.float32)


quest_page_scores = define_op(
    "quest_page_scores(Tensor query, Tensor kmin, Tensor kmax, Tensor pages, Tensor num_pages) -> Tensor",
    cpu=quest_page_scores_reference,
    cuda=quest_page_scores_triton if triton is not None else None,
    fake=_fake,
)


def _affine_triton(query, zero, step, pages, num_pages, levels):
    return quest_page_scores_triton(query, zero, step, pages, num_pages, levels=levels)


def _fake_affine(query, zero, step, pages, num_pages, levels):
    return _fake(query, zero, step, pages, num_pages)


quest_page_scores_affine = define_op(
    "quest_page_scores_affine(Tensor query, Tensor zero, Tensor step, Tensor pages, Tensor num_pages, int levels) "
    "-> Tensor",
    cpu=quest_page_scores_affine_reference,
    cuda=_affine_triton if triton is not None else None,
    fake=_fake_affine,
)
