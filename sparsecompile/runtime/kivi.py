"""The ``kivi`` storage format of the CacheManager: quantized KV pages plus a full-precision residual ring.

A storage format decides how the K/V of resident slots are stored; retention policies (which slots stay) never see
it. ``dense`` (no format object: ``k_pool / v_pool`` in the model's dtype) is the default; :class:`KiviStorage`
stores, for every ``(row, layer)`` holding ``count`` slots:

* slots ``[0, Q)``, ``Q = G * max(0, (count - R) // G)``, in KIVI pages (``kernels/kivi_quant.py``: ``bits``-bit
  codes, keys per channel over groups of ``G = group_size`` slots, values per token over groups of ``G``
  channels, fp16 / bf16 scales and zeros). Pages hold ``P`` slots, ``P`` a multiple of ``G`` (the layout's page
  size is ``max(page_size, group_size)``, both powers of two), so a key group never straddles pages;
* slots ``[Q, count)``, the newest ``R .. R + G - 1`` (``R = residual``, a multiple of ``G``), in full precision in
  a per-row ring ``ring_k / ring_v [rows * layers + 1, kv_heads, R + G, D]`` at ``slot % (R + G)``. When a step
  brings the residual to ``R + G`` tokens its oldest group is quantized into its page (KIVI's "quantized a group at
  a time as they age"). Positions and slot metadata stay in the pages (``pos_pool``), whatever the format.

``Q`` is a function of ``count`` alone, so the host (page allocation, statistics) and the device (views,
commits) agree without a sync. Pages are allocated for every slot as in the dense pool (those of the residual's
slots hold its positions and, later, its codes), so memory oracles and the scheduler count pages unchanged; a page
simply costs fewer bytes (:attr:`CacheManager.bytes_per_page`), plus :attr:`row_bytes` of ring per sequence row.

Steps (see the controller's ``attend``):

* decode: the new token goes to the ring (room is guaranteed), attention reads pages and ring in place
  (``kivi_decode_attention``), then the layer's commit quantizes the ring's oldest group if it became full;
* prefill: every slot of the step's rows is materialised in full precision (pages dequantized, ring, the step's
  own K/V) into a temporary buffer ``W`` that the existing prefill attention and the method's hooks read as an
  ordinary view; the commit quantizes what aged out of the residual from ``W``. When the method moves resident slots
  in this step (eviction after the prompt: :meth:`begin_step` ``defer=True``), ``W`` lives until the method's
  ``commit_step``: the moves happen in full precision, then the kept slots are quantized once
  (:meth:`commit_deferred`). A row whose quantized history is compacted again (a second prompt on the same row) gets
  that history re-quantized from its dequantized values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..kernels.kivi_quant import empty_pages, kivi_dequantize, kivi_quantize, slot_major
from .compilation import page_indexed, static_address
from .host import to_device
from .kivi_deferred import DeferredCommits
from .kivi_spec import KiviSpec
from .kivi_view import QuantizedKV
from .view import AttentionView, PageSelection

if TYPE_CHECKING:
    from .step import StepState

CacheManager = Any  # the owning manager (cache_manager.py imports this module; no import back)


class KiviStorage(DeferredCommits):
    """KIVI pages and residual rings of one CacheManager (module docstring)."""

    #: one step's plan (``SparseMethod.step_scoped``): the controller swaps it around each step sharing a forward
    step_scoped = ("_defer", "_step_rows", "_before", "_work", "_pending")

    def __init__(self, manager: CacheManager, spec: KiviSpec) -> None:
        layout = manager.layout
        if layout.page_size % spec.group_size:
            raise ValueError(f"kivi: page_size {layout.page_size} is not a multiple of group_size {spec.group_size}")
        self.manager, self.spec = manager, spec
        # layer -> W key / value [B, H, S + 1, D]: every slot of the step's rows in full precision, column S trash
        self._work: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # layer -> new K, V, slots
        self._defer = False  # this prefill step moves resident slots: commits wait for commit_deferred
        self._step_rows: list[int] = []
        self._before: np.ndarray | None = None  # host slot counts before the deferred step [batch, layers]
        # A deferred step's buffers kept past it (hold): layer -> W of the rows in _held_rows, in that order, until
        # release_held quantizes them (KVzip's prompt stays in full precision through its scoring passes)
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held_rows: list[int] = []

    # ------------------------------------------------------------------ tensors
    def allocate(self, num_pages: int, max_seqs: int) -> None:
        lay, s = self.manager.layout, self.spec
        H, P, D, G = lay.num_kv_heads, lay.page_size, lay.head_dim, s.group_size
        dev = lay.device
        pages = empty_pages(num_pages + 1, H, P, D, s.bits, G, s.scale_dtype, dev)
        (self.kcode, self.vcode, self.kscale, self.kzero, self.vscale,
         self.vzero) = (page_indexed(t) for t in pages)
        rows = max_seqs * lay.num_layers + 1  # + one trash row that absorbs padding writes
        self.ring_k = torch.zeros(rows, H, s.ring, D, dtype=lay.dtype, device=dev)
        self.ring_v = torch.zeros(rows, H, s.ring, D, dtype=lay.dtype, device=dev)
        for ring in (self.ring_k, self.ring_v):  # indexed by row, not page: their size changes with max_seqs only
            static_address(ring)

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.kcode, self.vcode, self.kscale, self.kzero, self.vscale, self.vzero)

    def key_ranges(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What bounds the quantized keys, for selection by key bounds (Quest over KIVI pages): zeros and scales
        ``[pages, kv_heads, P / G, D]`` and the largest code; a group's channel ``c`` spans ``[zero_c, zero_c + levels
        * scale_c]``, its minimum and maximum (the group's own extremes, quantized to codes 0 and ``levels``)."""
        return self.kzero, self.kscale, 2 ** self.spec.bits - 1

    @property
    def row_bytes(self) -> int:
        """Ring bytes per sequence row (all layers)."""
        return self.manager.layout.num_layers * 2 * self.ring_k[0].numel() * self.ring_k.element_size()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.page_tensors(), self.ring_k, self.ring_v)

    def copy_from(self, old: tuple[torch.Tensor, ...], old_pages: int, old_rows: int) -> None:
        """After :meth:`allocate` grew the tensors (``CacheManager.grow``): keep the first pages and rows."""
        for new, prev in zip(self.page_tensors(), old[:6]):
            new[:old_pages] = prev[:old_pages]
        n = old_rows * self.manager.layout.num_layers
        self.ring_k[:n], self.ring_v[:n] = old[6][:n], old[7][:n]

    def fill_synthetic(self) -> None:
        """Random codes, scales and residual (benchmarks: decode time does not depend on values)."""
        for codes in (self.kcode, self.vcode):
            codes.random_(-(2**31), 2**31 - 1)
        for t in (self.kscale, self.vscale):
            t.uniform_(0.01, 0.1)
        for t in (self.kzero, self.vzero, self.ring_k, self.ring_v):
            t.normal_()

    # ------------------------------------------------------------------ host hooks
    def written_from(self, from_slots: np.ndarray) -> np.ndarray:
        """Copy-on-write: a step that appends after ``from_slots`` also quantizes from ``Q(from_slots)`` on."""
        return self.spec.quantized(from_slots)

    def begin_step(self, step: StepState, defer: bool) -> None:
        """Called by the method before a step: ``defer`` when the step may move resident slots (prefill only)."""
        self._defer = bool(defer and step.is_prefill)
        self._step_rows = list(step.row_ids)
        self._before = None
        self._work, self._pending = {}, {}  # this step's own (several steps may share a forward: step_scoped)
        if self._defer:
            self._before = self.manager.slot_count_array(step.row_ids) - np.asarray(step.num_new_host)[:, None]

    def fork_row(self, row: int, new: int) -> None:
        L = self.manager.layout.num_layers
        self.ring_k[new * L:(new + 1) * L] = self.ring_k[row * L:(row + 1) * L]
        self.ring_v[new * L:(new + 1) * L] = self.ring_v[row * L:(row + 1) * L]

    def on_release(self, row: int) -> None:
        """The row is freed (finished, aborted or preempted, possibly between its prompt's chunks): drop its held
        full-precision buffers, which would otherwise stay allocated and, once the row id is reused (a fork, a new
        prompt), stand in for the new sequence's history."""
        self._forget_held([row])

    def on_truncate(self, row: int, layer: int, old: int, new: int) -> None:
        """Keep the ring holding ``[Q(new), new)``: slots that were quantized go back to it (dequantized), except in a
        deferred step, whose commit rewrites everything it keeps."""
        if (self._defer and row in self._step_rows) or row in self._held_rows:
            return
        lo, hi = int(self.spec.quantized(new)), min(int(self.spec.quantized(old)), new)
        if lo >= hi:
            return
        m, P, L = self.manager, self.manager.layout.page_size, self.manager.layout.num_layers
        pages = torch.tensor(m.pages_of(row, layer)[lo // P: -(-hi // P)], device=m.layout.device)
        k, v = kivi_dequantize(*self.page_tensors(), pages, m.layout.dtype)  # [n, H, P, D]
        slots = torch.arange(lo, hi, device=pages.device)
        local = slots - (lo // P) * P
        ring = row * L + layer
        self.ring_k[ring][:, slots % self.spec.ring] = k[local // P, :, local % P].transpose(0, 1)
        self.ring_v[ring][:, slots % self.spec.ring] = v[local // P, :, local % P].transpose(0, 1)

    def on_drop_pages(self, rows: np.ndarray, layers: np.ndarray, old: np.ndarray, index: int) -> None:
        """``CacheManager.drop_pages``: page ``index`` of each ``(row, layer)`` pair (``old`` slots) leaves and later
        slots move down a page. Quantized pages move whole (no group is re-quantized); each pair's ring, indexed by
        slot, turns by a page so that slot ``s - P`` finds what slot ``s`` held (all pairs in one gather). Only a
        page below the residual may leave."""
        P = self.manager.layout.page_size
        short = (index + 1) * P > self.spec.quantized(old)
        if short.any():
            raise ValueError(f"kivi: page {index} of a list of {int(old[short][0])} slots is not fully quantized "
                             f"(the residual starts at slot {int(self.spec.quantized(old[short][0]))}): it cannot "
                             "be dropped")
        self._turn(to_device(rows * self.manager.layout.num_layers + layers, self.manager.layout.device), P)

    def turn_rings(self, layer: int | torch.Tensor, rows: torch.Tensor, shift: int) -> None:
        """Slots of ``rows`` in ``layer`` (or each row's own, ``[batch]``) moved down by ``shift``: each ring turns so
        that slot ``s - shift`` finds what slot ``s`` held."""
        self._turn(self._ring_rows(layer, rows), shift)

    def _turn(self, ring: torch.Tensor, shift: int) -> None:
        for t in (self.ring_k, self.ring_v):
            t[ring] = torch.roll(t[ring], shifts=-shift, dims=2)

    def move_groups(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole quantized key groups, per KV head: ``src, dst [batch, kv_heads]`` global first slots (multiples
        of G; -1 skips): codes, the per-slot value scales / zeros and the group's per-channel key scales / zeros, as
        stored (nothing is re-quantized). Everything is read before anything is written."""
        P, G = self.manager.layout.page_size, self.spec.group_size
        trash = self.manager.trash_page * P
        head = torch.arange(src.shape[1], device=src.device)[None, :].expand_as(src)
        s, d = src.clamp(min=0), torch.where(dst >= 0, dst, trash)
        tok = torch.arange(G, device=src.device)
        per_slot = [(t, (x // P)[..., None], head[..., None], (x % P)[..., None] + tok)
                    for t in (self.kcode, slot_major(self.vscale), slot_major(self.vzero)) for x in (s, d)]
        per_group = [(t, x // P, head, x % P // G) for t in (self.kscale, self.kzero, self.vcode) for x in (s, d)]
        places = per_slot + per_group
        values = [t[p, h, o] for t, p, h, o in places[::2]]
        for (t, p, h, o), v in zip(places[1::2], values):
            t[p, h, o] = v

    # ------------------------------------------------------------------ device, per layer
    def _ring_rows(self, layer: int | torch.Tensor, rows: torch.Tensor,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
        ring = rows * self.manager.layout.num_layers + layer
        return ring if valid is None else torch.where(valid, ring, self.ring_k.shape[0] - 1)

    def write(self, layer: int, step: StepState, key: torch.Tensor, value: torch.Tensor, local: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Positions of the new tokens into the pages; K/V to the ring (decode) or kept for the view (prefill)."""
        m, P = self.manager, self.manager.layout.page_size
        safe = torch.where(slots >= 0, slots, m.trash_page * P)
        pages, offsets = safe // P, safe % P
        pos = step.positions.to(torch.int32)[:, :, None].expand(-1, -1, m.layout.num_kv_heads)
        m.pos_pool[pages, :, offsets] = pos
        if step.is_prefill:
            self._pending[layer] = (key, value, local)
            return
        ring = self._ring_rows(layer, step.rows[:, None].expand_as(local), local >= 0)
        idx = local.clamp(min=0) % self.spec.ring
        self.ring_k[ring, :, idx] = key.transpose(1, 2).to(self.ring_k.dtype)
        self.ring_v[ring, :, idx] = value.transpose(1, 2).to(self.ring_v.dtype)

    def view(self, layer: int, step: StepState, max_slots: int | None = None,
             selection: PageSelection | None = None) -> AttentionView:
        """The layer's view for this step; decode views cover the first ``max_slots`` slots' pages (None: the whole
        table; ``SparseMethod.decode_slot_bound``). A decode ``selection`` names row-local pages of the quantized
        slots to read (``pages [batch, kv_heads, k]``, -1 padded; ``tokens [batch, kv_heads]`` their slots, the same
        in every head) in place of all of them; the residual is read as ever."""
        m = self.manager
        H, P = m.layout.num_kv_heads, m.layout.page_size
        rows = step.rows
        lengths = m.lengths[rows, m.layer_key(layer)]
        if step.is_prefill:
            return self._materialize(layer, step)
        table = m.block_table[rows, m.layer_key(layer)][:, : None if max_slots is None else -(-max_slots // P)]
        picked: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if selection is not None:
            if not isinstance(selection, PageSelection):
                raise TypeError(f"kivi: a decode selection over quantized pages is a PageSelection, got "
                                f"{type(selection).__name__}")
            picked = (selection.pool_pages(table), selection.tokens[:, 0].long())
        quant = QuantizedKV(self.page_tensors(), self.ring_k, self.ring_v, self._ring_rows(layer, rows),
                            self.spec.quantized(lengths.long() - step.num_new), self.spec.dense_history, *picked)
        return AttentionView(None, None, m.pos_pool, table[:, None, :].expand(-1, H, -1),
                             lengths[:, None].expand(-1, H), P, quant)

    def _materialize(self, layer: int, step: StepState) -> AttentionView:
        """Every slot of the step's rows in full precision: ``W [B, H, S, D]`` (kept for the commit) and its copy in
        pool layout ``[B * S / P, H, P, D]`` that the view names, with positions and an identity page index."""
        m = self.manager
        H, P, D = m.layout.num_kv_heads, m.layout.page_size, m.layout.head_dim
        key, value, local = self._pending.pop(layer)
        rows, batch = step.rows, len(step.row_ids)
        counts = m.slot_count_array(step.row_ids)[:, layer]
        history = counts - np.asarray(step.num_new_host)  # host: what the rows held before this step
        n = max(1, math.ceil(int(counts.max()) / P))
        S = n * P
        table = m.block_table[rows, layer, :n]
        lengths = m.lengths[rows, m.layer_key(layer)].long()
        if self.spec.quantized(history).max() > 0:  # quantized history: dequantize its pages
            k, v = kivi_dequantize(*self.page_tensors(), table, key.dtype)  # [B, n, H, P, D]
            k = k.transpose(1, 2).reshape(batch, H, S, D)
            v = v.transpose(1, 2).reshape(batch, H, S, D)
        else:
            k = key.new_zeros(batch, H, S, D)
            v = value.new_zeros(batch, H, S, D)
        if history.max() > 0:  # residual history: from the ring
            before = lengths - step.num_new
            j = torch.arange(S, device=key.device)
            in_ring = ((j >= self.spec.quantized(before)[:, None]) & (j < before[:, None]))[:, None, :, None]
            ring = self._ring_rows(layer, rows)[:, None].expand(-1, S)
            ring_idx = (j % self.spec.ring)[None, :].expand(batch, -1)
            k = torch.where(in_ring, self.ring_k[ring, :, ring_idx].transpose(1, 2).to(k.dtype), k)
            v = torch.where(in_ring, self.ring_v[ring, :, ring_idx].transpose(1, 2).to(v.dtype), v)
        if self._held_rows and layer in self._held:  # held rows: their history is the held full-precision buffer
            mine, theirs = self._held_index(step.row_ids)
            if mine:
                hk, hv = self._held[layer]
                width = min(S, hk.shape[2] - 1)
                at, src = torch.tensor(mine, device=key.device), torch.tensor(theirs, device=key.device)
                k[at, :, :width] = hk[src, :, :width].to(k.dtype)
                v[at, :, :width] = hv[src, :, :width].to(v.dtype)
        b = torch.arange(batch, device=key.device)[:, None].expand_as(local)
        dst = torch.where(local >= 0, local, S)  # padding -> dropped column S
        k = torch.cat([k, k.new_zeros(batch, H, 1, D)], 2)
        v = torch.cat([v, v.new_zeros(batch, H, 1, D)], 2)
        k[b, :, dst] = key.transpose(1, 2).to(k.dtype)
        v[b, :, dst] = value.transpose(1, 2).to(v.dtype)
        self._work[layer] = (k, v)  # column S is a trash slot (padding writes, skipped moves)
        wk, wv = k[:, :, :S], v[:, :, :S]
        to_pool = lambda t: t.reshape(batch, H, n, P, D).transpose(1, 2).reshape(batch * n, H, P, D)
        pos = m.pos_pool[table.long()].reshape(batch * n, H, P)
        index = (torch.arange(batch, device=key.device)[:, None] * n + torch.arange(n, device=key.device))
        return AttentionView(to_pool(wk), to_pool(wv), pos, index[:, None, :].expand(-1, H, -1).to(torch.int32),
                             lengths[:, None].expand(-1, H).to(torch.int32), P, pool_pages=table.reshape(-1).long())

    def end_layer(self, layer: int, step: StepState) -> None:
        """Commit what aged out of the residual in this layer (deferred prefill steps wait for the method)."""
        m = self.manager
        rows = step.rows
        if step.is_prefill:
            if self._defer:
                return
            wk, wv = self._work.pop(layer)
            counts = m.slot_count_array(step.row_ids)[:, layer]
            before = counts - np.asarray(step.num_new_host)
            held = set(self._held_index(step.row_ids)[0]) if self._held_rows else set()
            if held:  # held rows quantize nothing before release_held (a scoring pass's tokens are temporary)
                free = [i for i in range(len(step.row_ids)) if i not in held]
                if not free:
                    return
                at = torch.tensor(free, device=rows.device)
                rows, wk, wv, counts, before = rows[at], wk[at], wv[at], counts[free], before[free]
            self._commit_from(layer, rows, wk, wv, self.spec.quantized(before), counts)
            return
        # decode: at most one group per row, read from the ring
        G = self.spec.group_size
        lengths = m.lengths[rows, m.layer_key(layer)].long()
        start = self.spec.quantized(lengths - step.num_new)
        due = self.spec.quantized(lengths) > start
        slots = (start[:, None] + torch.arange(G, device=rows.device)) % self.spec.ring  # [B, G]
        ring = self._ring_rows(layer, rows)[:, None].expand_as(slots)
        key = self.ring_k[ring, :, slots].transpose(1, 2)  # [B, H, G, D]
        value = self.ring_v[ring, :, slots].transpose(1, 2)
        dst = torch.where(due, m.global_slots(layer, rows, start[:, None])[:, 0], -1)
        kivi_quantize(*self.page_tensors(), key, value, dst)

    def _commit_from(self, layer: int, rows: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, start: np.ndarray,
                     final: np.ndarray) -> None:
        """Quantize slots ``[start, Q(final))`` of ``W [B, H, S, D]`` into pages and put ``[Q(final), final)`` in the
        ring (host ``start``, ``final [batch]``; ``start`` a multiple of G)."""
        m, G, RC = self.manager, self.spec.group_size, self.spec.ring
        batch, H, S, D = wk.shape
        S -= 1  # the trash column
        end = self.spec.quantized(final)
        groups = int(np.max((end - start) // G, initial=0))
        dev = wk.device
        vals = to_device(np.stack([start, end, final]).astype(np.int64), dev)
        start_t, end_t, final_t = vals[0], vals[1], vals[2]
        if groups > 0:
            first = start_t[:, None] + torch.arange(groups, device=dev) * G  # [B, groups]
            src = (first[..., None] + torch.arange(G, device=dev)).clamp(max=S - 1).reshape(batch, -1)
            b = torch.arange(batch, device=dev)[:, None].expand_as(src)
            key = wk[b, :, src].reshape(batch, groups, G, H, D).permute(0, 1, 3, 2, 4).reshape(-1, H, G, D)
            value = wv[b, :, src].reshape(batch, groups, G, H, D).permute(0, 1, 3, 2, 4).reshape(-1, H, G, D)
            dst = torch.where(first < end_t[:, None], m.global_slots(layer, rows, first), -1)
            kivi_quantize(*self.page_tensors(), key, value, dst.reshape(-1))
        r = torch.arange(RC, device=dev)
        slot = end_t[:, None] + (r - end_t[:, None]) % RC  # the slot of [end, end + RC) stored at ring index r
        keep = (slot < final_t[:, None])[:, None, :, None]
        b = torch.arange(batch, device=dev)[:, None].expand_as(slot)
        ring = self._ring_rows(layer, rows)
        src = slot.clamp(max=S - 1)
        self.ring_k[ring] = torch.where(keep, wk[b, :, src].transpose(1, 2).to(self.ring_k.dtype), self.ring_k[ring])
        self.ring_v[ring] = torch.where(keep, wv[b, :, src].transpose(1, 2).to(self.ring_v.dtype), self.ring_v[ring])
