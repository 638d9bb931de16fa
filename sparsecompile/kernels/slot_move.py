"""``sparsecompile::move_slots``: copy row-local slots to other slots of the same row and KV head, in every pool.

``pools``: ``[k_pool, v_pool, pos_pool, *metadata]`` as in ``kv_write.py``: ``k_pool, v_pool [num_pages, kv_heads,
page_size, head_dim]``, ``pos_pool`` and any per-slot metadata ``[num_pages, kv_heads, page_size]``. One list,
never empty: an AOTInductor package calls the op through its proxy executor, which passes an *empty* tensor-list
argument as None (a separate, empty metadata list broke StreamingLLM's exported decode: no per-slot metadata).
A row-local slot ``s`` of a row lives at page ``table[row, s // page_size]``, offset ``s % page_size``. Each pair
``(src, dst)`` of ``[batch, kv_heads, n]`` copies the slot's key, value, position and metadata; a pair with a
negative side is skipped.

Contract: within a ``(row, head)`` the source slots and the destination slots are disjoint sets (a hole is
filled from a slot that is not itself a hole). That is what decode eviction needs (holes below the new count,
sources in the tail above it), and it lets the kernel copy pair by pair with no ordering between programs. One op
instead of the traced gathers and scatters of every pool: a compiled decode step with eviction every token then
holds a single node per layer for the move (it was about 70, which inductor compiled as many small kernels).
"""

from __future__ import annotations

import math

import torch

from .library import define_op
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def _global(table: torch.Tensor, local: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-local slots ``[batch, kv_heads, n]`` (>= 0) -> ``(page, offset)`` through ``table [batch, max_pages]``."""
    batch = local.shape[0]
    pages = table.long().gather(1, (local // page_size).reshape(batch, -1)).reshape(local.shape)
    return pages, local % page_size


def move_slots_reference(pools: list[torch.Tensor], table: torch.Tensor, src: torch.Tensor,
                         dst: torch.Tensor) -> None:
    """Torch reference.

    Args:
        pools: ``[k_pool, v_pool, pos_pool, *metadata]`` (see module docstring), written in place.
        table: ``[batch, max_pages]`` the rows' block-table rows for this layer (int32 or int64).
        src, dst: ``[batch, kv_heads, n]`` int64 row-local slots; a pair with ``src < 0`` or ``dst < 0`` is skipped.
    """
    page_size = pools[2].shape[2]
    ok = (src >= 0) & (dst >= 0)
    src_page, src_off = _global(table, src.clamp(min=0), page_size)
    dst_page, dst_off = _global(table, dst.clamp(min=0), page_size)
    head = torch.arange(src.shape[1], device=src.device)[None, :, None].expand_as(src)
    values = [pool[src_page[ok], head[ok], src_off[ok]] for pool in pools]  # read everything before writing
    for pool, value in zip(pools, values):
        pool[dst_page[ok], head[ok], dst_off[ok]] = value


if triton is not None:

    @triton.jit
    def copy_slot(k_pool, v_pool, n0, n1, n2, table_row, head, s, d, WIDE: tl.constexpr, NARROW: tl.constexpr,
                  kv_heads: tl.constexpr, page_size: tl.constexpr, elems: tl.constexpr, BLOCK_E: tl.constexpr):
        """Copy row-local slot ``s`` of one (row, ``head``) to slot ``d`` (``table_row``: the row's block-table row):
        the page lookups once, then its K and V rows (``WIDE``: ``elems`` contiguous values each) and its value in
        ``NARROW`` (0-3) one-value pools. Shared by ``move_slots`` and ``evict_lowest``."""
        src_page = tl.load(table_row + s // page_size).to(tl.int64)
        dst_page = tl.load(table_row + d // page_size).to(tl.int64)
        a = (src_page * kv_heads + head) * page_size + s % page_size
        z = (dst_page * kv_heads + head) * page_size + d % page_size
        if WIDE:
            e = tl.arange(0, BLOCK_E)
            emask = e < elems
            tl.store(k_pool + z * elems + e, tl.load(k_pool + a * elems + e, mask=emask), mask=emask)
            tl.store(v_pool + z * elems + e, tl.load(v_pool + a * elems + e, mask=emask), mask=emask)
        if NARROW > 0:
            tl.store(n0 + z, tl.load(n0 + a))
        if NARROW > 1:
            tl.store(n1 + z, tl.load(n1 + a))
        if NARROW > 2:
            tl.store(n2 + z, tl.load(n2 + a))

    @triton.jit
    def _move_slots_kernel(k_pool, v_pool, n0, n1, n2, table, src, dst, n, stride_table, WIDE: tl.constexpr,
                           NARROW: tl.constexpr, kv_heads: tl.constexpr, page_size: tl.constexpr, elems: tl.constexpr,
                           BLOCK_E: tl.constexpr):
        """One program per (row, head): its pairs in order (:func:`copy_slot` each)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        pairs = (row * kv_heads + head) * n
        for i in range(n):
            s = tl.load(src + pairs + i)
            d = tl.load(dst + pairs + i)
            if (s >= 0) & (d >= 0):
                copy_slot(k_pool, v_pool, n0, n1, n2, table + row * stride_table, head, s, d, WIDE, NARROW, kv_heads,
                          page_size, elems, BLOCK_E)


def move_slots_triton(pools: list[torch.Tensor], table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton launches with the semantics of :func:`move_slots_reference` under the disjointness contract (pools
    contiguous): K, V and the first three one-value pools (positions, metadata) in one launch (a decode step that
    evicts every token runs this per layer: one launch, not one per pool), any further ones three a launch."""
    batch, kv_heads, n = src.shape
    if n == 0 or batch == 0:
        return
    page_size = pools[2].shape[2]
    src, dst = src.contiguous(), dst.contiguous()
    elems = math.prod(pools[0].shape[3:])  # head_dim
    narrow = pools[2:]
    for first in range(0, len(narrow), 3):
        group = narrow[first:first + 3]
        n0, n1, n2 = (group + [group[0]] * 2)[:3]
        _move_slots_kernel[(batch, kv_heads)](pools[0], pools[1], n0, n1, n2, table, src, dst, n, table.stride(0),
                                              first == 0, len(group), kv_heads, page_size, elems,
                                              triton.next_power_of_2(elems), **FP_FUSION)


def _fake(pools, table, src, dst) -> None:
    return None


move_slots = define_op(
    "move_slots(Tensor(a!)[] pools, Tensor table, Tensor src, Tensor dst) -> ()",
    cpu=move_slots_reference,
    cuda=move_slots_triton if triton is not None else None,
    fake=_fake,
)
