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

    @triton.jit
    def _page_minmax_decode_kernel(KMIN, KMAX, KEY, SLOTS, stride_kb, stride_kh, stride_sb, trash_page,
                                   PAGE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program per sequence: its one new key (all KV heads) folded into its page, or the page reset.
        b = tl.program_id(0)
        slot = tl.load(SLOTS + b * stride_sb).to(tl.int64)
        page = tl.where(slot >= 0, slot // PAGE, trash_page)  # padding rows land on the trash page
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        m2 = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        key = tl.load(KEY + b * stride_kb + h[:, None] * stride_kh + d[None, :], mask=m2, other=0.0)
        key = key.to(KMIN.dtype.element_ty)
        offs = (page * KV_HEADS + h[:, None]) * HEAD_DIM + d[None, :]
        first = (slot >= 0) & (slot % PAGE == 0)
        lo = tl.load(KMIN + offs, mask=m2, other=0.0)
        hi = tl.load(KMAX + offs, mask=m2, other=0.0)
        tl.store(KMIN + offs, tl.where(first, key, tl.minimum(lo, key)).to(KMIN.dtype.element_ty), mask=m2)
        tl.store(KMAX + offs, tl.where(first, key, tl.maximum(hi, key)).to(KMAX.dtype.element_ty), mask=m2)


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


def page_minmax_update_reference(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, slots: torch.Tensor,
                                 page_size: int) -> None:
    """Fold new keys into their pages' per-channel key minimum / maximum (in place; no host sync).

    Args:
        kmin, kmax: ``[pool_pages + 1, kv_heads, head_dim]``; the last page is the pool's trash page, which absorbs
            padding so that every shape stays static.
        key: ``[batch, kv_heads, tokens, head_dim]`` new keys.
        slots: ``[batch, tokens]`` int64 global slot ids of the new keys (-1 = padding). A key landing on its
            page's first slot resets that page's summary (pages are reused after eviction or release).

    One op rather than inline torch code: inside a compiled decode graph, functionalising ``scatter_reduce_``
    on the pool-sized summaries made inductor copy them whole every layer; an op with declared mutations keeps
    the update in place (its cost is the new keys, not the pool).
    """
    kv_heads, dim = kmin.shape[1], kmin.shape[2]
    trash_page = kmin.shape[0] - 1
    flat = slots.reshape(-1)
    valid = flat >= 0
    trash = torch.full_like(flat, trash_page)
    page = torch.where(valid, flat // page_size, trash)
    first = torch.where(valid & (flat % page_size == 0), page, trash)
    keys = key.transpose(1, 2).reshape(-1, kv_heads, dim).to(kmin.dtype)  # [batch * tokens, kv_heads, head_dim]
    kmin.index_put_((first,), torch.full_like(keys, float("inf")))
    kmax.index_put_((first,), torch.full_like(keys, float("-inf")))
    index = page[:, None, None].expand(-1, kv_heads, dim).contiguous()  # a stride-0 index hits a slow CPU path
    kmin.scatter_reduce_(0, index, keys, reduce="amin", include_self=True)
    kmax.scatter_reduce_(0, index, keys, reduce="amax", include_self=True)


def _page_minmax_update_fake(kmin, kmax, key, slots, page_size) -> None:
    return None


def page_minmax_update_triton(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, slots: torch.Tensor,
                              page_size: int) -> None:
    """CUDA: one new key per sequence (decode) in one Triton launch; several (prefill, where keys of one page
    would race) through the reference."""
    kv_heads, dim = kmin.shape[1], kmin.shape[2]
    if key.shape[2] != 1 or not (kmin.is_contiguous() and kmax.is_contiguous()):
        page_minmax_update_reference(kmin, kmax, key, slots, page_size)
        return
    if key.stride(3) != 1:
        key = key.contiguous()
    _page_minmax_decode_kernel[(key.shape[0],)](
        kmin, kmax, key, slots, key.stride(0), key.stride(1), slots.stride(0), kmin.shape[0] - 1,
        PAGE=page_size, KV_HEADS=kv_heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )


page_minmax_update = define_op(
    "page_minmax_update(Tensor(a!) kmin, Tensor(b!) kmax, Tensor key, Tensor slots, int page_size) -> ()",
    cpu=page_minmax_update_reference, cuda=page_minmax_update_triton if triton is not None else None,
    fake=_page_minmax_update_fake)
