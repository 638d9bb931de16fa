"""``sparsecompile::omnikv_scores``: OmniKV's "last" selector score of every cached token.

For each candidate slot ``j`` of a sequence, the score is the largest raw logit ``q_h . k_j`` over
all query heads ``h`` (each against the key of its own KV head), with the current decode query. No
softmax and no ``1/sqrt(d)``: neither changes the ranking. One score per token, shared by every
head, because OmniKV selects one token set per sequence.
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


def omnikv_scores_reference(query: torch.Tensor, k_pool: torch.Tensor, pages: torch.Tensor,
                            limit: torch.Tensor) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[batch, q_heads, head_dim]`` (one decode query per sequence).
        k_pool: ``[pool_pages, kv_heads, page_size, head_dim]``.
        pages: ``[batch, max_pages]`` integer pool page ids of each sequence's row-local pages (block-table row).
        limit: ``[batch]`` integer: row-local slots ``0 .. limit-1`` are candidates; the rest score ``-inf``.
    Returns:
        ``[batch, max_pages * page_size]`` float32 scores by row-local slot.
    """
    batch, q_heads, dim = query.shape
    kv_heads = k_pool.shape[1]
    keys = k_pool[pages.long()].float()  # [batch, max_pages, kv_heads, page_size, dim]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, dim)  # [batch, kv_heads, slots, dim]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, dim)
    scores = torch.einsum("bhgd,bhsd->bhgs", q, keys).amax(dim=(1, 2))
    valid = torch.arange(scores.shape[1], device=scores.device)[None, :] < limit.long()[:, None]
    return torch.where(valid, scores, torch.full_like(scores, float("-inf")))


if triton is not None:

    @triton.jit
    def _omnikv_scores_kernel(Q, K, PAGES, LIMIT, OUT, stride_qb, stride_qh, stride_pb, stride_ob, slots,
                              KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_S: tl.constexpr, IEEE: tl.constexpr):
        # One program: BLOCK_S slots of one sequence; per KV head, the group's logits come from one tensor-core
        # product [group, dim] x [dim, slots] (the KV-head loop is a runtime loop, so its loads pipeline).
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        limit = tl.load(LIMIT + b).to(tl.int64)
        valid = (j < slots) & (j < limit)
        page = tl.load(PAGES + b * stride_pb + j // PAGE, mask=valid, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        best = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for h in range(KV_HEADS):
            base = ((page * KV_HEADS + h) * PAGE + j % PAGE) * HEAD_DIM
            k = tl.load(K + base[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            q = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            best = tl.maximum(best, tl.max(tl.where(gmask[:, None], s, float("-inf")), 0))
        best = tl.where(valid, best, float("-inf"))
        tl.store(OUT + b * stride_ob + j, best, mask=j < slots)


def omnikv_scores_triton(query: torch.Tensor, k_pool: torch.Tensor, pages: torch.Tensor,
                         limit: torch.Tensor) -> torch.Tensor:
    """Triton launch with the semantics of :func:`omnikv_scores_reference`."""
    batch, q_heads, dim = query.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    slots = pages.shape[1] * page_size
    if query.stride(2) != 1:
        query = query.contiguous()
    if pages.stride(1) != 1:
        pages = pages.contiguous()
    limit = limit.contiguous()
    out = torch.empty(batch, slots, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    block_s = min(128, max(16, triton.next_power_of_2(slots)))
    group = q_heads // kv_heads
    _omnikv_scores_kernel[(batch, triton.cdiv(slots, block_s))](
        query, k_pool, pages, limit, out, query.stride(0), query.stride(1), pages.stride(0), out.stride(0), slots,
        KV_HEADS=kv_heads, GROUP=group, PAGE=page_size, HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_S=block_s, IEEE=query.dtype == torch.float32, num_warps=4, num_stages=3,
        **FP_FUSION,
    )
    return out


def _fake(query, k_pool, pages, limit):
    return query.new_empty(query.shape[0], pages.shape[1] * k_pool.shape[2], dtype=torch.float32)


omnikv_scores = define_op(
    "omnikv_scores(Tensor query, Tensor k_pool, Tensor pages, Tensor limit) -> Tensor",
    cpu=omnikv_scores_reference,
    cuda=omnikv_scores_triton if triton is not None else None,
    fake=_fake,
)
