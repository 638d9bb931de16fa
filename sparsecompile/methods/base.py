"""The method contract: a validated config dataclass plus a SparseMethodRuntime of lifecycle hooks.

Lifecycle of one model forward (a prefill chunk or a decode step), driven by the SparseController::

    host:   controller grows slot counts by the new tokens -> runtime.prepare_step -> CacheManager.flush
    for each layer (device, traceable):
            CacheManager.write(new K/V) -> runtime.build_{prefill,decode}_selection
            -> CacheManager.build_view -> attention op -> runtime.on_attention_end -> runtime.on_layer_end
    device: runtime.finish_step            (compaction, eviction: inside the compiled decode graph)
    host:   runtime.commit_step            (slot counts after eviction; frees pages)

Device hooks must not synchronise with the host (no ``.item()``, no data-dependent Python branches):
in decode they run inside one compiled (and on CUDA, graph-replayed) step. Host hooks may.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..runtime.memory_oracle import DenseMemoryOracle, MemoryOracle
from ..runtime.view import Selection

if TYPE_CHECKING:
    from ..models.support import ModelInfo
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.step import StepState
    from ..runtime.view import AttentionView


class MethodConfigError(ValueError):
    """A method option is unknown or out of range; the message says what to change."""


@dataclass
class MethodConfig:
    """Base of every method config; subclasses add fields and validate them in ``validate``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`MethodConfigError` for out-of-range options."""

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, method: str, options: dict[str, Any]) -> MethodConfig:
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            valid = ", ".join(cls.option_names()) or "(none)"
            raise MethodConfigError(f"unknown option(s) {', '.join(unknown)} for method {method!r}; "
                                    f"valid options: {valid}")
        return cls(**options)


@dataclass
class LayerContext:
    """What the per-layer hooks see.

    Attributes:
        layer: layer index.
        step: the step's :class:`StepState`.
        manager: the :class:`CacheManager`.
        query: ``[batch, q_heads, tokens, head_dim]`` (RoPE applied).
        key, value: ``[batch, kv_heads, tokens, head_dim]`` of the new tokens.
        new_slots: ``[batch, tokens]`` global slot ids the new tokens were written to (-1 = padding).
        scale: softmax scale; sliding_window: 0 or the layer's window.
        view: the AttentionView read by this layer (set before ``on_attention_end``).
    """

    layer: int
    step: StepState
    manager: CacheManager
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    new_slots: torch.Tensor
    scale: float
    sliding_window: int
    view: AttentionView | None = None


class SparseMethodRuntime:
    """Hooks of one method. The default implementation is dense attention over every resident slot."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    #: How the scheduler feeds prompts: "chunked" (chunks of any size), "aligned" (chunks of exactly the engine's
    #: ``prefill_chunk_size``, when the method's result depends on where chunks end, like H2O's chunk-wise
    #: eviction) or "whole" (one forward per prompt).
    prefill_mode: ClassVar[str] = "chunked"
    #: False only for dense attention, which can also run through the SDPA-rewrite fallback (no cache access).
    needs_cache_access: ClassVar[bool] = True
    #: A layer reads pool state that a later layer's op mutates (OmniKV scores the filter layer's keys for later
    #: layers): the compiled decode keeps the graph in lifecycle order so that those mutations stay in place.
    reads_pool_across_layers: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, model: ModelInfo) -> None:
        self.config = config
        self.model = model

    # ---- setup and capacity
    def setup(self, manager: CacheManager) -> None:
        """Register slot / page metadata with a freshly created CacheManager."""

    def memory_oracle(self, layout: KVLayout) -> MemoryOracle:
        return DenseMemoryOracle(layout)

    # ---- host hooks
    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        """Before the forward, after the controller made room for the new tokens (host)."""

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        """After the forward: shrink slot counts that ``finish_step`` evicted (host; frees pages)."""

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        """KV reached the pool without a prefill through this runtime (a KV import, a synthetic benchmark
        fill): rebuild method metadata and state from the resident slots (host; may run device ops)."""

    # ---- device hooks (traceable)
    def build_prefill_selection(self, ctx: LayerContext) -> Selection:
        return None

    def build_decode_selection(self, ctx: LayerContext) -> Selection:
        return None

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        """``out [batch, tokens, q_heads, head_dim]``: this layer's attention output."""

    def on_layer_end(self, ctx: LayerContext) -> None:
        """Cross-layer state (OmniKV / DeltaKV indices) after the layer's attention."""

    def finish_step(self, manager: CacheManager, step: StepState) -> None:
        """End of the forward, before its outputs are used (compaction, eviction)."""

    # ---- statistics
    def tokens_read(self, manager: CacheManager, rows: list[int]) -> dict[int, int] | None:
        """Slots the last decode step read per layer (None: the same as resident)."""
        return None
