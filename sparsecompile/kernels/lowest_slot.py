"""``sparsecompile::lowest_slot``: per row and KV head, the resident slot with the lowest per-slot value outside the
protected ones (a decode step's eviction victim).

``values [num_pages, kv_heads, page_size]`` is any per-slot pool (fp32 metadata such as H2O's scores, or the int32
positions themselves: the oldest token goes), ``pos_pool`` the same shape (int32, -1 where a slot holds no token).
A row-local slot ``s`` of a row lives at page ``table[row, s // page_size]``, offset ``s % page_size``. Among the
row's first ``min(width, counts[row])`` slots, a slot is protected when it is one of the ``first`` leading slots
(StreamingLLM's sinks) or its position is one of the ``recent[row]`` newest of its head: ``pos >= 0 and pos >
newest - recent``, ``newest`` the largest position among those slots. The op returns the row-local slot of the
lowest value among the unprotected ones, the lowest slot on ties, and 0 when every slot is protected or the row
holds none: exactly ``argmin(where(valid & ~protected, value, +inf))``, the traced formula it replaces.

Why an op: traced, that formula (slot ids through the block table, the gathers of positions and values, the max of
the positions, the mask, the argmin) is about 60 graph nodes per layer, which inductor lowers and compiles for every
decode step that evicts each token, and runs as a few small kernels per layer; as one op it is one node and one
launch. One Triton program per ``(row, head)`` reads the row's positions and values: a few KB per program, loaded
once into registers when the width fits one tile (the newest position and the minimum are two reductions over it).
"""

from __future__ import annotations

import torch

from .library import define_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def lowest_slot_reference(values: torch.Tensor, pos_pool: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
                          recent: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """Torch reference.

    Args:
        values: ``[num_pages, kv_heads, page_size]`` fp32 (or int32) per-slot values (lower: evicted first).
        pos_pool: ``[num_pages, kv_heads, page_size]`` int32 logical positions (-1: no token).
        table: ``[batch, max_pages]`` the rows' block-table rows for the layer.
        counts: ``[batch]`` slots in use per row; recent: ``[batch]`` protected newest positions per row.
        first: leading row-local slots always protected.
        width: slots looked at per row (static; rows hold at most ``width`` while this runs).

    Returns:
        ``[batch, kv_heads, 1]`` int64 row-local slots.
    """
    page_size = pos_pool.shape[2]
    batch, heads = table.shape[0], pos_pool.shape[1]
    local = torch.arange(width, device=table.device)
    valid = local[None, :] < counts[:, None]  # [batch, width]
    page_col = (local // page_size).clamp(max=table.shape[1] - 1)  # slots past the table are past every count
    pages = table.long().gather(1, page_col[None, :].expand(batch, -1))
    head = torch.arange(heads, device=table.device)[None, :, None]
    index = (pages[:, None, :], head, (local % page_size)[None, None, :])
    pos = torch.where(valid[:, None, :], pos_pool[index].long(), -1)  # [batch, heads, width]
    newest = pos.max(dim=-1, keepdim=True).values
    protected = ((pos >= 0) & (pos > newest - recent.long()[:, None, None])) | (local < first)
    candidate = valid[:, None, :] & ~protected
    return torch.where(candidate, values[index].float(), float("inf")).argmin(dim=-1, keepdim=True)


if triton is not None:

    @triton.jit
    def _first_lowest(value, s, best, best_slot):
        """Fold a tile's first lowest ``value`` (at row-local slots ``s``) into the running ``(best, best_slot)``;
        ties keep the earlier (lower) slot."""
        low = tl.min(value, axis=0)
        low_at = tl.min(tl.where(value == low, s, 2147483647), axis=0)
        better = low < best
        return tl.where(better, low, best), tl.where(better, low_at, best_slot)

    @triton.jit
    def _lowest_slot_kernel(values, pos_pool, table, counts, recent, out, first, width, stride_table,
                            KV_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                            ONE_TILE: tl.constexpr):
        """One program per (row, head): the newest position, then the first minimum of the unprotected values.
        ``ONE_TILE`` (the width fits one tile): the slots are loaded once and both reductions run in registers;
        otherwise tile loops, positions read twice."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        n = tl.minimum(tl.load(counts + row).to(tl.int32), width)
        offs = tl.arange(0, BLOCK)
        best = tl.full([], float("inf"), tl.float32)
        best_slot = tl.full([], 0, tl.int32)
        if ONE_TILE:
            ok = offs < n
            page = tl.load(table + row * stride_table + offs // PAGE, mask=ok, other=0).to(tl.int64)
            at = (page * KV_HEADS + head) * PAGE + offs % PAGE
            pos = tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64)
            value = tl.load(values + at, mask=ok, other=0.0).to(tl.float32)
            floor = tl.max(pos, axis=0) - tl.load(recent + row).to(tl.int64)
            candidate = ok & (offs >= first) & ~((pos >= 0) & (pos > floor))
            best, best_slot = _first_lowest(tl.where(candidate, value, float("inf")), offs, best, best_slot)
        else:
            newest = tl.full([BLOCK], -1, tl.int64)
            for start in range(0, n, BLOCK):  # the row's slots only: a budget set by ratio gives a wide width
                s = start + offs
                ok = s < n
                page = tl.load(table + row * stride_table + s // PAGE, mask=ok, other=0).to(tl.int64)
                at = (page * KV_HEADS + head) * PAGE + s % PAGE
                newest = tl.maximum(newest, tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64))
            floor = tl.max(newest, axis=0) - tl.load(recent + row).to(tl.int64)
            for start in range(0, n, BLOCK):
                s = start + offs
                ok = s < n
                page = tl.load(table + row * stride_table + s // PAGE, mask=ok, other=0).to(tl.int64)
                at = (page * KV_HEADS + head) * PAGE + s % PAGE
                pos = tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64)
                candidate = ok & (s >= first) & ~((pos >= 0) & (pos > floor))
                value = tl.where(candidate, tl.load(values + at, mask=ok, other=0.0).to(tl.float32), float("inf"))
                best, best_slot = _first_lowest(value, s, best, best_slot)
        tl.store(out + row * KV_HEADS + head, best_slot.to(tl.int64))


# Widths up to ONE_TILE_MAX slots run as one tile. On the H200 at 32K x 1 (H2O's decode width at budget 2048 is 2,064)
# one tile of 4,096 took the per-layer victim from 12.6 us (two passes of three dependent 1,024-slot tiles) to 3.4 us,
# and H2O's decode step from 5.46 to 5.23 ms of GPU time (results/profile_h2o_32k_b1_{two_pass,one_tile}.txt).
ONE_TILE_MAX = 8192


def lowest_slot_triton(values: torch.Tensor, pos_pool: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
                       recent: torch.Tensor, first: int, width: int, block: int | None = None) -> torch.Tensor:
    """Triton launch with the semantics of :func:`lowest_slot_reference` (pools contiguous); ``block``: slots per
    tile (default: the width's power of two, one tile up to :data:`ONE_TILE_MAX`, else tiles of 1024)."""
    batch, heads = table.shape[0], pos_pool.shape[1]
    out = torch.empty(batch, heads, 1, dtype=torch.int64, device=table.device)  # every program writes its entry
    if batch == 0:
        return out
    if width == 0:
        return out.zero_()
    whole = triton.next_power_of_2(width)
    block = block or (whole if whole <= ONE_TILE_MAX else 1024)
    _lowest_slot_kernel[(batch, heads)](values, pos_pool, table, counts.contiguous(), recent.contiguous(), out, first,
                                        width, table.stride(0), heads, pos_pool.shape[2], block,
                                        ONE_TILE=block >= width, num_warps=4 if block <= 1024 else 8)
    return out


def _fake(values, pos_pool, table, counts, recent, first, width) -> torch.Tensor:
    return table.new_empty((table.shape[0], pos_pool.shape[1], 1), dtype=torch.int64)


lowest_slot = define_op(
    "lowest_slot(Tensor values, Tensor pos_pool, Tensor table, Tensor counts, Tensor recent, int first, int width) -> "
    "Tensor",
    cpu=lowest_slot_reference,
    cuda=lowest_slot_triton if triton is not None else None,
    fake=_fake,
)
