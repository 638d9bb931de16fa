"""Scoring resident entries by position interval, and keeping a per-head subset of a row's slots.

Shared by ``kvzip`` (its post-prompt context reconstruction) and interval pruning of idle state
(``serving/prune.py``). Both run *scoring passes* (``SparseController.score_pass``): extra tokens fed after the
row's history, whose KV is temporary, with a scorer in place of the method's hooks.

* :class:`ReconstructionScorer` (KVzip, Kim et al. 2025): the pass re-reads the tokens of a position interval
  ``[lo, hi)`` after a "repeat" lead-in; each resident entry of the interval scores the **maximum**, over its KV
  group's query heads and the pass's queries, of the softmax probability it receives, the softmax running over
  [sinks, the interval's resident entries, the pass's own tokens] (kvpress ``KVzipPress``; op ``kvzip_scores``).
  Entries are chosen per KV head by position, so it works on any resident layout (evicted, not in slot order).
* :class:`WindowScorer` (SnapKV's observation window, for pruning): the pass re-feeds the last tokens of the
  history; each resident entry scores the softmax mass (fp32, summed over the pass's queries, over every resident
  entry) averaged over its KV group.
* :func:`keep_slots`: physical removal: per KV head, the kept slots move to the front in slot order, the
  remaining slots of heads that kept fewer than the layer's most become empty (position -1, never attended), and
  the layer is truncated to that most (pages go back to the allocator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..kernels import gather_slots, kvzip_scores, snapkv_scores
from ..runtime.contract import LayerContext

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager

#: ``store(layer, local, global_slots, scores, mask)``: all ``[batch, kv_heads, n]``; local / global slot ids of the
#: scored entries (row-local index into the row's resident slots, pool slot id), fp32 scores, which ones count.
Store = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def resident_layout(manager: CacheManager, layer: int, rows: torch.Tensor, count: torch.Tensor,
                    width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``count [batch]`` row-local slots of ``layer`` (``width`` static): local ids ``[batch, H, width]``,
    global slot ids (0 where invalid) and logical positions (-1 where invalid or empty)."""
    H = manager.layout.num_kv_heads
    local = torch.arange(width, device=rows.device)[None, :].expand(rows.shape[0], -1)
    inside = local < count[:, None]
    slots = manager.global_slots(layer, rows, torch.where(inside, local, -1)).clamp(min=0)[:, None, :].expand(-1, H, -1)
    pos = torch.where(inside[:, None, :], gather_slots(manager.pos_pool, slots).long(), -1)
    return local[:, None, :].expand(-1, H, -1), slots, pos


class ReconstructionScorer:
    """KVzip scores for the entries whose positions lie in ``[lo[i], hi[i])`` of row ``i`` (see module docstring).

    ``widths[layer]``: the most resident slots any row holds in that layer before the pass (static shapes);
    ``span``: the longest interval (the view the kernel reads is at most sinks + span + the pass's tokens wide);
    ``sinks``: positions below ``min(sinks, lo)`` join the softmax (attention sinks) without being scored;
    sliding-window layers are skipped (their window never reaches the re-read interval).
    """

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, sinks: int, widths: list[int], span: int,
                 store: Store) -> None:
        self.lo, self.hi, self.sinks, self.widths, self.store = lo, hi, sinks, widths, store
        self.span = span

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        if ctx.sliding_window:
            return
        m, step, layer = ctx.manager, ctx.step, ctx.layer
        width, q = self.widths[layer], step.num_tokens
        count = m.lengths[step.rows, layer].long() - step.num_new  # resident before the pass
        local, slots, pos = resident_layout(m, layer, step.rows, count, width)
        lo, hi = self.lo[:, None, None], self.hi[:, None, None]
        chunk = (pos >= lo) & (pos < hi)
        chosen = chunk | ((pos >= 0) & (pos < torch.clamp(lo, max=self.sinks)))
        # chosen first, in slot order; a head has at most sinks + span of them (one entry per position)
        width = min(width, self.sinks + self.span)
        order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices[..., :width]
        n_chosen = chosen.sum(-1)  # [batch, H]
        sorted_slots, sorted_local = slots.gather(-1, order), local.gather(-1, order)
        sorted_chunk = chunk.gather(-1, order)
        # the pass's own tokens right after the chosen entries (column width + q: a sink for the padding)
        offsets = step.new_offsets  # [batch, q], -1 = left padding
        H = m.layout.num_kv_heads
        temp = (count[:, None] + offsets.clamp(min=0))[:, None, :].expand(-1, H, -1)
        # keys through the pass's view: the pool's slots, or (KIVI) those of its full-precision buffer
        view, P = ctx.view, ctx.view.block_size
        through = lambda local: view.index.long().gather(-1, local.clamp(min=0) // P) * P + local.clamp(min=0) % P
        chosen_slots = through(sorted_local)
        index = torch.cat([chosen_slots, chosen_slots.new_zeros(chosen_slots.shape[0], H, q + 1)], dim=-1)
        # (the padding mask per row, broadcast over heads: [batch, 1, q], not [batch, q] against [batch, H, q])
        target = torch.where((offsets >= 0)[:, None, :], n_chosen[:, :, None] + offsets[:, None, :], width + q)
        index = index.scatter(-1, target, through(temp))
        lengths = n_chosen + step.num_new[:, None]
        scores = kvzip_scores(ctx.query, view.k_pool, view.pos_pool, index.to(torch.int32), lengths.to(torch.int32),
                              step.positions, 1, ctx.scale, ctx.sliding_window)
        self.store(layer, sorted_local, sorted_slots, scores[..., :width], sorted_chunk)


class WindowScorer:
    """SnapKV-style scores of every resident entry from the pass's queries (see module docstring)."""

    def __init__(self, widths: list[int], store: Store) -> None:
        self.widths, self.store = widths, store

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        m, step, layer, v = ctx.manager, ctx.step, ctx.layer, ctx.view
        width = self.widths[layer]
        mass = snapkv_scores(ctx.query, v.k_pool, v.pos_pool, v.index, v.lengths, step.positions, v.block_size,
                             ctx.scale, ctx.sliding_window)  # [batch, q_heads, view slots]: view slot j = local j
        H = m.layout.num_kv_heads
        mass = mass[..., :width].reshape(mass.shape[0], H, -1, width).mean(2)
        count = m.lengths[step.rows, layer].long() - step.num_new
        local, slots, pos = resident_layout(m, layer, step.rows, count, width)
        self.store(layer, local, slots, mass, pos >= 0)


def keep_slots(manager: CacheManager, row: int, layer: int, keep: torch.Tensor) -> int:
    """Keep, per KV head, the slots where ``keep [H, count]`` (bool) is set (see module docstring); returns the
    layer's new slot count. Host-driven (one sync for the counts); not for compiled steps."""
    H, device = manager.layout.num_kv_heads, manager.layout.device
    count = keep.shape[-1]
    kept = keep.sum(-1)  # [H]
    new_count = int(kept.max()) if count else 0
    if new_count == count and bool(keep.all()):
        return count
    rows = torch.tensor([row], device=device)
    local = torch.arange(count, device=device)
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # kept first, in slot order
    src = torch.where(torch.arange(count, device=device)[None, :] < kept[:, None], local[order], -1)[None]
    dst = torch.where(src >= 0, local[None, None, :].expand_as(src), -1)
    manager.move_slots(layer, rows, src[..., :max(new_count, 1)], dst[..., :max(new_count, 1)])
    if new_count:
        tail = local[:new_count][None, :].expand(H, -1)
        empty = tail >= kept[:, None]  # heads that kept fewer: their trailing slots become empty
        glob = manager.global_slots(layer, rows, local[:new_count][None])[0][None, :].expand(H, -1)
        manager.scatter_slots(manager.pos_pool, torch.where(empty, glob, -1)[None],
                              torch.full((1, H, new_count), -1, dtype=torch.int32, device=device))
        if bool((kept < new_count).any()):  # a head kept fewer: empty slots before the layer's count
            manager.mark_holes(row)
    manager.truncate(row, layer, new_count)
    return new_count
