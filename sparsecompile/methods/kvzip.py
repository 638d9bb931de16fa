"""``kvzip``: query-agnostic eviction by context reconstruction (KVzip, Kim et al. 2025, https://arxiv.org/abs/2505.23416).

After a prompt's prefill, the model re-reads the prompt: per chunk of ``chunk`` tokens (default 2048), a scoring
pass (``SparseController.score_pass``: temporary KV, dropped afterwards) feeds a "repeat" lead-in and the chunk
after everything resident, and each prompt entry of that chunk scores the maximum softmax probability any query
of its KV group gives it, the softmax running over [sinks, the chunk's entries, the pass's tokens]
(``ReconstructionScorer`` in ``interval_scoring.py``; op ``kvzip_scores``; fp32, where the references use the
model dtype). Lead-ins, as KVzip / kvpress ``KVzipPress``: before the first chunk ``repeat_ids``
("\\n\\nRepeat the previous context exactly."), before each later one ``continue_ids`` ("\\n\\nRepeat the part of
the previous context exactly, starting with") followed by the previous chunk's last ``lead_in`` (8) tokens. The
passes' forwards attend over the whole resident context, as kvpress's do.

Selection: the first ``sinks`` positions are always kept. ``budget`` / ``ratio`` as the other eviction methods
(entries per layer and KV head). ``selection="global"`` (KVzip's "pair" level, kvpress ``layerwise=False``, the
default) keeps the ``layers x kv_heads x budget`` best entries of the whole model under one threshold, so layers
and heads keep different numbers; ``"uniform"`` keeps ``budget`` per layer and head. Eviction is physical and per
KV head; a layer's slot count is its fullest head's, the other heads' extra slots are empty. Scores are slot
metadata (``kvzip_score``): they move with their entries, so a chain continuation re-scores only its new tokens
and selects among old and new entries together. Decode appends, like SnapKV. A prompt that fits the budget is not
re-read (no extra cost). Sliding-window layers keep everything.

Token ids of the lead-ins: ``sparsecompile.LLM`` fills ``repeat_ids`` / ``continue_ids`` from its tokenizer
(``text_options``); ``optimize()`` users pass them (``tokenizer.encode(REPEAT_TEXT, add_special_tokens=False)``).
Without them (the tokenizer-less default) the passes have no instruction tokens: the first chunk is re-read as is
and later chunks after the previous chunk's last ``lead_in`` tokens. Cost: the re-read is a second prefill of the
prompt (plus the lead-ins) and its scores; measured 6.4x vanilla's prefill on CPU at 3K tokens, where the scores'
torch reference dominates (README, ``benchmarks/kvzip_passkey.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..config import MethodConfigError, option
from ..kernels import gather_slots
from ..runtime.contract import LayerContext, ScoringPass
from ..runtime.host import to_device
from .eviction import EvictionConfig, EvictionMemoryOracle, EvictionRuntime, check_positive
from .eviction_ops import INF
from .interval_scoring import ReconstructionScorer, keep_slots, resident_layout
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState

SCORE = "kvzip_score"
REPEAT_TEXT = "\n\nRepeat the previous context exactly."
CONTINUE_TEXT = "\n\nRepeat the part of the previous context exactly, starting with"


def parse_ids(value, name: str) -> tuple[int, ...] | None:
    """Token ids from ``"1,2,3"`` or a sequence of ints (None stays None)."""
    if value is None:
        return None
    items = value.replace(" ", "").split(",") if isinstance(value, str) else list(value)
    try:
        ids = tuple(int(x) for x in items if x != "")
    except (TypeError, ValueError):
        raise MethodConfigError(f"kvzip: {name} must be token ids like '271,47,1' or a list of ints, "
                                f"got {value!r}") from None
    if any(i < 0 for i in ids):
        raise MethodConfigError(f"kvzip: {name} must be token ids >= 0, got {value!r}")
    return ids


@dataclass
class KVzipConfig(EvictionConfig):
    """Options of ``kvzip`` (see module docstring)."""

    sinks: int = option(4, "first positions always kept (attention sinks)")
    chunk: int = option(2048, "prompt tokens re-read per reconstruction forward")
    lead_in: int = option(8, "tokens of the previous chunk repeated before the next one")
    selection: str = option("global", "global: one threshold over every layer, head and entry; uniform: the budget "
                                      "per layer and head")
    repeat_ids: str | tuple[int, ...] | None = option(None, "token ids of the repeat prompt before the first chunk "
                                                            "(LLM fills them from its tokenizer)")
    continue_ids: str | tuple[int, ...] | None = option(None, "token ids before each later chunk (then the previous "
                                                              "chunk's last lead_in tokens)")

    method = "kvzip"

    @classmethod
    def text_options(cls) -> dict[str, str]:
        return {"repeat_ids": REPEAT_TEXT, "continue_ids": CONTINUE_TEXT}

    def protected(self) -> tuple[int, str]:
        return self.sinks + 1, f"sinks + 1 = {self.sinks + 1} (the sinks are always kept)"

    def validate(self) -> None:
        check_positive(self.method, chunk=self.chunk)
        for name in ("sinks", "lead_in"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MethodConfigError(f"kvzip: {name} must be an integer >= 0, got {value!r}")
        if self.selection not in ("global", "uniform"):
            raise MethodConfigError(f"kvzip: selection must be 'global' or 'uniform', got {self.selection!r}")
        self.repeat_ids = parse_ids(self.repeat_ids, "repeat_ids")
        self.continue_ids = parse_ids(self.continue_ids, "continue_ids")
        super().validate()


class KVzipMemoryOracle(EvictionMemoryOracle):
    """SnapKV's shape (the prompt transiently, then the budget, decode appends) plus the re-read's temporary
    tokens (a chunk and its lead-in) on top of a prompt that does not fit the budget. With ``global`` selection
    a layer's count varies around the budget; the serving scheduler follows the measured counts after a prompt."""

    def __init__(self, layout: KVLayout, kept: Callable[[int], list[int]], extra: Callable[[int], int]) -> None:
        super().__init__(layout, kept)
        self.extra = extra

    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        peaks = super().peak_slots_per_layer(prompt_len, max_new_tokens)
        return [max(p, prompt_len + self.extra(prompt_len)) if prompt_len > k else p
                for p, k in zip(peaks, self.kept(prompt_len))]

    def resumed_peak_slots(self, resident: list[int], prompt_len: int, suffix: int) -> list[int]:
        return [r + suffix + self.extra(suffix) for r in resident]


@register_method
class KVzipRuntime(EvictionRuntime):
    name = "kvzip"
    config_class = KVzipConfig
    config: KVzipConfig
    needs_prompt_tokens: ClassVar[bool] = True
    #: the prompt is compacted after its scoring passes (scoring_done), never by a step: kvzip+kivi holds the prompt in
    #: full precision until then (methods/kivi.py, ScoredPromptMixin)
    compacts_after_scoring: ClassVar[bool] = True

    def __init__(self, config: KVzipConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        self._prompt: dict[int, tuple[int, list[int]]] = {}  # row -> (first position, ids) of its current prompt
        self._scoring: list[int] = []  # rows whose passes are running
        self._sliding: set[int] = set()  # sliding-window layers (seen in prefill): kept whole

    # ---- configuration
    def _lead(self, chunk_index: int, previous: list[int]) -> list[int]:
        c = self.config
        if chunk_index == 0:
            return list(c.repeat_ids or ())
        return list(c.continue_ids or ()) + (previous[-c.lead_in:] if c.lead_in else [])

    def _extra(self, prompt_len: int) -> int:
        c = self.config
        lead = max(len(c.repeat_ids or ()), len(c.continue_ids or ()) + c.lead_in)
        return min(prompt_len, c.chunk) + lead

    def memory_oracle(self, layout: KVLayout) -> KVzipMemoryOracle:
        return KVzipMemoryOracle(layout, lambda n: [min(n, b) for b in self.layer_budgets(n)], self._extra)

    def setup(self, manager: CacheManager) -> None:
        super().setup(manager)
        manager.register_slot_metadata(SCORE, torch.float32, 0.0)

    # ---- per-row state
    def reset_rows(self, rows: list[int]) -> None:
        for row in rows:
            self._prompt.pop(row, None)

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        super().fork_rows(manager, sources, forks)
        for source, fork in zip(sources, forks):
            if source in self._prompt:
                first, ids = self._prompt[source]
                self._prompt[fork] = (first, list(ids))

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        super().prepare_step(manager, step)
        if not step.is_prefill or step.prompt_tokens is None:
            return
        for row, (first, ids) in zip(step.row_ids, step.prompt_tokens):
            if ids:
                start, held = self._prompt.get(row, (first, []))
                self._prompt[row] = (start, held + ids)

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        if ctx.step.is_prefill and ctx.sliding_window:
            self._sliding.add(ctx.layer)

    def targets(self, counts: np.ndarray, step: StepState) -> np.ndarray:
        return counts  # nothing is evicted by a step: the prompt is compacted after its re-read (scoring_done)

    # ---- the re-read
    def scoring_passes(self, manager: CacheManager, rows: list[int]) -> list[ScoringPass]:
        counts = manager.slot_count_array(rows)
        by_chunk: dict[int, list[tuple[int, list[int], int, int, int]]] = {}
        self._scoring = []
        scored = np.ones(self.model.num_layers, dtype=bool)
        scored[sorted(self._sliding)] = False  # a sliding-window layer is kept whole (all of them: nothing to score)
        for i, row in enumerate(rows):
            first, ids = self._prompt.pop(row, (0, []))
            budgets = np.asarray(self.layer_budgets(int(self._seen[row])))
            if not ids or (counts[i][scored] <= budgets[scored]).all():
                continue  # fits its budget: kept whole, nothing to score
            self._scoring.append(row)
            end, size = first + len(ids), self.config.chunk
            for j, start in enumerate(range(0, len(ids), size)):
                piece = ids[start:start + size]
                lead = self._lead(j, ids[:start])
                by_chunk.setdefault(j, []).append((row, lead + piece, end, first + start, first + start + len(piece)))
        meta, device = manager.slot_metadata[SCORE], manager.layout.device

        def store(layer, local, slots, scores, mask):
            manager.scatter_slots(meta, torch.where(mask, slots, -1), scores)

        passes = []
        for j in sorted(by_chunk):
            items = by_chunk[j]
            index = [rows.index(row) for row, *_ in items]
            widths = counts[index].max(0).tolist()
            bounds = to_device(np.array([[lo, hi] for *_, lo, hi in items], dtype=np.int64), device)
            span = max(hi - lo for *_, lo, hi in items)
            scorer = ReconstructionScorer(bounds[:, 0], bounds[:, 1], self.config.sinks, widths, span, store)
            passes.append(ScoringPass([it[0] for it in items], [it[1] for it in items], [it[2] for it in items],
                                      scorer))
        return passes

    def scoring_done(self, manager: CacheManager, rows: list[int]) -> None:
        evicting, self._scoring = self._scoring, []
        if not evicting:
            return
        counts = manager.slot_count_array(evicting)
        manager.prepare_writes(evicting, np.zeros_like(counts))  # compaction moves entries: pages must be private
        manager.flush()
        for i, row in enumerate(evicting):
            self._evict_row(manager, row, counts[i])
        manager.flush()

    def _evict_row(self, manager: CacheManager, row: int, counts: np.ndarray) -> None:
        """Keep the best entries of ``row`` (per layer and head, or under one threshold; sinks always)."""
        device = manager.layout.device
        rows = torch.tensor([row], device=device)
        budgets = self.layer_budgets(int(self._seen[row]))
        layers = [layer for layer in range(self.model.num_layers) if layer not in self._sliding]
        scores = {}
        for layer in layers:
            count = int(counts[layer])
            _, slots, pos = resident_layout(manager, layer, rows, torch.tensor([count], device=device), count)
            s = gather_slots(manager.slot_metadata[SCORE], slots)[0]  # [H, count]
            s = torch.where(pos[0] < 0, -INF, s)
            scores[layer] = torch.where((pos[0] >= 0) & (pos[0] < self.config.sinks), INF, s)
        if self.config.selection == "uniform":
            keep = {layer: _top_per_head(scores[layer], min(int(counts[layer]), budgets[layer])) for layer in layers}
        elif self.model.tp.size > 1:
            keep = self._top_global_over_ranks(scores, budgets)
        else:
            total = sum(manager.layout.num_kv_heads * min(int(counts[layer]), budgets[layer]) for layer in layers)
            keep = _top_global(scores, total)
        for layer in layers:
            keep_slots(manager, row, layer, keep[layer])

    def _top_global_over_ranks(self, scores: dict[int, torch.Tensor], budgets: list[int]) -> dict[int, torch.Tensor]:
        """Global selection under tensor parallelism: one threshold over every head of the model, as on one rank.
        Each rank holds ``[H / tp, count]`` scores per layer (its count: the most any of its heads holds); the ranks'
        scores, padded to the largest count, are gathered in head order, the whole model's best entries chosen with
        the same ties (layer, head, slot: a head's slots are the same whatever rank holds it), and each rank keeps
        its heads' share."""
        tp, layers = self.model.tp, list(scores)
        heads = next(iter(scores.values())).shape[0]
        local = torch.tensor([scores[layer].shape[-1] for layer in layers], device=scores[layers[0]].device)
        widths = tp.all_reduce(local, "max").tolist()
        full = {layer: tp.all_gather(F.pad(scores[layer], (0, width - scores[layer].shape[-1]), value=-INF), dim=0)
                for layer, width in zip(layers, widths)}
        total = sum(tp.size * heads * min(width, budgets[layer]) for layer, width in zip(layers, widths))
        chosen = _top_global(full, total)
        mine = slice(tp.rank * heads, (tp.rank + 1) * heads)
        return {layer: chosen[layer][mine, :scores[layer].shape[-1]] for layer in layers}


def _top_per_head(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[H, n]`` bool: each head's ``k`` best entries (ties: the lower slot), never an empty one."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, True)
    return keep & (scores > -INF)


def _top_global(scores: dict[int, torch.Tensor], total: int) -> dict[int, torch.Tensor]:
    """The ``total`` best entries over every layer and head (ties: lower layer, head, slot)."""
    layers = list(scores)
    flat = torch.cat([scores[layer].reshape(-1) for layer in layers])
    keep_flat = torch.zeros_like(flat, dtype=torch.bool)
    keep_flat[flat.sort(descending=True, stable=True).indices[:total]] = True
    keep_flat &= flat > -INF
    out, start = {}, 0
    for layer in layers:
        n = scores[layer].numel()
        out[layer] = keep_flat[start:start + n].view_as(scores[layer])
        start += n
    return out
