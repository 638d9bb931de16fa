"""``sparsecompile::evict_lowest``: a decode step's eviction of one token per row and KV head, as one op: the
victim (the resident slot with the lowest per-slot value outside the protected ones) and the refill of its hole from
the row's tail slot, in every pool.

``pools`` is ``[k_pool, v_pool, pos_pool, *metadata]`` as in ``slot_move.py``; ``pools[values]`` holds the per-slot
values that choose the victim (H2O's fp32 scores, or the int32 positions themselves: the oldest token goes).
A row-local slot ``s`` of a row lives at page ``table[row, s // page_size]``, offset ``s % page_size``. A row
evicts when it holds more than its ``budget`` (``counts > budget``; decode adds one token a step, so by one).
Among its first ``min(width, counts[row])`` slots, a slot is protected when it is one of the ``first`` leading slots
(StreamingLLM's sinks) or its position is one of the ``recent[row]`` newest of its head: ``pos >= 0 and pos > newest
- recent``, ``newest`` the largest position among those slots. The victim is the lowest value among the unprotected
slots, the lowest slot on ties, and slot 0 when every slot is protected (``argmin`` over ``+inf``); the tail slot
``counts - 1`` then moves into it (K, V, position, metadata), unless the victim is the tail itself. The host
truncates the row to ``counts - 1`` afterwards.

Why one op: traced, the victim formula (slot ids through the block table, gathers of positions and values, the max of
the positions, the mask, the argmin) and the hole filling (index arithmetic, then a scatter per pool) were about 130
graph nodes per layer, which inductor lowered and compiled for every decode step that evicts each token, and ran as
a dozen small kernels per layer. As two ops (``lowest_slot``, ``move_slots``) they were still five launches a layer:
the two kernels and three small fused kernels of the index arithmetic between them (about 8 us a layer at 32K x 1 on
the H200, ``results/profile_h2o_32k_b1_one_tile.txt``). One Triton program per ``(row, head)`` reads the row's
positions and values (a few KB, into registers when the width fits one tile), then copies one slot.
"""

from __future__ import annotations

import math

import torch

from .library import define_op
from .slot_move import move_slots_reference, move_slots_triton
from .tiles import FP_FUSION

try:
    import triton
    import triton.language as tl

    from .slot_move import copy_slot
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    triton = None


def lowest_slot_reference(values: torch.Tensor, pos_pool: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
                          recent: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """Torch reference of the victim (every row, evicting or not).

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


def _tail_into_victim(victim: torch.Tensor, counts: torch.Tensor,
                      budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst) [batch, kv_heads, 1]`` of the refill: the tail slot into the victim's hole where the row evicts
    and the victim is not the tail itself; -1 elsewhere (``move_slots`` skips those)."""
    tail = (counts.long() - 1)[:, None, None].expand_as(victim)
    hole = (counts > budget)[:, None, None] & (victim < tail)
    return torch.where(hole, tail, -1), torch.where(hole, victim, -1)


def evict_lowest_reference(pools: list[torch.Tensor], values: int, table: torch.Tensor, counts: torch.Tensor,
                           budget: torch.Tensor, recent: torch.Tensor, first: int, width: int) -> None:
    """Torch reference.

    Args:
        pools: ``[k_pool, v_pool, pos_pool, *metadata]`` (``slot_move.py``), written in place.
        values: index in ``pools`` of the per-slot values that choose the victim (2: the positions).
        table: ``[batch, max_pages]`` the rows' block-table rows for the layer.
        counts: ``[batch]`` slots in use per row; budget: ``[batch]`` a row holding more evicts one slot a head.
        recent: ``[batch]`` protected newest positions per row; first: leading row-local slots always protected.
        width: slots looked at per row (static; rows hold at most ``width`` while this runs).
    """
    victim = lowest_slot_reference(pools[values], pools[2], table, counts, recent, first, width)
    move_slots_reference(pools, table, *_tail_into_victim(victim, counts, budget))


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
    def _pool_rows(table_row, s, ok, head, KV_HEADS: tl.constexpr, PAGE: tl.constexpr):
        """Flat ``[pages, heads, PAGE]`` pool rows of row-local slots ``s`` (where ``ok``) of one (row, ``head``)."""
        page = tl.load(table_row + s // PAGE, mask=ok, other=0).to(tl.int64)
        return (page * KV_HEADS + head) * PAGE + s % PAGE

    @triton.jit
    def _victim(values, pos_pool, table, n, recent, first, row, head, stride_table, KV_HEADS: tl.constexpr,
                PAGE: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
        """The row-local victim slot of (``row``, ``head``) among its first ``n`` slots: the newest position, then
        the first minimum of the unprotected values. ``ONE_TILE`` (``n`` fits one tile): the slots are loaded once
        and both reductions run in registers; otherwise tile loops, positions read twice."""
        offs = tl.arange(0, BLOCK)
        best = tl.full([], float("inf"), tl.float32)
        best_slot = tl.full([], 0, tl.int32)
        if ONE_TILE:
            ok = offs < n
            at = _pool_rows(table + row * stride_table, offs, ok, head, KV_HEADS, PAGE)
            pos = tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64)
            value = tl.load(values + at, mask=ok, other=0.0).to(tl.float32)
            floor = tl.max(pos, axis=0) - recent
            candidate = ok & (offs >= first) & ~((pos >= 0) & (pos > floor))
            best, best_slot = _first_lowest(tl.where(candidate, value, float("inf")), offs, best, best_slot)
        else:
            newest = tl.full([BLOCK], -1, tl.int64)
            for start in range(0, n, BLOCK):  # the row's slots only: a budget set by ratio gives a wide width
                s = start + offs
                ok = s < n
                at = _pool_rows(table + row * stride_table, s, ok, head, KV_HEADS, PAGE)
                newest = tl.maximum(newest, tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64))
            floor = tl.max(newest, axis=0) - recent
            for start in range(0, n, BLOCK):
                s = start + offs
                ok = s < n
                at = _pool_rows(table + row * stride_table, s, ok, head, KV_HEADS, PAGE)
                pos = tl.load(pos_pool + at, mask=ok, other=-1).to(tl.int64)
                candidate = ok & (s >= first) & ~((pos >= 0) & (pos > floor))
                value = tl.where(candidate, tl.load(values + at, mask=ok, other=0.0).to(tl.float32), float("inf"))
                best, best_slot = _first_lowest(value, s, best, best_slot)
        return best_slot

    @triton.jit
    def _evict_lowest_kernel(values, pos_pool, k_pool, v_pool, n0, n1, n2, table, counts, budget, recent, victims,
                             first, width, stride_table, KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                             BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, MOVE: tl.constexpr, NARROW: tl.constexpr,
                             ELEMS: tl.constexpr, BLOCK_E: tl.constexpr):
        """One program per (row, head) of an evicting row: its victim, then the tail slot's K and V rows (``ELEMS``
        values each) and its value in ``NARROW`` (1-3) one-value pools copied into it. Without ``MOVE`` the victim
        goes to ``victims [batch, kv_heads]`` (-1: nothing to fill) for a separate ``move_slots``."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        count = tl.load(counts + row).to(tl.int32)
        dst = tl.full([], -1, tl.int32)
        if count > tl.load(budget + row).to(tl.int32):
            victim = _victim(values, pos_pool, table, tl.minimum(count, width), tl.load(recent + row).to(tl.int64),
                             first, row, head, stride_table, KV_HEADS, PAGE, BLOCK, ONE_TILE)
            dst = tl.where(victim < count - 1, victim, -1)
        if MOVE:
            if dst >= 0:
                copy_slot(k_pool, v_pool, n0, n1, n2, table + row * stride_table, head, count - 1, dst, True, NARROW,
                          KV_HEADS, PAGE, ELEMS, BLOCK_E)
        else:
            tl.store(victims + row * KV_HEADS + head, dst.to(tl.int64))


# Widths up to ONE_TILE_MAX slots run as one tile. On the H200 at 32K x 1 (H2O's decode width at budget 2048 is 2,064)
# one tile of 4,096 took the per-layer victim (then an op of its own) from 12.6 us (two passes of three dependent
# 1,024-slot tiles) to 3.4 us, and H2O's decode step from 5.46 to 5.23 ms of GPU time
# (results/profile_h2o_32k_b1_{two_pass,one_tile}.txt).
ONE_TILE_MAX = 8192


def evict_lowest_triton(pools: list[torch.Tensor], values: int, table: torch.Tensor, counts: torch.Tensor,
                        budget: torch.Tensor, recent: torch.Tensor, first: int, width: int,
                        block: int | None = None) -> None:
    """Triton launch with the semantics of :func:`evict_lowest_reference` (pools contiguous); ``block``: slots per
    tile (default: the width's power of two, one tile up to :data:`ONE_TILE_MAX`, else tiles of 1024). Up to three
    one-value pools (positions + two metadata) move in the same launch; with more, the victims go to a
    ``move_slots`` launch."""
    batch, heads = table.shape[0], pools[2].shape[1]
    if batch == 0 or width == 0:
        return
    whole = triton.next_power_of_2(width)
    block = block or (whole if whole <= ONE_TILE_MAX else 1024)
    narrow = pools[2:]
    move = len(narrow) <= 3
    n0, n1, n2 = (narrow + [narrow[0]] * 2)[:3]
    victims = torch.empty(batch, heads, 1, dtype=torch.int64, device=table.device) if not move else counts
    elems = math.prod(pools[0].shape[3:])  # head_dim
    _evict_lowest_kernel[(batch, heads)](
        pools[values], pools[2], pools[0], pools[1], n0, n1, n2, table, counts.contiguous(), budget.contiguous(),
        recent.contiguous(), victims, first, width, table.stride(0), heads, pools[2].shape[2], block,
        ONE_TILE=block >= width, MOVE=move, NARROW=min(len(narrow), 3), ELEMS=elems,
        BLOCK_E=triton.next_power_of_2(elems), num_warps=4 if block <= 1024 else 8, **FP_FUSION)
    if not move:
        tail = (counts.long() - 1)[:, None, None].expand(-1, heads, 1)
        move_slots_triton(pools, table, torch.where(victims >= 0, tail, -1), victims)


def _fake(pools, values, table, counts, budget, recent, first, width) -> None:
    return None


evict_lowest = define_op(
    "evict_lowest(Tensor(a!)[] pools, int values, Tensor table, Tensor counts, Tensor budget, Tensor recent, "
    "int first, int width) -> ()",
    cpu=evict_lowest_reference,
    cuda=evict_lowest_triton if triton is not None else None,
    fake=_fake,
)
