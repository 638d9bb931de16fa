"""``omnikv``: filter layers pick prompt tokens with the current query; the layers after them reuse the set
(OmniKV, Hao et al., ICLR 2025; the released "last" selector).

Layer roles
    ``filter_layers`` (default 2, 8, 18) observe; every layer after the first filter layer that is not a
    filter layer is *sparse* and reuses the set of the closest filter layer before it, reading those slots
    from its own KV. Layers before the first filter layer and the filter layers themselves are dense.
    The reference's "wait" layers (dense layers right after a filter layer, there to hide CPU->GPU loads)
    are not modelled: nothing is offloaded here. Default filter layers at or past the model's depth are
    dropped (a 12-layer model observes at 2 and 8); explicit ones out of range are an error, and so is a
    model too shallow for any default filter layer.

Selection (decode only; prefill is dense everywhere)
    At a filter layer, ``score_j = max over query heads of q_h . k_j`` (raw logits, the current decode
    query) over the *prompt* slots of the row, written by the layer's own dense attention kernel beside its
    output (``paged_attention_token_max``: one pass over the keys, not two); the top ``budget`` (or
    ``ceil(ratio * prompt)``) slots, ascending, are kept in the runtime's state for the rest of the step.
    A sparse layer reads those slots followed by every slot written since the prompt (decode tokens,
    always read). Like the reference, one set is shared by all heads and all sparse layers of the group;
    unlike its batch-1 code, each sequence of the batch has its own set. The prompt is everything
    processed by prefill forwards, so a continuation's new prompt tokens become candidates.
    Sliding-window layers stay dense. Under tensor parallelism the max runs over every rank's query
    heads (an all-reduce), so all ranks select the same set.

Dense read of short batches (``dense_below``; not in the reference, which always selects)
    ``methods/dense_read.py``: a decode step whose batch holds ``<= dense_below`` tokens runs the ``dense`` variant:
    every layer reads all its slots with the plain attention kernel (no token max written, no top-k), as
    ``vanilla``. Nothing carries over between steps (the first filter layer of every sparse step chooses the set
    before a sparse layer reads it), so a sparse step after dense ones selects as if every step had. The default
    reads densely up to 160 MiB of KV per layer in the batch, 40,960 tokens of Llama-3.1-8B. On the H200
    (``benchmarks/results/decode_h200_omnikv_rule.jsonl``) always selecting gave 0.93x ``vanilla``'s step at 16K x 1,
    1.006x at 32K x 1 and 1.07x at 48K x 1 and 16K x 4; with the rule, 0.998x and 1.001x at 16K and 32K x 1.

State (device tensors owned by the runtime, static per row count, mutated in place in decode):
    ``prompt [max_seqs]`` prompt slots of each row (set by the host in prefill), ``selected [max_seqs, width]``
    the current set (``width = budget`` or the block-table capacity with ``ratio``), ``count [max_seqs]``.
    Without eviction, row-local slot ``i`` holds the same token in every layer, so slot ids transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import MethodConfig, MethodConfigError, option
from ..kernels.omnikv_scores import omnikv_scores
from ..kernels.topk_select import topk_select
from ..runtime.contract import LayerContext, SparseMethod
from ..runtime.host import to_device
from ..runtime.memory_oracle import DenseMemoryOracle
from ..runtime.view import Selection, SlotSelection
from .dense_read import DenseReadOfShortBatches, dense_below_option, validate_dense_below
from .read_stats import CountsReads, ReadCounter, copy_rows, grow_rows
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState

DEFAULT_FILTER_LAYERS = (2, 8, 18)
DEFAULT_BUDGET = 2048


@dataclass
class OmniKVConfig(MethodConfig):
    """Options of ``omnikv`` (give ``budget`` or ``ratio``, not both; neither means ``budget=2048``).

    Attributes:
        budget: prompt tokens each sparse layer reads per decode step (plus every decode token).
        ratio: instead of ``budget``, this fraction of each row's prompt (``0 < ratio <= 1``, rounded up).
        filter_layers: observation layers, e.g. ``"2,8,18"`` or ``(2, 8, 18)``; None: 2, 8, 18 clipped to the depth.
        dense_below: decode steps whose batch holds at most this many tokens (summed over its rows) read every slot
            (``methods/dense_read.py``); None: the batch's KV per layer up to 160 MiB; 0: always select.
    """

    budget: int | None = option(None, "prompt tokens selected per decode step (default 2048; or ratio)")
    ratio: float | None = option(None, "fraction of the prompt selected per decode step (or budget)")
    filter_layers: str | tuple[int, ...] | None = option(None, "filter layers, comma-separated (default: "
                                                               "\"2,8,18\", clipped to the depth)")
    dense_below: int | None = dense_below_option()

    def validate(self) -> None:
        if self.budget is not None and self.ratio is not None:
            raise MethodConfigError("omnikv: pass either budget (tokens) or ratio (fraction of the prompt), not both")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise MethodConfigError(f"omnikv: budget must be a positive number of tokens, got {self.budget!r}")
        if self.ratio is not None and not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
            raise MethodConfigError(f"omnikv: ratio must be in (0, 1], got {self.ratio!r}")
        validate_dense_below("omnikv", self.dense_below)
        if self.filter_layers is not None:
            self.filter_layers = _parse_layers(self.filter_layers)

    @property
    def token_budget(self) -> int | None:
        """Tokens selected per row, or None when ``ratio`` sets it per prompt."""
        return None if self.ratio is not None else (self.budget or DEFAULT_BUDGET)


def _parse_layers(value: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    items = value.replace(" ", "").split(",") if isinstance(value, str) else list(value)
    try:
        layers = tuple(int(x) for x in items if x != "")
    except (TypeError, ValueError):
        raise MethodConfigError(f"omnikv: filter_layers must be layer indices like '2,8,18', got {value!r}") from None
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise MethodConfigError(f"omnikv: filter_layers must be distinct layer indices >= 0, got {value!r}")
    return tuple(sorted(layers))


class OmniKVMemoryOracle(DenseMemoryOracle):
    """Full KV (nothing is evicted); the index buffers are a few integers per sequence."""

    def __init__(self, layout: KVLayout, token_budget: int | None) -> None:
        super().__init__(layout)
        self.token_budget = token_budget

    def index_bytes_per_sequence(self, capacity_slots: int) -> int:
        """Selected-slot buffer plus prompt length, selected count and per-layer read counts (int64)."""
        width = capacity_slots if self.token_budget is None else self.token_budget
        return 8 * (width + 2 + self.layout.num_layers)


@register_method
class OmniKVRuntime(CountsReads, DenseReadOfShortBatches, SparseMethod):
    name = "omnikv"
    config_class = OmniKVConfig
    replays_mixed_steps = True  # device-only hooks; per-row buffers sized by the pool (mixed_graphs.py)
    decode_reads_everything = False  # a budget of the context, once it is longer
    reads_pool_across_layers = True

    def __init__(self, config: OmniKVConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        self.config: OmniKVConfig = config
        depth = model.num_layers
        if config.filter_layers is None:
            filters = tuple(f for f in DEFAULT_FILTER_LAYERS if f < depth)
            if not filters:
                raise MethodConfigError(f"omnikv: the model has {depth} layers, fewer than the first default filter "
                                        f"layer ({DEFAULT_FILTER_LAYERS[0]}); pass filter_layers (e.g. '0')")
        else:
            filters = tuple(config.filter_layers)
            if max(filters) >= depth:
                raise MethodConfigError(f"omnikv: filter_layers {','.join(map(str, filters))} out of range for a "
                                        f"{depth}-layer model; use layers 0..{depth - 1}")
        self.filter_layers = frozenset(filters)
        self.sparse_layers = frozenset(layer for layer in range(filters[0] + 1, depth) if layer not in filters)
        self.token_budget = config.token_budget
        self.reads = ReadCounter()
        self.prompt: torch.Tensor | None = None  # [max_seqs] int64
        self.count: torch.Tensor | None = None  # [max_seqs] int64
        self.selected: torch.Tensor | None = None  # [max_seqs, width] int64 row-local slots, -1 padded

    # ---- setup and capacity
    def memory_oracle(self, layout: KVLayout) -> OmniKVMemoryOracle:
        return OmniKVMemoryOracle(layout, self.token_budget)

    def setup(self, manager: CacheManager) -> None:
        self._ensure_buffers(manager)
        self._set_dense_threshold(self.config.dense_below, manager.layout)

    def _capacity(self, manager: CacheManager) -> int:
        return manager.slot_capacity

    def _ensure_buffers(self, manager: CacheManager) -> None:
        rows, device = manager.max_seqs, manager.layout.device
        width = self.token_budget or self._capacity(manager)
        self.prompt = grow_rows(self.prompt, rows, (), torch.int64, device)
        self.count = grow_rows(self.count, rows, (), torch.int64, device)
        self.selected = grow_rows(self.selected, rows, (width,), torch.int64, device, fill=-1)

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        self._ensure_buffers(manager)  # the manager may have grown (rows, block-table width)
        self.reads.prepare(manager, step)
        if step.is_prefill:
            self._set_prompt(manager, step.row_ids)

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        """Loaded KV is the rows' prompt: every resident slot is a candidate, and no set is chosen yet (the first
        filter layer of the next decode step chooses it before any sparse layer reads it)."""
        self._ensure_buffers(manager)
        self._set_prompt(manager, rows)
        self.count[to_device(rows, self.count.device)] = 0

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        super().fork_rows(manager, sources, forks)
        self._ensure_buffers(manager)
        copy_rows([self.prompt, self.count, self.selected], sources, forks)

    def on_truncate(self, manager: CacheManager, rows: list[int]) -> None:
        """Candidates past the new length are gone: clamp the prompt and let the next filter layer choose again."""
        device = self.prompt.device
        index = to_device(rows, device)
        kept = to_device(manager.slot_count_array(rows)[:, 0], device)
        self.prompt[index] = torch.minimum(self.prompt[index], kept)
        self.count[index] = 0

    def _set_prompt(self, manager: CacheManager, rows: list[int]) -> None:
        """Prompt length of ``rows`` = their slots now (host-authoritative; every layer holds the same slots, as
        nothing is evicted), uploaded pinned and non-blocking."""
        device = self.prompt.device
        self.prompt[to_device(rows, device)] = to_device(manager.slot_count_array(rows)[:, 0], device)

    # ---- device hooks
    def _width(self, capacity: int) -> int:
        return capacity if self.token_budget is None else min(self.token_budget, capacity)

    def build_decode_selection(self, ctx: LayerContext) -> Selection:
        if ctx.layer not in self.sparse_layers or ctx.sliding_window > 0 or self.dense_step(ctx):
            return None
        m, rows = ctx.manager, ctx.step.rows
        capacity = self._capacity(m)
        width = self._width(capacity)
        length = m.lengths[rows, m.layer_key(ctx.layer)].long()  # [batch]
        prompt, count = self.prompt[rows], self.count[rows]
        decoded = (length - prompt).clamp(min=0)
        j = torch.arange(capacity, device=length.device)[None, :].expand(length.shape[0], -1)
        chosen = torch.gather(self.selected[rows, :width], 1, j.clamp(max=width - 1))
        tail = prompt[:, None] + j - count[:, None]  # decode slots prompt .. length-1 follow the chosen ones
        slots = torch.where(j < count[:, None], chosen,
                            torch.where(j < (count + decoded)[:, None], tail, torch.full_like(j, -1)))
        H = m.layout.num_kv_heads
        return SlotSelection(slots[:, None, :].expand(-1, H, -1), (count + decoded)[:, None].expand(-1, H))

    def wants_token_max(self, ctx: LayerContext) -> bool:
        return ctx.layer in self.filter_layers and not self.dense_step(ctx)

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        self.reads.record(ctx)

    def on_layer_end(self, ctx: LayerContext) -> None:
        if ctx.step.is_prefill or ctx.layer not in self.filter_layers or self.dense_step(ctx):
            return
        self._observe(ctx)

    def _observe(self, ctx: LayerContext) -> None:
        """Score the row's prompt slots with this layer's decode query and store the top set for later layers."""
        m, rows = ctx.manager, ctx.step.rows
        prompt = self.prompt[rows]
        if ctx.token_max is not None:  # the filter layer's dense attention wrote each slot's logits, max per KV head
            scores = _prompt_scores(ctx.token_max, prompt)
        else:  # an attention path that does not write it (KIVI's, refused for omnikv today): read the keys again
            table = m.block_table[rows, m.layer_key(ctx.layer)]  # [batch, max_pages]
            scores = omnikv_scores(ctx.query[:, :, -1, :], m.k_pool, table, prompt)  # [batch, capacity]
        # The max over query heads spans every rank's heads under tensor parallelism: one set on all ranks.
        scores = self.model.tp.all_reduce(scores, "max")
        if self.token_budget is None:
            count = torch.ceil(prompt.to(torch.float32) * float(self.config.ratio)).long().clamp(max=prompt)
        else:
            count = prompt.clamp(max=self.token_budget)
        width = self._width(scores.shape[1])
        chosen = topk_select(scores[:, None, :], count[:, None], width)[:, 0]  # [batch, width] ascending
        self.selected[rows, :width] = chosen
        self.count[rows] = count

    # ---- statistics
    def tokens_read(self, manager: CacheManager, rows: list[int]) -> dict[int, int] | None:
        return self.reads.collect(manager, rows)


def _prompt_scores(token_max: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``token_max [batch, kv_heads, capacity]`` of a dense view (its entries are the whole block-table row, so
    position = row-local slot) -> ``[batch, capacity]`` scores as ``omnikv_scores`` gives them: the max over every
    query head, ``-inf`` past the prompt."""
    scores = token_max.amax(1)
    candidate = torch.arange(scores.shape[1], device=scores.device)[None, :] < prompt[:, None]
    return torch.where(candidate, scores, torch.full_like(scores, float("-inf")))
