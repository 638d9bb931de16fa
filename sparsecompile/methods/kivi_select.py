"""Query-aware page selection over KIVI storage (``quest+kivi``): Quest's page bounds are the quantized keys' ranges.

Quest bounds every logit of a page by its keys' per-channel minimum and maximum, which it keeps beside each page. A
KIVI key group is quantized per channel over its ``G`` slots with the zero point at the group's minimum and the
scale ``(max - min) / levels`` (``levels = 2^bits - 1``): the two extremes get codes ``0`` and ``levels``, so the keys
the attention reads span exactly ``[zero, zero + levels * scale]`` in every channel. The metadata KIVI keeps anyway
are Quest's bounds, of the dequantized keys: no summary is written, kept or rebuilt
(``kernels/quest_scores.py``'s ``quest_page_scores_affine``; a page of ``P / G`` groups is bounded over its groups).

Selection (decode, Quest's sparse layers and steps; ``methods/quest.py`` for the rest):

* the **residual** (the newest ``residual .. residual + G - 1`` tokens, in full precision) is always read, as Quest
  always reads its current page; so is the page holding the boundary between quantized and residual slots when a
  page holds several key groups (``P > G``: its quantized groups, ``Q % P`` slots);
* of the pages wholly quantized, the **top-scoring** ones per KV head (scores: max over the GQA group, as Quest's),
  as many as fit the rest of the budget: ``k = (budget - always read) // P``, so a step reads at most ``budget``
  tokens (``budget`` counts every slot read, the residual's included, as Quest's counts its current page). A row
  holding ``<= budget`` tokens reads everything;
* the decode kernels read the chosen pages in place (``kivi_decode_attention``'s ``quant_index / quant_count``: the
  Gluon or Triton kernel over those pages, the ring's blocks as ever).

Nothing is evicted: resident bytes are ``kivi``'s. ``budget`` must leave room for one quantized page beside the
most the residual and the boundary page can hold: ``budget >= residual + group_size + P``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..config import MethodConfigError
from ..kernels.quest_scores import quest_page_scores_affine
from ..kernels.topk_select import topk_select
from ..runtime.view import PageSelection

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.contract import LayerContext


class KeyBoundsOverQuantizedPages:
    """Placed before :class:`~.kivi.KiviStorageMixin` for a policy with ``selects_by_key_bounds`` (Quest): its
    ``_select`` over KIVI pages (module docstring), no key bounds of its own."""

    dense_history = True  # every token stays, in order (KiviStorageMixin.dense_history)

    def _track_key_bounds(self, manager: CacheManager) -> None:
        """None: the KIVI key groups' scales and zeros bound the keys."""

    def _rebuild_summaries(self, manager: CacheManager, rows: list[int]) -> None:
        """Nothing to rebuild: the bounds are the quantized pages' own metadata."""

    def _check_layout(self, layout: KVLayout) -> None:
        super()._check_layout(layout)
        floor = self.storage.residual + self.storage.group_size + layout.page_size
        if self.config.budget < floor:
            raise MethodConfigError(
                f"{self.name}: budget={self.config.budget} leaves no room for a quantized page: every step reads the "
                f"residual (up to residual + group_size - 1 = {self.storage.ring - 1} tokens) and the page that "
                f"holds the quantized / residual boundary; pass budget >= {floor} (residual + group_size + one "
                f"{layout.page_size}-slot page)")

    def _select(self, ctx: LayerContext) -> PageSelection:
        """Top wholly quantized pages of each KV head within the budget: pages ``[batch, kv_heads, k]`` (ascending,
        the boundary page last where there is one; -1 padded), tokens their slots."""
        m = ctx.manager
        P, H = m.layout.page_size, m.layout.num_kv_heads
        spec = m.storage.spec
        budget = self.config.budget
        rows = ctx.step.rows
        table = m.block_table[rows, m.layer_key(ctx.layer)]  # [batch, max_pages] pool page ids
        length = m.lengths[rows, m.layer_key(ctx.layer)].long()  # [batch] slots after this step's write
        quantized = spec.quantized(length - ctx.step.num_new)  # as the view's: the new token is in the residual
        full = quantized // P  # [batch] wholly quantized pages, the candidates
        always = length - full * P  # the boundary page's quantized slots and the residual
        k = torch.where(length <= budget, full, torch.minimum(full, ((budget - always) // P).clamp(min=0)))
        zero, scale, levels = m.storage.key_ranges()
        scores = quest_page_scores_affine(ctx.query[:, :, -1, :], zero, scale, table, full, levels)
        width = min(math.ceil(budget / P), table.shape[1])  # static
        pages = topk_select(scores, k[:, None].expand(-1, H), width)  # [batch, kv_heads, width]
        if P > spec.group_size:  # the boundary page, after the chosen ones
            at = torch.arange(width + 1, device=pages.device)[None, None, :] == k[:, None, None]
            boundary = torch.where(quantized % P > 0, full, -1)[:, None, None]
            pages = torch.where(at, boundary, torch.cat([pages, pages.new_full((*pages.shape[:2], 1), -1)], 2))
        return PageSelection(pages, (k * P + quantized % P)[:, None].expand(-1, H))
