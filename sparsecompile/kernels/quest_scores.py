"""``sparsecompile::quest_page_scores``: Quest's upper bound on a page's query-key logit.

For a query head ``q`` and a page whose keys have per-channel minimum ``lo`` and maximum ``hi``,
the score is ``sum_c max(q_c * lo_c, q_c * hi_c)``: no key of the page can reach a larger logit
``q . k``. With GQA the query heads of one KV head's group each score the page and the op keeps the
**maximum** over the group, so the KV-head score is still an upper bound on every logit the group
can produce, and a page that matters to any one query head of the group ranks high.
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
    batch, q_heads, dim = query.shape
    kv_heads = kmin.shape[1]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, dim)
    lo = kmin[pages.long()].float()  # [batch, max_pages, kv_heads, dim]
    hi = kmax[pages.long()].float()
    # max(q*lo, q*hi) == q*hi where q >= 0, q*lo where q < 0: two matmuls instead of a 5-d product.
    per_head = (torch.einsum("bhgd,bphd->bhgp", q.clamp(min=0), hi)
                + torch.einsum("bhgd,bphd->bhgp", q.clamp(max=0), lo))
    scores = per_head.amax(dim=2)
    valid = torch.arange(pages.shape[1], device=pages.device)[None, :] < num_pages.long()[:, None]
    return torch.where(valid[:, None, :], scores, torch.full_like(scores, float("-inf")))


if triton is not None:

    @triton.jit
    def _quest_scores_kernel(Q, KMIN, KMAX, PAGES, NUM, OUT, stride_qb, stride_qh, stride_pb, stride_ob, stride_oh,
                             max_pages, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                             IEEE: tl.constexpr):
        # One program: BLOCK_P pages of one sequence, all KV heads (a runtime loop, so loads pipeline). Per head,
        # sum_c max(q_c lo_c, q_c hi_c) = max(q, 0) . hi + min(q, 0) . lo: two tensor-core products
        # [group, dim] x [dim, pages], then the max over the group.
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
            offs = (page[:, None] * KV_HEADS + h) * HEAD_DIM + d[None, :]
            lo = tl.load(KMIN + offs, mask=m2, other=0.0)  # [BLOCK_P, BLOCK_D]
            hi = tl.load(KMAX + offs, mask=m2, other=0.0)
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
                             num_pages: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`quest_page_scores_reference` (``config``: overrides of
    :data:`QUEST_SCORES_CONFIG`)."""
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
        BLOCK_P=block_p, IEEE=kmin.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
