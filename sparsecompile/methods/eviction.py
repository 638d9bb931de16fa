"""Shared machinery of the eviction methods (``streamingllm``, ``snapkv``, ``pyramidkv``, ``h2o``).

Budgets: every eviction method takes exactly one of ``budget`` (tokens kept per layer and KV head,
protected tokens included) or ``ratio`` (that fraction of the prompt, ``int(n * ratio)`` as kvpress
rounds it). A budget never drops below the method's protected tokens (window, sinks, recent) and a
prompt no longer than its budget is kept whole.

Host / device split (see ``runtime/cache_manager.py``): kept counts are functions of lengths and
budgets only, so the host computes them in ``prepare_step`` (:meth:`EvictionRuntime.targets`), the
device moves the kept entries to the front of each ``(row, layer)`` in ``finish_step``, and
``commit_step`` truncates to the targets, which frees the pages. Device-side selection (the helpers are
``eviction_ops.py``'s):

* after a prompt (eager): :func:`select_keep` (top-k of a per-slot score, protected slots at +inf)
  then :func:`compact_kept`, which keeps the kept entries in slot order (SnapKV pools by slot order);
* during decode (compiled, no host sync): one token a step (``interval`` 1), the ``evict_lowest`` op picks the
  victim and moves the tail entry into its hole (``CacheManager.evict_lowest``); more (``interval`` > 1),
  :func:`evict_and_fill` drops the ``count - budget`` lowest scores and moves the few tail entries into the
  holes. Either way a step moves ``interval`` slots, not ``budget``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..config import MethodConfig, MethodConfigError, option
from ..runtime.compilation import static_address
from ..runtime.contract import SparseMethod
from ..runtime.host import to_device
from ..runtime.memory_oracle import MemoryOracle
from .eviction_ops import INF, compact_kept, evict_and_fill, resident, select_keep
from .eviction_oracle import EvictionMemoryOracle
from .read_stats import copy_rows

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState

POSITIONS = "positions"  # EvictionRuntime.victim_values: the tokens' positions, lowest (oldest) first


@dataclass
class EvictionConfig(MethodConfig):
    """``budget`` (tokens kept per layer and KV head) or ``ratio`` (fraction of the prompt kept): exactly one."""

    budget: int | None = option(None, "tokens kept per layer and KV head, protected tokens included (or ratio)")
    ratio: float | None = option(None, "fraction of the prompt kept per layer and KV head, in (0, 1] (or budget)")

    method: ClassVar[str] = "eviction"

    def protected(self) -> tuple[int, str]:
        """The smallest budget and why (``budget`` below it is refused)."""
        return 1, "one token"

    def validate(self) -> None:
        m = self.method
        if (self.budget is None) == (self.ratio is None):
            got = "both" if self.budget is not None else "neither"
            raise MethodConfigError(f"{m}: pass exactly one of budget (tokens kept per layer) or ratio (fraction of "
                                    f"the prompt kept, 0 < ratio <= 1); got {got}")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
                raise MethodConfigError(f"{m}: budget must be a positive number of tokens, got {self.budget!r}")
            floor, why = self.protected()
            if self.budget < floor:
                raise MethodConfigError(f"{m}: budget={self.budget} is smaller than {why}; pass budget >= {floor}")
        elif isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise MethodConfigError(f"{m}: ratio must be in (0, 1] (the fraction of the prompt kept), "
                                    f"got {self.ratio!r}")

    def budget_for(self, prompt_len: int) -> int:
        """Tokens per layer for a prompt of ``prompt_len`` tokens (a shorter prompt is kept whole)."""
        want = self.budget if self.budget is not None else int(prompt_len * self.ratio)
        return max(want, self.protected()[0])


def check_positive(method: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MethodConfigError(f"{method}: {name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------------------------- runtime
class EvictionRuntime(SparseMethod):
    """Budget bookkeeping and physical eviction shared by the eviction methods.

    Subclasses set :attr:`chunk_eviction` / :attr:`decode_interval` and implement :meth:`prefill_scores`
    (and :meth:`decode_scores` when they evict during decode).
    """

    config: EvictionConfig
    keeps_all_tokens = False
    step_scoped = ("_counts", "_targets", "_step_counts", "_step_targets", "_step_recent")
    #: evict after every prefill chunk (H2O), not only after the prompt's last one
    chunk_eviction: ClassVar[bool] = False
    #: when decode evicts one token a step, the per-slot values whose lowest outside the protected slots is the
    #: victim: a slot metadata name, or :data:`POSITIONS` (the oldest token goes). Then the ``evict_lowest`` op
    #: picks it and fills its hole, one node and one launch per layer, instead of :meth:`decode_scores` (None:
    #: :meth:`decode_scores` and :func:`evict_and_fill`); :meth:`protected_slots` and the recent window say what it
    #: never takes.
    victim_values: ClassVar[str | None] = None
    #: decode eviction always takes the oldest token past :meth:`protected_slots` (a sliding window): over a storage
    #: that must not rewrite slots it can slide a page at a time instead (``streamingllm+kivi``, ``kivi_window.py``)
    window_pages: ClassVar[bool] = False

    def __init__(self, config: EvictionConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        # decode_slot_bound: fixed by the options, read by every decode layer call (a plain attribute, which dynamo
        # reads as a constant; a cached_property's lock broke the compiled step's trace)
        bounded = self.decode_interval and config.budget is not None
        self._slot_bound = max(self.layer_budgets(1 << 40)) + self.decode_interval if bounded else None
        self._seen = np.zeros(0, dtype=np.int64)  # prompt tokens fed per row (host)
        self._decode_budget = np.zeros(0, dtype=np.int64)  # per row, fixed when its prompt completes (host)
        self._limits: torch.Tensor | None = None  # [max_seqs, 2] (budget, recent) per row, read by compiled decode
        self._counts = np.zeros((0, 0), dtype=np.int64)  # this step's slot counts [batch, layers] (host)
        self._targets = np.zeros((0, 0), dtype=np.int64)  # ... and what they become after finish_step
        # Device copies for a prefill step that evicts, uploaded once in prepare_step (None otherwise): counts and
        # targets [batch, layers], and each row's recent_tokens(budget) [batch] (H2O's protected window).
        self._step_counts: torch.Tensor | None = None
        self._step_targets: torch.Tensor | None = None
        self._step_recent: torch.Tensor | None = None

    @property
    def decode_interval(self) -> int:
        """Evict during decode once a row holds ``budget + interval`` slots (0: decode only appends)."""
        return 0

    def decode_slot_bound(self) -> int | None:
        """A decoding row holds at most its layer's budget plus one interval's new tokens when its attention runs
        (``targets``: a row reaching ``budget + interval`` goes back to ``budget``; prefill ended at the budget).
        Budgets given as a ratio of the prompt have no fixed bound."""
        return self._slot_bound

    # ---- what subclasses read of this step's eviction plan
    def evicts_layer(self, layer: int) -> bool:
        """Host: this (prefill) step compacts ``layer`` for at least one row."""
        return bool((self._targets[:, layer] < self._counts[:, layer]).any())

    def step_counts(self, layer: int) -> torch.Tensor:
        """Device ``[batch]`` slot counts of ``layer`` before this prefill step's eviction (evicting steps only)."""
        return self._step_counts[:, layer]

    def step_recent(self) -> torch.Tensor:
        """Device ``[batch]`` protected recent tokens of each row in this prefill step (evicting steps only)."""
        return self._step_recent

    def decode_recent(self, rows: torch.Tensor) -> torch.Tensor:
        """Device ``[batch]`` protected recent tokens of decoding ``rows`` (traceable)."""
        return self._limits[rows, 1]

    # ---- budgets (host)
    def layer_budgets(self, prompt_len: int) -> list[int]:
        """Budget per layer for a prompt of ``prompt_len`` tokens (a layer keeps ``min(prompt_len, budget)``)."""
        return [self.config.budget_for(prompt_len)] * self.model.num_layers

    def recent_tokens(self, budget: int) -> int:
        """Protected newest tokens for a row whose budget is ``budget`` (H2O)."""
        return 0

    def targets(self, counts: np.ndarray, step: StepState) -> np.ndarray:
        """Slot counts ``[batch, layers]`` after this step's eviction, from the counts before it."""
        rows = step.row_ids
        if step.is_prefill:
            evicting = np.asarray(step.ends_prompt) | self.chunk_eviction
            if not evicting.any():
                return counts
            budgets = np.array([self.layer_budgets(int(self._seen[r])) for r in rows], dtype=np.int64)
            return np.where(evicting[:, None], np.minimum(counts, budgets.reshape(counts.shape)), counts)
        if not self.decode_interval:
            return counts
        budget = self._decode_budget[rows][:, None]
        return np.where(counts >= budget + self.decode_interval, budget, counts)

    # ---- lifecycle
    def setup(self, manager: CacheManager) -> None:
        self._fit_rows(manager)

    def _fit_rows(self, manager: CacheManager) -> None:
        """Per-row state sized to the manager's rows (they grow with ``CacheManager.grow``)."""
        n = manager.max_seqs
        if self._seen.shape[0] < n:
            self._seen = np.pad(self._seen, (0, n - self._seen.shape[0]))
            self._decode_budget = np.pad(self._decode_budget, (0, n - self._decode_budget.shape[0]))
        if self._limits is None or self._limits.shape[0] < n:
            limits = torch.zeros(n, 2, dtype=torch.int64, device=manager.layout.device)
            if self._limits is not None:
                limits[: self._limits.shape[0]] = self._limits
            static_address(limits)
            self._limits = limits

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        self._fit_rows(manager)
        counts = manager.slot_count_array(step.row_ids)
        if step.is_prefill:
            fresh = [r for r, c, n in zip(step.row_ids, counts[:, 0], step.num_new_host) if c == n]
            self._seen[fresh] = 0  # a row holding only this step's tokens starts a new sequence
            self.reset_rows(fresh)
            self._seen[step.row_ids] += step.num_new_host
        self._counts, self._targets = counts, self.targets(counts, step)
        self._upload_step(manager, step)

    def _upload_step(self, manager: CacheManager, step: StepState) -> None:
        """Device copies of what the prefill eviction reads per layer, in one non-blocking transfer.

        Per-layer ``torch.as_tensor(..., device=cuda)`` would synchronise the host with the GPU once per layer.
        Decode steps and prefill steps that evict nothing upload nothing.
        """
        self._step_counts = self._step_targets = self._step_recent = None
        if not step.is_prefill or not (self._targets < self._counts).any():
            return
        layers = self._counts.shape[1]
        recent = [self.recent_tokens(self.config.budget_for(int(self._seen[r]))) for r in step.row_ids]
        packed = np.concatenate([self._counts, self._targets, np.asarray(recent, dtype=np.int64)[:, None]], axis=1)
        values = to_device(packed.astype(np.int64, copy=False), manager.layout.device)
        self._step_counts, self._step_targets = values[:, :layers], values[:, layers: 2 * layers]
        self._step_recent = values[:, 2 * layers]

    def reset_rows(self, rows: list[int]) -> None:
        """Forget per-row method state of rows that start a new sequence (host)."""

    def release_rows(self, manager: CacheManager, rows: list[int]) -> None:
        self.reset_rows(rows)

    def rewrites_resident(self, manager: CacheManager, step: StepState) -> np.ndarray:
        return (self._targets < self._counts).any(axis=1)  # compaction or eviction moves resident slots

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        self._fit_rows(manager)
        self._seen[forks] = self._seen[sources]
        self._decode_budget[forks] = self._decode_budget[sources]
        copy_rows([self._limits], sources, forks)

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        over, layers = np.nonzero(self._targets < self._counts)
        if len(over):
            targets = self._targets[over, layers]
            # decode keeps the pages of budget + interval slots (the MemoryOracle's held slots): the row takes them
            # back before its next eviction, and freeing them would cost a page per pair and step
            reserve = None if step.is_prefill or not self.decode_interval else targets + self.decode_interval
            manager.truncate_many(np.asarray(step.row_ids)[over], layers, targets, reserve)
        if step.is_prefill and step.is_last_chunk:
            self._prompt_done([r for r, done in zip(step.row_ids, step.ends_prompt) if done])

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        """Loaded KV counts as a compacted prompt of ``prompt_lengths`` tokens (it must fit the budgets)."""
        self._fit_rows(manager)
        self._seen[rows] = prompt_lengths
        self.reset_rows(rows)
        self._prompt_done(rows)

    def _prompt_done(self, rows: list[int]) -> None:
        """Fix each row's decode budget (host) and, for a compiled decode step that evicts, its budget and recent
        window (device)."""
        budgets = [self.row_decode_budget(int(self._seen[r])) for r in rows]
        self._decode_budget[rows] = budgets
        if not self.decode_interval:
            return
        limits = np.array([[b, self.recent_tokens(b)] for b in budgets], dtype=np.int64).reshape(-1, 2)
        device = self._limits.device
        self._limits[to_device(np.asarray(rows, dtype=np.int64), device)] = to_device(limits, device)

    def row_decode_budget(self, prompt_len: int) -> int:
        """The decode budget of a row whose prompt had ``prompt_len`` tokens (its first layer's)."""
        return self.layer_budgets(prompt_len)[0]

    def finish_step(self, manager: CacheManager, step: StepState) -> None:
        if step.is_prefill:
            self._evict_prefill(manager, step)
        elif self.decode_interval:
            self._evict_decode(manager, step)

    def _evict_prefill(self, manager: CacheManager, step: StepState) -> None:
        """Eager: per layer with a row over its target, keep the target's best slots in slot order.

        Widths come from the host counts; the per-row counts and targets the device needs were uploaded once in
        :meth:`prepare_step`, so this loop queues device work without waiting for it.
        """
        for layer in np.nonzero((self._targets < self._counts).any(0))[0].tolist():
            width, k_max = int(self._counts[:, layer].max()), int(self._targets[:, layer].max())
            counts, keep = self._step_counts[:, layer], self._step_targets[:, layer]
            scores = self.prefill_scores(manager, step, layer, width)
            slot = torch.arange(width, device=scores.device)
            scores = torch.where(slot < counts[:, None, None], scores, -INF)
            kept = select_keep(scores, keep, k_max)
            active = (keep < counts)[:, None, None]
            compact_kept(manager, layer, step.rows, torch.where(active, kept, -1))

    def _evict_decode(self, manager: CacheManager, step: StepState) -> None:
        """Traceable: rows at ``budget + interval`` slots drop to ``budget`` (all inside the compiled step)."""
        width = self.decode_width(manager)
        budget = self._limits[step.rows, 0]
        if self.victim_values is not None and self.decode_interval == 1:
            values = None if self.victim_values == POSITIONS else self.victim_values
            recent = self.decode_recent(step.rows)
            for layer in range(self.model.num_layers):
                count = manager.lengths[step.rows, manager.layer_key(layer)]
                manager.evict_lowest(layer, step.rows, values, count, budget, recent, self.protected_slots(), width)
            return
        for layer in range(self.model.num_layers):
            count = manager.lengths[step.rows, manager.layer_key(layer)].long()
            evict = torch.where(count >= budget + self.decode_interval, count - budget, 0)
            slots, valid, pos = resident(manager, layer, step.rows, width)
            scores = self.decode_scores(manager, step, layer, slots, pos)
            evict_and_fill(manager, layer, step.rows, scores, valid, count, evict, self.decode_interval)

    def protected_slots(self) -> int:
        """Leading row-local slots decode eviction never takes (StreamingLLM's sinks; they stay first)."""
        return 0

    def decode_width(self, manager: CacheManager) -> int:
        """Static slot width the decode eviction looks at (>= every row's count while decoding)."""
        full = manager.slot_capacity
        if self.config.budget is None:
            return full
        page = manager.layout.page_size
        return min(full, -(-(self.config.budget + self.decode_interval) // page) * page)

    # ---- scores (device), implemented by subclasses
    def prefill_scores(self, manager: CacheManager, step: StepState, layer: int, width: int) -> torch.Tensor:
        """``[batch, kv_heads, width]`` score of each of the first ``width`` slots (+inf: always kept)."""
        raise NotImplementedError

    def decode_scores(self, manager: CacheManager, step: StepState, layer: int, slots: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
        """Traceable: ``[batch, kv_heads, width]`` scores of the resident ``slots`` (+inf: protected)."""
        raise NotImplementedError

    def memory_oracle(self, layout: KVLayout) -> MemoryOracle:
        decode_budget = (lambda n: self.layer_budgets(n)[0]) if self.decode_interval else None
        return EvictionMemoryOracle(layout, lambda n: [min(n, b) for b in self.layer_budgets(n)], decode_budget,
                                    max(1, self.decode_interval), self.chunk_eviction)
