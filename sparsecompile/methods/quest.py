"""``quest``: query-aware page selection over a fully resident KV cache (Quest, Tang et al. 2024).

Pages
    Quest's pages are the KV pool's own pages: ``page_size`` is the engine option (default 16, Quest's
    default chunk size). ``quest_page_size`` may repeat it for clarity; any other value is an error,
    since the attention reads whole pool pages (a PageSelection) and the metadata is kept per pool page.

Metadata
    For every pool page and KV head, the per-channel minimum and maximum key: the CacheManager's key bounds
    (``track_key_bounds``: ``quest_kmin``, ``quest_kmax`` of ``[pages, kv_heads, head_dim]`` in the KV dtype), which
    every KV write updates, in prefill and decode (the decode step's in the write's own launch), including the
    partially filled last page. Slots are appended in order, so a page's offset 0 is always its first write:
    writing offset 0 resets the page's bounds, which also clears whatever a freed-and-reused page held before.

Selection (decode, layers ``>= dense_layers`` without a sliding window)
    Page score ``sum_c max(q_c * min_c, q_c * max_c)`` per query head, **max over the query heads of a
    GQA group** (an upper bound on every logit the group can produce; see ``kernels/quest_scores.py``).
    Kernel-path conventions of the reference: ``page_budget = budget // page_size`` pages *including the
    current (last) page*, which is always read; the other ``page_budget - 1`` are the top-scoring pages.
    A row holding ``<= budget`` tokens (or ``<= page_budget`` pages) reads everything. Selected pages are
    read in ascending order, so the partially filled current page is last. One page set per KV head.
    Layers ``0 .. dense_layers-1`` and every prefill forward are dense. Nothing is evicted: resident
    bytes equal ``vanilla``'s, and an unselected page can be chosen by a later query.

Dense read of short batches (``dense_below``; not in the reference, which always selects)
    ``methods/dense_read.py``: a decode step whose batch holds ``<= dense_below`` tokens runs the ``dense`` variant
    (every layer reads all its slots, as ``vanilla``). The key bounds stay current through the writes, so a later
    ``sparse`` step selects as if every step had. The default reads densely up to 160 MiB of KV per layer in the
    batch, 40,960 tokens of Llama-3.1-8B, above the crossover measured on the H200 (Quest's decode step at 32K x 1
    equals ``vanilla``'s, 0.94x at 16K x 1, 0.985x at 8K x 4, 1.06x at 48K x 1, 1.13x at 16K x 4;
    ``benchmarks/results/decode_h200_quest_rule.jsonl``). An exported artifact's decode program runs the ``sparse``
    variant at every length; ``warmup(programs=True)`` precompiles a decode program per variant.

Over KIVI storage (``quest+kivi``, ``methods/kivi_select.py``)
    The pages are KIVI pages, their bounds the quantized key groups' own ranges (no ``quest_kmin / quest_kmax``), and
    the residual stands in for the current page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import MethodConfig, MethodConfigError, option
from ..kernels.quest_scores import quest_page_scores
from ..kernels.topk_select import topk_select
from ..runtime.contract import LayerContext, SparseMethod
from ..runtime.host import to_device
from ..runtime.memory_oracle import DenseMemoryOracle
from ..runtime.view import PageSelection, Selection
from .dense_read import DenseReadOfShortBatches, dense_below_option, validate_dense_below
from .read_stats import CountsReads, ReadCounter
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
        dense_below: decode steps whose batch holds at most this many tokens (summed over its rows) read every slot
            (``methods/dense_read.py``); None: the batch's KV per layer up to 160 MiB; 0: always select.
    """

    budget: int = option(2048, "tokens read per decode step and sparse layer (budget // page_size pages, "
                               "current page included)")
    dense_layers: int = option(2, "the first layers, read densely")
    quest_page_size: int | None = option(None, "Quest's page size in tokens; must equal the engine page_size")
    dense_below: int | None = dense_below_option()

    def validate(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 1:
            raise MethodConfigError(f"quest: budget must be a positive number of tokens, got {self.budget!r}")
        if not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise MethodConfigError(f"quest: dense_layers must be an integer >= 0, got {self.dense_layers!r}")
        validate_dense_below("quest", self.dense_below)
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
class QuestRuntime(CountsReads, DenseReadOfShortBatches, SparseMethod):
    name = "quest"
    config_class = QuestConfig
    replays_mixed_steps = True  # device-only hooks; per-row buffers sized by the pool (mixed_graphs.py)
    decode_reads_everything = False  # a budget of the context, once it is longer
    #: its selection needs per-page key bounds only: over KIVI storage they come from the quantized keys' own ranges
    #: (``quest+kivi``, ``methods/kivi_select.py``)
    selects_by_key_bounds = True

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
        layout = manager.layout
        self._check_layout(layout)
        self._track_key_bounds(manager)
        self._set_dense_threshold(self.config.dense_below, layout)

    def _track_key_bounds(self, manager: CacheManager) -> None:
        manager.track_key_bounds(KMIN, KMAX)

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        self._rebuild_summaries(manager, rows)

    def on_truncate(self, manager: CacheManager, rows: list[int]) -> None:
        self._rebuild_summaries(manager, rows)  # the tail page's summary covered the removed keys

    def _rebuild_summaries(self, manager: CacheManager, rows: list[int]) -> None:
        """Key bounds of ``rows``'s pages from the resident keys, every layer's (host loop; one row and layer at a
        time): KV that reached the pool without a write, or a cropped tail page."""
        P = manager.layout.page_size
        kmin, kmax = manager.page_metadata[KMIN], manager.page_metadata[KMAX]
        counts = manager.slot_count_array(rows)
        for i, row in enumerate(rows):
            for layer in range(self.model.num_layers):
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

    def build_decode_selection(self, ctx: LayerContext) -> Selection:
        if not self._sparse(ctx) or self.dense_step(ctx):
            return None
        return self._select(ctx)  # the current page's bounds include the new key (written before this hook)

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        self.reads.record(ctx)

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
        return self.reads.collect(manager, rows)
