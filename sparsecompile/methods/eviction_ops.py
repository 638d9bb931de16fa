"""Device-side helpers of the eviction methods (``eviction.py``'s runtime and the methods on it): the resident slots of
a layer, the recent-window mask, the kept set of a prompt (:func:`select_keep`, :func:`compact_kept`) and a decode
step's eviction of more than one token (:func:`evict_and_fill`). Traceable: no host sync, static shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels import gather_slots

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager

INF = float("inf")


def resident(manager: CacheManager, layer: int | torch.Tensor, rows: torch.Tensor,
             width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``width`` row-local slots of ``layer`` (or of each row's own layer, ``[batch]``).

    Returns global slot ids per head ``[batch, kv_heads, width]`` (0 where invalid), ``valid [batch, 1, width]``
    and logical positions ``[batch, kv_heads, width]`` (-1 where invalid).
    """
    slots, valid = manager.resident_slot_ids(layer, rows, width)
    per_head = slots.clamp(min=0)[:, None, :].expand(-1, manager.layout.num_kv_heads, -1)
    valid = valid[:, None, :]
    pos = torch.where(valid, gather_slots(manager.pos_pool, per_head).long(), -1)
    return per_head, valid, pos


def recent_mask(pos: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, width]``: the ``recent [batch]`` newest positions of each head (positions are consecutive
    per row and the recent window is never evicted, so they are the positions above ``newest - recent``)."""
    newest = pos.max(dim=-1, keepdim=True).values
    return (pos >= 0) & (pos > newest - recent[:, None, None])


def select_keep(scores: torch.Tensor, keep: torch.Tensor, k_max: int) -> torch.Tensor:
    """Per ``(row, head)``, the ``keep [batch]`` best slots of ``scores [batch, kv_heads, width]``, ascending.

    Protected slots carry +inf, slots to drop for sure -inf. Returns ``[batch, kv_heads, k_max]`` row-local
    slots, -1 past each row's ``keep``. Equal scores (common after max pooling) keep the lower slot: a stable sort,
    so the kept set does not depend on how wide the batch's score tensor is (``topk``'s tie order does).
    """
    width = scores.shape[-1]
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k_max]
    ranked = torch.arange(k_max, device=scores.device) < keep[:, None, None]
    idx = torch.where(ranked, top, width).sort(dim=-1).values
    return torch.where(idx < width, idx, -1)


def compact_kept(manager: CacheManager, layer: int, rows: torch.Tensor, kept: torch.Tensor) -> None:
    """Move the kept row-local slots ``kept [batch, kv_heads, k]`` (ascending, -1 padded) to slots ``0..``.

    Order is preserved; rows or heads padded with -1 move nothing (the host then truncates with ``truncate``).
    """
    dst = torch.arange(kept.shape[-1], device=kept.device).expand_as(kept)
    manager.move_slots(layer, rows, kept, torch.where(kept >= 0, dst, -1))


def evict_and_fill(manager: CacheManager, layer: int, rows: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor,
                   count: torch.Tensor, evict: torch.Tensor, max_evict: int) -> None:
    """Drop the ``evict [batch]`` lowest-scoring slots per head and refill the holes from the tail (traceable).

    ``scores [batch, kv_heads, width]`` (+inf: protected), ``valid [batch, 1, width]``, ``count [batch]`` slots in
    use, ``evict <= max_evict`` (static). Afterwards slots ``0..count-evict-1`` hold the kept entries; only
    ``max_evict`` slots per head move, so this is cheap enough for every decode step.
    """
    new_count = (count - evict)[:, None, None]
    m = min(max_evict, scores.shape[-1])
    k = torch.arange(m, device=scores.device)
    victims = torch.where(valid, scores, INF).topk(m, dim=-1, largest=False).indices  # [batch, kv_heads, m]
    chosen = k < evict[:, None, None]
    hole = chosen & (victims < new_count)
    tail = (new_count + k).expand_as(victims)  # slots new_count .. count-1 (first `evict` of them)
    is_victim = ((tail[..., :, None] == victims[..., None, :]) & chosen[..., None, :]).any(-1)
    mover = chosen & ~is_victim

    def packed(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # The flagged values first, in order; -1 after (column m swallows the unflagged ones).
        rank = torch.where(flags, flags.long().cumsum(-1) - 1, m)
        out = torch.full((*values.shape[:-1], m + 1), -1, dtype=values.dtype, device=values.device)
        return out.scatter(-1, rank, values)[..., :m]

    dst, src = packed(hole, victims), packed(mover, tail)
    ok = (dst >= 0) & (src >= 0)
    manager.fill_slots(layer, rows, torch.where(ok, src, -1), torch.where(ok, dst, -1))  # holes and tail: disjoint
