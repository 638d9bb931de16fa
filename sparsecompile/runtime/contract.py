"""The method contract: what a sparse method implements (:class:`SparseMethod`) and what its hooks see.

Lifecycle of one model forward (a prefill chunk or a decode step), driven by the SparseController::

    host:   controller grows slot counts by the new tokens -> (decode) method.decode_variant -> method.prepare_step
            -> CacheManager.flush
    for each layer (device, traceable):
            CacheManager.write(new K/V) -> method.build_{prefill,decode}_selection
            -> CacheManager.build_view -> attention op -> method.on_attention_end -> method.on_layer_end
    device: method.finish_step            (compaction, eviction: inside the compiled decode graph)
    host:   method.commit_step            (slot counts after eviction; frees pages)

Device hooks must not synchronise with the host (no ``.item()``, no data-dependent Python branches):
in decode they run inside one compiled (and on CUDA, graph-replayed) step. Host hooks may.

The contract lives in the KV core (floor 1) because the controller drives it; methods (floor 2) implement it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from ..config import MethodConfig
from .memory_oracle import DenseMemoryOracle, MemoryOracle
from .model_info import ModelInfo
from .view import Selection

if TYPE_CHECKING:
    from .cache_manager import CacheManager, KVLayout
    from .kivi_spec import KiviSpec
    from .step import StepState
    from .view import AttentionView


class PrefillMode(str, enum.Enum):
    """How prompts are fed to a method (the scheduler and ``generate()`` follow it).

    CHUNKED: chunks of any size. ALIGNED: chunks of exactly the engine's ``prefill_chunk_size`` (the last one
    shorter), for methods whose result depends on where chunks end (H2O's chunk-wise eviction), so the serving
    engine feeds the same chunks as ``generate()``. WHOLE: one forward per prompt.
    """

    CHUNKED = "chunked"
    ALIGNED = "aligned"
    WHOLE = "whole"


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
        lse: ``[batch, q_heads, tokens]`` fp32 log-sum-exp of each query's scaled logits over the view, for
            scoring without a second normaliser pass (set when the method declares ``uses_*_lse``).
        token_max: decode only, when :meth:`SparseMethod.wants_token_max` says so for the layer:
            ``[batch, kv_heads, view positions]`` fp32, per view position the largest raw logit ``q . k`` over the
            KV head's query heads, ``-inf`` past the view's lengths (the attention kernel's by-product).
        logits: decode only, for a method that declares ``uses_decode_logits``: ``[batch, q_heads, view positions]``
            fp32, each query's scaled logit per view position, ``-inf`` where it does not see the slot, so that
            ``exp(logits - lse)`` are the attention's probabilities (the attention kernel's by-product, with ``lse``).
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
    lse: torch.Tensor | None = None
    token_max: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Scorer(Protocol):
    """What a scoring pass runs at every layer (``SparseController.score_pass``), in place of the method's hooks."""

    def on_attention_end(self, ctx: LayerContext, out: torch.Tensor) -> None:
        """``ctx.query``: the pass's queries; ``ctx.view``: every resident slot plus the pass's temporary ones."""


@dataclass
class ScoringPass:
    """Extra forwards a method asks for once prompts end (KVzip's context reconstruction): ``token_ids[i]`` is fed
    to ``rows[i]`` at positions ``first_positions[i]`` onwards, after everything resident; the tokens' KV lives in
    temporary slots that are dropped after the forward, and ``scorer`` sees every layer."""

    rows: list[int]
    token_ids: list[list[int]]
    first_positions: list[int]
    scorer: Scorer


class SparseMethod:
    """Hooks of one method. The default implementation is dense attention over every resident slot."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    #: How the scheduler and ``generate()`` feed prompts (checked when the method registers).
    prefill_mode: ClassVar[PrefillMode] = PrefillMode.CHUNKED
    #: False only for dense attention, which can also run through the SDPA-rewrite fallback (no cache access).
    needs_cache_access: ClassVar[bool] = True
    #: A layer reads pool state that a later op mutates (OmniKV scores the filter layer's keys for later layers; KIVI's
    #: commit quantizes into the pages the layer's attention read): the compiled decode keeps the graph in lifecycle
    #: order so that those mutations stay in place (reordered, each one copied the whole pool tensor).
    reads_pool_across_layers: ClassVar[bool] = False
    #: Attributes holding one step's plan from ``prepare_step`` to ``commit_step`` (reassigned each step, never mutated
    #: in place). The serving engine runs a step's decode tokens and its prompt-chunk groups, each a step of its own, in
    #: one forward (``SparseController.mixed``): the controller swaps these in and out around each step's hooks.
    step_scoped: ClassVar[tuple[str, ...]] = ()
    #: Prompt tokens per prefill forward when the engine option is not set (0: the whole prompt, the fastest on the
    #: H200 for methods that hold the whole prompt anyway: README "Prefill"); chunk-wise eviction sets its chunk.
    default_prefill_chunk: ClassVar[int] = 0
    #: Prefill / decode hooks read ``LayerContext.lse`` (the attention's log-sum-exp); others let the kernels skip it.
    uses_prefill_lse: ClassVar[bool] = False
    uses_decode_lse: ClassVar[bool] = False
    #: Decode hooks also read ``LayerContext.logits``: the attention writes every query's logits beside its output
    #: (16 bytes a KV-head slot for a group of four, against the key's 256 for a method that re-reads the keys).
    uses_decode_logits: ClassVar[bool] = False
    #: Every token stays resident in order (nothing is evicted): such a cache can be cropped back to any length
    #: and its full pages can be shared through the prefix cache.
    keeps_all_tokens: ClassVar[bool] = True
    #: Decode steps attend to every resident token (dense attention). Budgeted selection (Quest, OmniKV) sets False;
    #: with :attr:`keeps_all_tokens` and :attr:`storage` it decides :attr:`recomputes_by_prefill`.
    decode_reads_everything: ClassVar[bool] = True
    #: The controller gives ``prepare_step`` each prefill row's token ids (``StepState.prompt_tokens``; one host copy
    #: of the chunk's ids per prefill forward), for methods that re-read the prompt.
    needs_prompt_tokens: ClassVar[bool] = False
    #: How the CacheManager stores this method's K/V: None (dense, the model's dtype) or a
    #: ``runtime.kivi_spec.KiviSpec`` (quantized pages; set per instance from the options of ``kivi`` and its
    #: compositions, ``methods/kivi.py``).
    storage: KiviSpec | None = None
    #: The variants of this method's decode step, chosen per step on the host by :meth:`decode_variant` and read by
    #: the device hooks as ``ctx.step.variant`` (static in a graph: a compiled step keeps one graph per batch size
    #: and variant). The first is the default, the one exported and precompiled decode programs trace and run.
    decode_variants: ClassVar[tuple[str, ...]] = ("",)
    #: The serving engine may record a mixed step (decodes and prompt chunks in one forward) once per shape as a CUDA
    #: graph and replay it (``runtime/mixed_graphs.py``): every hook inside the forward and ``finish_step`` is
    #: device-only and reads nothing per step but the StepState's tensors and the pool (``prepare_step`` keeps no
    #: per-step tensors for them), and a step's host hooks do not depend on what its forward computed.
    replays_mixed_steps: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, model: ModelInfo) -> None:
        self.config = config
        self.model = model

    @property
    def recomputes_by_prefill(self) -> bool:
        """Whether a preempted request's prompt + output prefilled again as one prompt rebuilds the state its decode
        steps built: only when they attended to every token, kept every token and stored it in the model's dtype.
        Otherwise (eviction compresses the recomputed prefix as a prompt, a budgeted read or quantized storage made
        the output tokens' K/V from other inputs, and the prefill's peak can exceed what the request ever held) the
        serving engine re-prefills the prompt alone and replays the output as decode steps."""
        return self.decode_reads_everything and self.keeps_all_tokens and self.storage is None

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

    def rewrites_resident(self, manager: CacheManager, step: StepState) -> np.ndarray:
        """Host, after ``prepare_step``: ``[batch]`` bool, the rows whose resident slots this step writes (score
        accumulation, eviction, compaction) and not only the new tokens' slots; shared pages of those rows are
        copied first (copy-on-write: ``runtime/page_sharing.py``)."""
        return np.zeros(len(step.row_ids), dtype=bool)

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        """``forks[i]`` now holds the pages of ``sources[i]``: copy per-row method state (host and device)."""

    def release_rows(self, manager: CacheManager, rows: list[int]) -> None:
        """``rows`` were freed (finished, aborted or preempted, possibly between two chunks of a prompt): forget their
        per-row host state. Row ids are reused, and a fork that lands on one continues with its source's state only,
        so state a freed row kept would become a later sequence's."""

    def on_truncate(self, manager: CacheManager, rows: list[int]) -> None:
        """``rows`` were cropped to fewer slots (only for ``keeps_all_tokens`` methods): fix per-row state and
        metadata that covered the removed slots."""

    def scoring_passes(self, manager: CacheManager, rows: list[int]) -> list[ScoringPass]:
        """Host, once the prompts of ``rows`` ended (their last chunk's step is committed): extra forwards to run now,
        in order (:class:`ScoringPass`); :meth:`scoring_done` follows when there were any."""
        return []

    def scoring_done(self, manager: CacheManager, rows: list[int]) -> None:
        """Host, after the scoring passes of ``rows`` ran (e.g. evict with the scores they left)."""

    def on_kv_loaded(self, manager: CacheManager, rows: list[int], prompt_lengths: list[int]) -> None:
        """KV reached the pool without a prefill through this method (a KV import, a synthetic benchmark
        fill): rebuild method metadata and state from the resident slots (host; may run device ops)."""

    def decode_variant(self, manager: CacheManager, step: StepState) -> str:
        """Host, before :meth:`prepare_step` of a decode step (slot counts already include the new tokens): which of
        :attr:`decode_variants` it runs. No device data: the answer comes from host bookkeeping, never a sync."""
        return self.decode_variants[0]

    # ---- device hooks (traceable)
    def build_prefill_selection(self, ctx: LayerContext) -> Selection:
        return None

    def build_decode_selection(self, ctx: LayerContext) -> Selection:
        return None

    def decode_slot_bound(self) -> int | None:
        """Decode steps: no row holds more slots than this in any layer when its attention runs (None: no bound).
        Decode views are cut to it: the block table is as wide as the prefill's peak (before its eviction), and the
        kernels launched over its width (the attention's splits, H2O's mass pass) would otherwise spread over
        entries no row uses. A wrong bound drops keys silently: only a method whose decode eviction enforces it
        may give one."""
        return None

    def wants_token_max(self, ctx: LayerContext) -> bool:
        """Decode, after the selection: this layer's hooks read ``ctx.token_max`` (a static per-layer answer; the
        attention kernel writes it beside its output, instead of the method reading the keys a second time). Such a
        layer gets no decode ``ctx.lse``: a method needs one or the other."""
        return False

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
