"""``sparsecompile::kv_write``: scatter new keys, values and their logical positions into the paged pool.

Pool layout (shared by every op): ``k_pool, v_pool [num_pages, kv_heads, page_size, head_dim]`` and
``pos_pool [num_pages, kv_heads, page_size]`` (int32 logical position, -1 = empty slot). A *global
slot id* ``g`` names ``(page = g // page_size, offset = g % page_size)``; every KV head of a token
is written at the same slot id, while later eviction may give each head its own positions.

``sparsecompile::kv_write_bounds`` writes the same and keeps per-page *key bounds* up to date: the per-channel
minimum and maximum key of every page and KV head (``kmin, kmax [num_pages + 1, kv_heads, head_dim]``, the last
page the pool's trash page), the page summaries that query-aware page selection scores (Quest). Folding the bound
update into the write costs the decode step no launch of its own (a separate one-token update was 1.7 us a layer
on the H200, ``results/profile_quest_32k_b1_rule.txt``).
"""

from __future__ import annotations

import torch

from .library import define_op
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def kv_write_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Torch reference.

    Args:
        k_pool, v_pool: ``[num_pages, kv_heads, page_size, head_dim]``, written in place.
        pos_pool: ``[num_pages, kv_heads, page_size]`` int32, written in place.
        key, value: ``[batch, kv_heads, tokens, head_dim]`` (any strides).
        slots: ``[batch, tokens]`` int64 global slot ids; ``-1`` skips the token (padding).
        positions: ``[batch, tokens]`` int64 logical positions.
    """
    page_size = k_pool.shape[2]
    keep = slots >= 0
    slot = slots[keep]
    page, offset = slot // page_size, slot % page_size
    # key[b, :, t] for kept (b, t) -> [n, kv_heads, head_dim]
    k_rows = key.permute(0, 2, 1, 3)[keep]
    v_rows = value.permute(0, 2, 1, 3)[keep]
    k_pool[page, :, offset] = k_rows.to(k_pool.dtype)
    v_pool[page, :, offset] = v_rows.to(v_pool.dtype)
    pos_pool[page, :, offset] = positions[keep].to(pos_pool.dtype)[:, None]


if triton is not None:

    @triton.jit
    def _kv_write_kernel(k_pool, v_pool, pos_pool, key, value, slots, positions,
                         stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                         tokens, kv_heads: tl.constexpr, page_size: tl.constexpr, head_dim: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # b * tokens + t
        head = tl.program_id(1)
        b = row // tokens
        t = row % tokens
        slot = tl.load(slots + row)
        if slot >= 0:
            page = slot // page_size
            offset = slot % page_size
            d = tl.arange(0, BLOCK_D)
            dmask = d < head_dim
            dst = ((page * kv_heads + head) * page_size + offset) * head_dim
            k = tl.load(key + b * stride_kb + head * stride_kh + t * stride_kt + d, mask=dmask)
            v = tl.load(value + b * stride_vb + head * stride_vh + t * stride_vt + d, mask=dmask)
            tl.store(k_pool + dst + d, k.to(k_pool.dtype.element_ty), mask=dmask)
            tl.store(v_pool + dst + d, v.to(v_pool.dtype.element_ty), mask=dmask)
            pos = tl.load(positions + row)
            tl.store(pos_pool + (page * kv_heads + head) * page_size + offset, pos.to(tl.int32))


def kv_write_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Triton launch with the semantics of :func:`kv_write_reference` (the last dim of key/value must be dense)."""
    batch, kv_heads, tokens, head_dim = key.shape
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    slots = slots.contiguous()
    positions = positions.contiguous()
    grid = (batch * tokens, kv_heads)
    _kv_write_kernel[grid](
        k_pool, v_pool, pos_pool, key, value, slots, positions,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        tokens, kv_heads, k_pool.shape[2], head_dim, triton.next_power_of_2(head_dim),
        **FP_FUSION,
    )


def _fake(k_pool, v_pool, pos_pool, key, value, slots, positions) -> None:
    return None


kv_write = define_op(
    "kv_write(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) pos_pool, Tensor key, Tensor value, "
    "Tensor slots, Tensor positions) -> ()",
    cpu=kv_write_reference,
    cuda=kv_write_triton if triton is not None else None,
    fake=_fake,
)


def page_bounds_update_reference(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, slots: torch.Tensor,
                                 page_size: int) -> None:
    """Fold new keys into their pages' per-channel key minimum / maximum (in place; no host sync).

    Args:
        kmin, kmax: ``[pool_pages + 1, kv_heads, head_dim]``; the last page is the pool's trash page, which absorbs
            padding so that every shape stays static.
        key: ``[batch, kv_heads, tokens, head_dim]`` new keys.
        slots: ``[batch, tokens]`` int64 global slot ids of the new keys (-1 = padding). A key landing on its
            page's first slot resets that page's bounds (slots are appended in order, so offset 0 is a page's
            first write; pages are reused after eviction or release).
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


def kv_write_bounds_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, kmin: torch.Tensor,
                              kmax: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                              positions: torch.Tensor) -> None:
    """Torch reference: :func:`kv_write_reference`, then the new keys folded into their pages' bounds
    (:func:`page_bounds_update_reference`; ``kmin, kmax [num_pages + 1, kv_heads, head_dim]``).

    One op with declared mutations rather than inline torch code: inside a compiled decode graph, functionalising
    ``scatter_reduce_`` on the pool-sized bounds made inductor copy them whole every layer."""
    kv_write_reference(k_pool, v_pool, pos_pool, key, value, slots, positions)
    page_bounds_update_reference(kmin, kmax, key, slots, k_pool.shape[2])


if triton is not None:

    @triton.jit
    def _kv_write_bounds_kernel(k_pool, v_pool, pos_pool, kmin, kmax, key, value, slots, positions,
                                stride_kb, stride_kh, stride_vb, stride_vh,
                                kv_heads: tl.constexpr, page_size: tl.constexpr, head_dim: tl.constexpr,
                                BLOCK_D: tl.constexpr):
        # One program per (sequence, KV head) of a one-token step: no two programs touch one page's bounds.
        b = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots + b)
        if slot >= 0:
            page = slot // page_size
            offset = slot % page_size
            d = tl.arange(0, BLOCK_D)
            dmask = d < head_dim
            dst = ((page * kv_heads + head) * page_size + offset) * head_dim
            bounds = (page * kv_heads + head) * head_dim + d
            # every load before the first store: issued together, their latencies overlap (the launch is all latency)
            k = tl.load(key + b * stride_kb + head * stride_kh + d, mask=dmask)
            v = tl.load(value + b * stride_vb + head * stride_vh + d, mask=dmask)
            pos = tl.load(positions + b)
            lo = tl.load(kmin + bounds, mask=dmask, other=0.0)
            hi = tl.load(kmax + bounds, mask=dmask, other=0.0)
            tl.store(k_pool + dst + d, k.to(k_pool.dtype.element_ty), mask=dmask)
            tl.store(v_pool + dst + d, v.to(v_pool.dtype.element_ty), mask=dmask)
            tl.store(pos_pool + (page * kv_heads + head) * page_size + offset, pos.to(tl.int32))
            kb = k.to(kmin.dtype.element_ty)
            first = offset == 0  # the page's first write resets its bounds
            tl.store(kmin + bounds, tl.where(first, kb, tl.minimum(lo, kb)).to(kmin.dtype.element_ty), mask=dmask)
            tl.store(kmax + bounds, tl.where(first, kb, tl.maximum(hi, kb)).to(kmax.dtype.element_ty), mask=dmask)


def kv_write_bounds_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, pos_pool: torch.Tensor, kmin: torch.Tensor,
                           kmax: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor) -> None:
    """CUDA: one token per sequence (decode) in one Triton launch; several (prefill, where keys of one page would
    race on its bounds) as :func:`kv_write_triton` plus the torch bound update."""
    batch, kv_heads, tokens, head_dim = key.shape
    if tokens != 1 or not (kmin.is_contiguous() and kmax.is_contiguous()):
        kv_write_triton(k_pool, v_pool, pos_pool, key, value, slots, positions)
        page_bounds_update_reference(kmin, kmax, key, slots, k_pool.shape[2])
        return
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    _kv_write_bounds_kernel[(batch, kv_heads)](
        k_pool, v_pool, pos_pool, kmin, kmax, key, value, slots.contiguous(), positions.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_heads, k_pool.shape[2], head_dim, triton.next_power_of_2(head_dim),
        **FP_FUSION,
    )


def _fake_bounds(k_pool, v_pool, pos_pool, kmin, kmax, key, value, slots, positions) -> None:
    return None


kv_write_bounds = define_op(
    "kv_write_bounds(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) pos_pool, Tensor(d!) kmin, Tensor(e!) kmax, "
    "Tensor key, Tensor value, Tensor slots, Tensor positions) -> ()",
    cpu=kv_write_bounds_reference,
    cuda=kv_write_bounds_triton if triton is not None else None,
    fake=_fake_bounds,
)
