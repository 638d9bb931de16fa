"""Slot access on the device: writes, views, moves and inspection of the pool (a mixin of CacheManager).

Everything here maps row-local slots (``(row, layer)``'s list, see ``cache_manager.py``) to global slots through
the block table and reads or writes the pool tensors. The methods under "device side" contain no host
synchronisation and run inside compiled decode graphs; the inspection methods at the end sync and serve tests,
``kv_stats`` and the API's ``retained_positions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import evict_lowest as evict_lowest_op
from ..kernels import gather_slots, kv_write, kv_write_bounds
from ..kernels import move_slots as move_slots_op
from .step import StepState
from .view import AttentionView, PageSelection, Selection, SlotSelection

if TYPE_CHECKING:
    import numpy as np

    from .kivi import KiviStorage
    from .layout import KVLayout


@dataclass
class SlotPlan:
    """One eager forward's slot mapping for every layer, layer-major (see :meth:`SlotAccess.slot_plan`).

    tables: ``[layers, batch, max_pages]`` the rows' block tables; lengths: ``[layers, batch]`` slots in use (new
    tokens included); slots: ``[layers, batch, tokens]`` the global slot of each new token (-1: padding);
    index / view_lengths: tables and lengths expanded over the KV heads (views), a dense AttentionView's fields.
    """

    tables: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor
    view_lengths: torch.Tensor


def table_slots(table: torch.Tensor, local: torch.Tensor, page_size: int) -> torch.Tensor:
    """Row-local slots ``local [..., n]`` -> global slot ids through ``table [..., max_pages]`` (the same leading
    dims; -1 stays -1)."""
    safe = local.clamp(min=0)
    pages = torch.gather(table, -1, safe // page_size).long()
    return torch.where(local >= 0, pages * page_size + safe % page_size, torch.full_like(local, -1))


class SlotAccess:
    """Device-side slot operations over the pool that :class:`~.cache_manager.CacheManager` allocates."""

    layout: KVLayout
    k_pool: torch.Tensor | None
    v_pool: torch.Tensor | None
    pos_pool: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    slot_metadata: dict[str, torch.Tensor]
    page_metadata: dict[str, torch.Tensor]
    key_bounds: tuple[str, str] | None
    storage: KiviStorage | None
    trash_page: int
    _slot_fill: dict[str, float]
    _host_lengths: np.ndarray
    _holes: set[int]

    _layer_keys: list[torch.Tensor]

    def _check_row(self, row: int) -> None: ...

    def layer_key(self, layer: int | torch.Tensor) -> torch.Tensor:
        """``layer`` as a ``[1]`` device tensor, the index of traced ``lengths`` / ``block_table`` lookups (see
        ``CacheManager.__init__``: one kernel for all layers instead of one per layer). A tensor ``[batch]`` (device)
        names each row's own layer: eager edits of many ``(row, layer)`` pairs in one set of ops."""
        return layer if isinstance(layer, torch.Tensor) else self._layer_keys[layer]

    # ------------------------------------------------------------------ device side (traceable)
    def global_slots(self, layer: int | torch.Tensor, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Row-local slot indices ``[batch, ...]`` -> global slot ids (-1 stays -1); ``layer`` as :meth:`layer_key`."""
        table = self.block_table[rows, self.layer_key(layer)]  # [batch, max_pages]
        flat = local.reshape(local.shape[0], -1)
        return table_slots(table, flat, self.layout.page_size).reshape(local.shape)

    def slot_plan(self, step: StepState) -> SlotPlan | None:
        """Every layer's write slots, tables and lengths for ``step``'s rows in one go (a dozen ops per forward
        instead of per layer: an eager forward pays host time per op). Valid while the step's tables and lengths
        stand: computed after the step's flush, each layer's own entries change only after that layer ran. None
        with a storage format (KIVI maps its own slots)."""
        if self.storage is not None:
            return None
        tables = self.block_table[step.rows]  # [batch, layers, max_pages]
        lengths = self.lengths[step.rows]  # [batch, layers]
        offsets = step.new_offsets[:, None, :]
        used = lengths.long() - step.num_new[:, None]
        local = torch.where(offsets >= 0, used[..., None] + offsets, offsets)  # [batch, layers, tokens]
        slots = table_slots(tables, local, self.layout.page_size)
        tables, lengths = tables.transpose(0, 1).contiguous(), lengths.t().contiguous()
        heads = self.layout.num_kv_heads
        return SlotPlan(tables, lengths, slots.transpose(0, 1).contiguous(),
                        tables[:, :, None, :].expand(-1, -1, heads, -1), lengths[:, :, None].expand(-1, -1, heads))

    def write(self, layer: int, step: StepState, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Write the step's new ``key, value [batch, kv_heads, tokens, head_dim]``; returns their global slots.

        New tokens land after the slots already in use (``lengths`` already counts them: see
        :meth:`ensure_slots`). Slot metadata of the new slots is reset to its fill value; tracked key bounds
        (``track_key_bounds``) take the new keys in.
        """
        if step.slot_plan is not None:
            slots, local = step.slot_plan.slots[layer], None
        else:
            used = self.lengths[step.rows, self.layer_key(layer)].long() - step.num_new  # [batch]
            local = torch.where(step.new_offsets >= 0, used[:, None] + step.new_offsets, step.new_offsets)
            slots = self.global_slots(layer, step.rows, local)
        if self.storage is not None:
            self.storage.write(layer, step, key, value, local, slots)
        elif self.key_bounds is not None:
            kmin, kmax = (self.page_metadata[name] for name in self.key_bounds)
            kv_write_bounds(self.k_pool, self.v_pool, self.pos_pool, kmin, kmax, key, value, slots, step.positions)
        else:
            kv_write(self.k_pool, self.v_pool, self.pos_pool, key, value, slots, step.positions)
        if self.slot_metadata:
            per_head = slots[:, None, :].expand(-1, self.layout.num_kv_heads, -1)
            for name, meta in self.slot_metadata.items():
                self.scatter_slots(meta, per_head, torch.full(per_head.shape, self._slot_fill[name], dtype=meta.dtype,
                                                              device=meta.device))
        return slots

    def scatter_slots(self, pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``pool[slot of head h] = values`` for global ``slots [batch, kv_heads, n]``; slots < 0 are skipped.

        Skipped entries go to the trash page (no boolean indexing, so shapes stay static under compile).
        """
        pool.index_put_(self._pool_index(slots), values.to(pool.dtype))

    def _pool_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global ``slots [batch, kv_heads, n]`` -> the (page, head, offset) index of every pool (slots < 0: the trash
        page), computed once for all the pools a move touches."""
        P = self.layout.page_size
        safe = torch.where(slots >= 0, slots, torch.full_like(slots, self.trash_page * P))
        head = torch.arange(slots.shape[1], device=slots.device)[None, :, None].expand_as(safe)
        return safe // P, head, safe % P

    def build_view(self, layer: int, step: StepState, selection: Selection = None,
                   max_slots: int | None = None) -> AttentionView:
        """The AttentionView of ``layer`` for this step: every resident slot, or the selected subset. ``max_slots``:
        no row holds more slots (``SparseMethod.decode_slot_bound``): a full view covers only those table entries."""
        H, P = self.layout.num_kv_heads, self.layout.page_size
        rows = step.rows
        if self.storage is not None:
            if selection is not None and step.is_prefill:
                raise TypeError("a KIVI-stored cache selects only in decode (its prefill views are full precision)")
            return self.storage.view(layer, step, max_slots, selection)
        width = None if max_slots is None else -(-max_slots // P)  # table entries (None: all)
        plan = step.slot_plan
        if selection is None and plan is not None:
            return AttentionView(self.k_pool, self.v_pool, self.pos_pool, plan.index[layer][..., :width],
                                 plan.view_lengths[layer], P)
        table = plan.tables[layer] if plan is not None else self.block_table[rows, self.layer_key(layer)]
        if selection is None:  # table: [batch, max_pages]
            index = table[:, None, :width].expand(-1, H, -1)
            lengths = self.lengths[rows, self.layer_key(layer)][:, None].expand(-1, H)
            return AttentionView(self.k_pool, self.v_pool, self.pos_pool, index, lengths, P)
        if isinstance(selection, PageSelection):
            return AttentionView(self.k_pool, self.v_pool, self.pos_pool, selection.pool_pages(table),
                                 selection.tokens.to(torch.int32), P)
        if isinstance(selection, SlotSelection):
            # One list for every head (OmniKV's, expanded): map it once. Mapped per head, OmniKV's capacity-wide
            # list took 47 us a sparse layer at 128K x 4 on the H200 (results/profile_omnikv_128k_b4.txt).
            shared = selection.slots.shape[1] > 1 and selection.slots.stride(1) == 0
            local = selection.slots[:, :1] if shared else selection.slots
            slots = self.global_slots(layer, rows, local).clamp(min=0).to(torch.int32)
            return AttentionView(self.k_pool, self.v_pool, self.pos_pool, slots.expand(-1, H, -1) if shared else slots,
                                 selection.counts.to(torch.int32), 1)
        raise TypeError(f"unknown selection type {type(selection).__name__}")

    def end_layer(self, layer: int, step: StepState) -> None:
        """After the layer's attention and hooks: the storage format commits the layer's new tokens (KIVI)."""
        if self.storage is not None:
            self.storage.end_layer(layer, step)

    def resident_slot_ids(self, layer: int | torch.Tensor, rows: torch.Tensor,
                          width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slot ids of the first ``width`` row-local slots ``[batch, width]`` and their validity."""
        local = torch.arange(width, device=rows.device)[None, :].expand(rows.shape[0], -1)
        valid = local < self.lengths[rows, self.layer_key(layer)][:, None]
        return self.global_slots(layer, rows, torch.where(valid, local, -1)), valid

    def move_slots(self, layer: int, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head, copy row-local slots ``src`` to ``dst`` (both ``[batch, kv_heads, n]``).

        Moves K, V, position and all slot metadata together. Sources are read before any write, so
        overlapping moves (compaction to the front) are safe.
        """
        pools = self._slot_pools()
        if self.storage is not None:
            self.storage.move(layer, rows, src, dst)
            pools = pools[2:]
        self._move_in_pools(pools, layer, rows, src, dst)

    def _move_in_pools(self, pools: list[torch.Tensor], layer: int | torch.Tensor, rows: torch.Tensor,
                       src: torch.Tensor, dst: torch.Tensor) -> None:
        H = self.layout.num_kv_heads
        batch, _, n = src.shape
        both = self.global_slots(layer, rows, torch.stack([src, dst], 1)).reshape(batch, 2, H, n)  # one lookup
        g_src, g_dst = both[:, 0].clamp(min=0), both[:, 1]
        src_index, dst_index = self._pool_index(g_src), self._pool_index(g_dst)
        moved = [pool[src_index] for pool in pools]  # read everything before writing
        for pool, values in zip(pools, moved):
            pool.index_put_(dst_index, values)

    def remove_groups(self, layers: torch.Tensor, rows: torch.Tensor, victims: torch.Tensor, quantized: torch.Tensor,
                      counts: torch.Tensor, width: int) -> None:
        """Per KV head, one quantized key group of KIVI storage leaves each ``(rows[i], layers[i])`` pair (eager, no
        host sync; every pair in one set of ops): ``victims [batch, kv_heads]`` the group's index; ``quantized,
        counts [batch]`` the pair's quantized and used slots; ``width >= counts - quantized`` (static). The last
        quantized group (slots ``quantized - G ..``) moves whole into the victim's slots (codes, scales, zeros,
        positions and slot metadata: nothing is re-quantized) and the residual's slots ``[quantized, counts)`` move
        down by ``G`` (positions and metadata; the ring turns). The caller then shrinks the pairs by ``G`` slots
        (``truncate_many(..., storage_done=True)``)."""
        G, H = self.storage.spec.group_size, self.layout.num_kv_heads
        dev = victims.device
        q = quantized.long()[:, None, None]
        tok = torch.arange(G, device=dev)
        moving = (victims[..., None] * G != q - G)  # [batch, kv_heads, 1]: the victim is not the last group
        src = torch.where(moving, (q - G + tok).expand(-1, H, -1), -1)
        dst = torch.where(moving, victims[..., None] * G + tok, -1)
        first = self.global_slots(layers, rows, torch.stack([src[..., 0], dst[..., 0]], 1))  # [batch, 2, kv_heads]
        self.storage.move_groups(first[:, 0], first[:, 1])
        ring = q + torch.arange(width, device=dev)  # [batch, 1, width]
        ring = torch.where(ring < counts.long()[:, None, None], ring, -1).expand(-1, H, -1)
        self._move_in_pools(self._slot_pools()[2:], layers, rows, torch.cat([src, ring], -1),
                            torch.cat([dst, torch.where(ring >= 0, ring - G, -1)], -1))
        self.storage.turn_rings(layers, rows, G)

    def fill_slots(self, layer: int, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """:meth:`move_slots` when, per ``(row, head)``, no destination is also a source (decode eviction filling
        its holes from the tail): one ``move_slots`` op that reads the block table itself, so a compiled step holds
        one node per layer for it instead of the traced gathers and scatters of every pool."""
        if self.storage is not None:
            self.move_slots(layer, rows, src, dst)
            return
        move_slots_op(self._slot_pools(), self.block_table[rows, self.layer_key(layer)], src, dst)

    def evict_lowest(self, layer: int, rows: torch.Tensor, values: str | None, counts: torch.Tensor,
                     budget: torch.Tensor, recent: torch.Tensor, first: int, width: int) -> None:
        """Decode eviction of one token (traceable, one op): in each ``(row, head)`` of the rows holding more than
        ``budget [batch]`` of ``counts [batch]`` slots, the slot with the lowest per-slot ``values`` (a metadata
        name; None: the positions, oldest first) outside the ``first`` leading slots and the ``recent [batch]``
        newest positions goes, and the tail slot refills its hole (``kernels/evict_lowest.py``). The caller
        truncates those rows to ``counts - 1``. Not with a storage format (no method evicts in decode over one)."""
        if self.storage is not None:
            raise TypeError("a KIVI-stored cache does not evict single tokens during decode (h2o+kivi: refused; "
                            "streamingllm+kivi drops whole pages: CacheManager.drop_pages)")
        which = 2 if values is None else 3 + list(self.slot_metadata).index(values)
        evict_lowest_op(self._slot_pools(), which, self.block_table[rows, self.layer_key(layer)], counts, budget,
                        recent, first, width)

    def _slot_pools(self) -> list[torch.Tensor]:
        """Every per-slot pool, in the order the move ops take them: ``[k, v, positions, *metadata]``."""
        return [self.k_pool, self.v_pool, self.pos_pool, *self.slot_metadata.values()]

    def clear_positions(self, row: int, layer: int, count: int, first: int) -> None:
        """Empty (position -1) the slots among the first ``count`` of ``(row, layer)`` whose token is at position
        ``>= first``, in every head (host-driven edit of resident state; not for compiled steps)."""
        rows = torch.tensor([row], device=self.layout.device)
        slots, _ = self.resident_slot_ids(layer, rows, count)
        per_head = slots[:, None, :].expand(-1, self.layout.num_kv_heads, -1)
        pos = gather_slots(self.pos_pool, per_head)
        self.scatter_slots(self.pos_pool, torch.where(pos >= first, per_head, -1), torch.full_like(pos, -1))
        self.mark_holes(row)

    def mark_holes(self, row: int) -> None:
        """``row`` has empty slots (position -1) among its used ones (a head that kept fewer entries, removed
        entries): its prefill attention then masks by position instead of reading the first slots densely
        (``StepState.dense_lengths``), until the row is released; its forks inherit that."""
        self._holes.add(row)

    # ------------------------------------------------------------------ inspection (host syncs; not for hot paths)
    def retained_positions(self, row: int, layer: int) -> list[torch.Tensor]:
        """For each KV head of ``(row, layer)``, the sorted logical positions still resident."""
        self._check_row(row)
        count = int(self._host_lengths[row, layer])
        if count == 0:
            return [torch.empty(0, dtype=torch.int64) for _ in range(self.layout.num_kv_heads)]
        rows = torch.tensor([row], device=self.layout.device)
        slots, _ = self.resident_slot_ids(layer, rows, count)
        pos = gather_slots(self.pos_pool, slots[:, None, :].expand(-1, self.layout.num_kv_heads, -1))[0].cpu().long()
        return [torch.sort(p[p >= 0]).values for p in pos]

    def resident_tokens(self, row: int, layer: int) -> list[int]:
        """Tokens resident per KV head of ``(row, layer)``."""
        return [int(p.numel()) for p in self.retained_positions(row, layer)]

    def resident_bytes(self, row: int, layer: int) -> int:
        """K/V bytes ``(row, layer)`` holds, all KV heads: resident tokens x head_dim x 2 x dtype size (dense), or
        the KIVI codes, scales and residual of its slots (positions not counted)."""
        lay = self.layout
        if self.storage is None:
            return sum(self.resident_tokens(row, layer)) * lay.bytes_per_slot_head
        count = int(self._host_lengths[row, layer])
        return lay.num_kv_heads * self.storage.spec.slot_bytes(lay.head_dim, lay.dtype, count)
