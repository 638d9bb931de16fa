"""``quest``: query-aware page selection over a fully resident KV cache (Quest, Tang et al. 2024).

Pages
    Quest's pages are the KV pool's own pages: ``page_size`` is the engine option (default 16, Quest's
    default chunk size). ``quest_page_size`` may repeat it for clarity; any other value is an error,
    since the attention reads whole pool pages (a PageSelection) and the metadata is kept per pool page.

Metadata
    For every pool page and KV head, the per-channel minimum and maximum key
    (``CacheManager.register_page_metadata``: ``quest_kmin``, ``quest_kmax`` of ``[pages, kv_heads, head_dim]``
    in the KV dtype). Updated as keys are written, in prefill and decode, including the partially filled last
    page. Slots are appended in order, so a page's offset 0 is always its first write: writing offset 0
    resets the page's summary, which also clears whatever a freed-and-reused page held before.

Selection (decode, layers ``>= dense_layers`` without a sliding window)
    Page score ``sum_c max(q_c * min_c, q_c * max_c)`` per query head, **max over the query heads of a
    GQA group** (an upper bound on every logit the group can produce; see ``kernels/quest_scores.py``).
    Kernel-path conventions of the reference: ``page_budget = budget // page_size`` pages *including the
    current (last) page*, which is always read; the other ``page_budget - 1`` are the top-scoring pages.
    A row holding ``<= budget`` tokens (or ``<= page_budget`` pages) reads everything. Selected pages are
    read in ascending order, so the partially filled current page is last. One page set per KV head.
    Layers ``0 .. dense_layers-1`` and every prefill forward are dense. Nothing is evicted: resident
    bytes equal ``vanilla``'s, and an unselected page can be chosen by a later query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import MethodConfig, MethodConfigError, option
from ..kernels.quest_scores import page_minmax_update, quest_page_scores
from ..kernels.topk_select import topk_select
from ..runtime.contract import LayerContext, SparseMethod
from ..runtime.host import to_device
from ..runtime.memory_oracle import DenseMemoryOracle
from ..runtime.view import PageSelection, Selection
from .read_stats import ReadCounter
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState

KMIN, KMAX = "quest_kmin", "quest_kmax"


@dataclass
class QuestConfig(MethodConfig):
    """Options of ``quest``.

    Attributes:
        budget: tokens read per decode step and sparse layer (``budget // page_size`` pages, current page included).
        dense_layers: the first layers, read densely (Quest skips layers 0 and 1).
        quest_page_size: Quest's page size in tokens; must equal the engine ``page_size`` (None: use it).
    """

    budget: int = option(2048, "tokens read per decode step and sparse layer (budget // page_size pages, "
                               "current page included)")
    dense_layers: int = option(2, "the first layers, read densely")
    quest_page_size: int | None = option(None, "Quest's page size in tokens; must equal the engine page_size")

    def validate(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 1:
            raise MethodConfigError(f"quest: budget must be a positive number of tokens, got {self.budget!r}")
        if not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise MethodConfigError(f"quest: dense_layers must be an integer >= 0, got {self.dense_layers!r}")
        size = self.quest_page_size
        if size is not None and (not isinstance(size, int) or size < 1 or size & (size - 1)):
            raise MethodConfigError(f"quest: quest_page_size must be a positive power of two, got {size!r}")
        if size is not None and self.budget < size:
            raise MethodConfigError(f"quest: budget={self.budget} is smaller than one page ({size} tokens); "
                                    f"pass budget >= {size} (the current page is always read)")


class QuestMemoryOracle(DenseMemoryOracle):
    """Full KV (nothing is evicted) plus the page summaries, which live with each pool page."""

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        element = torch.empty((), dtype=layout.dtype).element_size()
        #: min and max key of every channel and KV head of one page
        self.metadata_bytes_per_page = 2 * layout.num_kv_heads * layout.head_dim * element

    @property
    def bytes_per_page(self) -> int:
        """KV bytes of one page (all KV heads) plus its Quest metadata."""
        kv = self.layout.page_size * self.layout.num_kv_heads * self.layout.bytes_per_slot_head
        return kv + self.metadata_bytes_per_page


@register_method
class QuestRuntime(SparseMethod):
    name = "quest"
    config_class = QuestConfig

    def __init__(self, config: QuestConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        if config.dense_layers >= model.num_layers:
            raise MethodConfigError(f"quest: dense_layers={config.dense_layers} leaves no sparse layer in a "
                                    f"{model.num_layers}-layer model; pass dense_layers < {model.num_layers}")
        self.config: QuestConfig = config
        self.reads = ReadCounter()

    def _check_layout(self, layout: KVLayout) -> None:
        size, budget = self.config.quest_page_size, self.config.budget
        if size is not None and size != layout.page_size:
            raise MethodConfigError(f"quest: quest_page_size={size} differs from the engine page_size="
                                    f"{layout.page_size}; Quest selects the KV pool's own pages, so pass "
                                    f"page_size={size} instead (or leave quest_page_size unset)")
        if budget < layout.page_size:
            raise MethodConfigError(f"quest: budget={budget} is smaller than one page (page_size={layout.page_size}); "
                                    f"pass budget >= {layout.page_size} (the current page is always read)")

    # ---- setup and capacity
    def memory_oracle(self, layout: KVLayout) -> QuestMemoryOracle:
        self._check_layout(layout)  # the first hook that sees the engine page size: fail at optimize()
        return QuestMemoryOracle(layout)

    def setup(self, manager: CacheManager) -> None:
        self._check_layout(manager.layout)
        shape = (manager.layout.head_dim,)
        manager.register_page_metadata(KMIN, shape, manager.layout.dtype)
        manager.register_page_metadata(KMAX, shape, manager.layout.dtype)

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        self._rebuild_summaries(manager, rows)

    def on_truncate(self, manager: CacheManager, rows: list[int]) -> None:
        self._rebuild_summaries(manager, rows)  # the tail page's summary covered the removed keys

    def _rebuild_summaries(self, manager: CacheManager, rows: list[int]) -> None:
        """Page summaries of ``rows`` from the resident keys (host loop; one row and layer at a time)."""
        P = manager.layout.page_size
        kmin, kmax = manager.page_metadata[KMIN], manager.page_metadata[KMAX]
        counts = manager.slot_count_array(rows)
        for i, row in enumerate(rows):
            for layer in range(self.config.dense_layers, self.model.num_layers):
                count = int(counts[i, layer])
                if count == 0:
                    continue
                pages = to_device(manager.pages_of(row, layer)[: -(-count // P)], kmin.device)
                keys = manager.k_pool[pages].transpose(1, 2)  # [pages, page_size, kv_heads, head_dim]
                filled = (torch.arange(pages.numel() * P, device=kmin.device) < count).view(-1, P, 1, 1)
                kmin[pages] = torch.where(filled, keys, float("inf")).amin(1).to(kmin.dtype)
                kmax[pages] = torch.where(filled, keys, float("-inf")).amax(1).to(kmax.dtype)

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        self.reads.prepare(manager, step)

    # ---- device hooks
    def _sparse(self, ctx: LayerContext) -> bool:
        # A sliding-window layer is bounded by its window already; it stays dense and keeps no summaries.
        return ctx.layer >= self.config.dense_layers and ctx.sliding_window == 0

    def build_prefill_selection(self, ctx: LayerContext) -> Selection:
        if self._sparse(ctx):
            self._update_metadata(ctx)
        return None

    def build_decode_selection(self, ctx: LayerContext) -> Selection:
        if not self._sparse(ctx):
            return None
        self._update_metadata(ctx)  # the current page's summary includes the new key
        return self._select(ctx)

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        self.reads.record(ctx)

    def _update_metadata(self, ctx: LayerContext) -> None:
        """Fold the step's new keys ``[batch, kv_heads, tokens, head_dim]`` into their pages' min / max."""
        m = ctx.manager
        page_minmax_update(m.page_metadata[KMIN], m.page_metadata[KMAX], ctx.key, ctx.new_slots, m.layout.page_size)

    def _select(self, ctx: LayerContext) -> PageSelection:
        """Top pages of each KV head within the budget; returns pages ``[batch, kv_heads, k]`` (ascending)."""
        m = ctx.manager
        P, H = m.layout.page_size, m.layout.num_kv_heads
        budget = self.config.budget
        rows = ctx.step.rows
        table = m.block_table[rows, m.layer_key(ctx.layer)]  # [batch, max_pages] pool page ids
        length = m.lengths[rows, m.layer_key(ctx.layer)].long()  # [batch] slots after this step's write
        n_pages = (length + P - 1) // P
        scores = quest_page_scores(ctx.query[:, :, -1, :], m.page_metadata[KMIN], m.page_metadata[KMAX], table,
                                   n_pages)  # [batch, kv_heads, max_pages]
        page_ids = torch.arange(table.shape[1], device=table.device)
        current = (n_pages - 1).clamp(min=0)
        scores = torch.where(page_ids[None, None, :] == current[:, None, None], float("inf"), scores)
        # Static width: enough pages for "read everything while the row holds <= budget tokens".
        width = min(math.ceil(budget / P), table.shape[1])
        keep = torch.where(length <= budget, n_pages, n_pages.clamp(max=budget // P))  # [batch] pages read
        pages = topk_select(scores, keep[:, None].expand(-1, H), width)
        tokens = length - (n_pages - keep) * P  # every selected page is full except the current one
        return PageSelection(pages, tokens[:, None].expand(-1, H))

    # ---- statistics
    def tokens_read(self, manager: CacheManager, rows: list[int]) -> dict[int, int] | None:
        return self.reads.collect(rows)
