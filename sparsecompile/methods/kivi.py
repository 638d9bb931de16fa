"""``kivi``: KV cache quantization (Liu et al., https://arxiv.org/abs/2402.02750), and its compositions.

KIVI is a *storage format*, not a retention policy: which tokens stay is the policy's decision, how they are stored
is the CacheManager's (``runtime/kivi.py``: ``bits``-bit codes, keys per channel over groups of ``group_size``
slots, values per token over groups of ``group_size`` channels, the newest ``residual`` tokens in full precision,
quantized a group at a time as they age). Methods never see codes: their hooks read full-precision views.

* ``method="kivi"``: every token stays (the ``vanilla`` policy) in KIVI storage.
* ``method="<policy>+kivi"`` (parsed by ``registry.py``): the policy decides what stays, KIVI how it is stored; the
  options of both are accepted (``budget=2048, bits=2``). Accepted policies: those that move resident tokens only
  when a prompt ends, then only append (``snapkv``, ``pyramidkv``), a sliding window (``streamingllm``), which
  over KIVI pages slides a page at a time (``kivi_window.py``), a policy that evicts the lowest-scoring token
  during decode, scored from the attention's logits (``h2o``), which over KIVI evicts a whole key group per KV head
  at a time (``kivi_heavy.py``), and a policy that compacts after scoring passes over the prompt (``kvzip``), whose
  prompt stays in full precision until then (:class:`ScoredPromptMixin`), and a policy that selects the pages decode
  reads by their key bounds (``quest``), which over KIVI pages are the key groups' own ranges (``kivi_select.py``).

How eviction stays correct over quantized storage (we chose "quantize only tokens that will never move again"):
a KIVI key group is quantized per channel over consecutive slots, so moving one token in or out of a quantized group
would re-quantize the group (and, repeated, compound the error). A composed policy's prompt is therefore prefilled in
one forward (``PrefillMode.WHOLE``) whose slots stay in full precision until the policy's compaction has run; only
the kept tokens are then quantized, once, and decode appends to the residual; a sliding window drops whole pages
from the front of its unpinned tokens (the block table shifts, the ring turns; ``kivi_window.py``); H2O's decode
evicts whole quantized key groups, moved as stored (``kivi_heavy.py``); KVzip's prompt is held in full precision
through its scoring passes (``KiviStorage.hold``) and quantized after its compaction; Quest moves nothing and picks
pages from the quantized keys' ranges. A selection method that scores keys through its own kernel (``omnikv``) is
refused with the reason (:func:`kivi_refusal`), as is any other policy that would move single quantized tokens.

Defaults follow KIVI's LongBench setting (group 32, residual 128, 2 bits; KIVI recommends 4 bits for GQA models);
HF's ``QuantizedCache`` calls them ``nbits``, ``q_group_size`` and ``residual_length``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..config import MethodConfig, MethodConfigError, option
from ..runtime.contract import PrefillMode, SparseMethod
from ..runtime.kivi_spec import KiviSpec
from ..runtime.memory_oracle import MemoryOracle
from .eviction import EvictionRuntime
from .kivi_heavy import GroupEvictionMixin, HeldChunksMixin, evicts_by_group
from .kivi_select import KeyBoundsOverQuantizedPages
from .kivi_window import PageWindowMixin
from .registry import register_format, register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.model_info import ModelInfo
    from ..runtime.step import StepState

_SCALE_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class KiviConfig(MethodConfig):
    """Options of the ``kivi`` storage format (also accepted by every ``<policy>+kivi``)."""

    bits: int = option(2, "bits per quantized key / value code: 2 or 4 (HF QuantizedCache: nbits)")
    group_size: int = option(32, "KIVI group: keys share a scale and zero per channel over group_size consecutive "
                                 "tokens, values per token over group_size channels; a power of two (HF: q_group_size)")
    residual: int = option(128, "newest tokens kept in full precision, a multiple of group_size; older ones are "
                                "quantized a group at a time (HF: residual_length)")
    scale_dtype: str = option("auto", "dtype of the per-group scales and zero points: auto (the model's dtype if "
                                      "float16 or bfloat16, else float16), float16 or bfloat16")

    method: ClassVar[str] = "kivi"

    def validate(self) -> None:
        m = self.method
        if self.bits not in (2, 4) or isinstance(self.bits, bool):
            raise MethodConfigError(f"{m}: bits must be 2 or 4, got {self.bits!r}")
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1):
            raise MethodConfigError(f"{m}: group_size must be a positive power of two (pages hold whole key groups), "
                                    f"got {g!r}")
        r = self.residual
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % g:
            raise MethodConfigError(f"{m}: residual must be a multiple of group_size={g} (>= 0: the residual hands "
                                    f"whole groups to the quantized pages), got {r!r}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise MethodConfigError(f"{m}: scale_dtype must be 'auto', 'float16' or 'bfloat16', "
                                    f"got {self.scale_dtype!r}")

    def kivi_spec(self) -> KiviSpec:
        return KiviSpec(self.bits, self.group_size, self.residual, _SCALE_DTYPES[self.scale_dtype])


def check_geometry(method: str, spec: KiviSpec, model: ModelInfo) -> None:
    """Value groups run over channels and codes pack into 32-bit words: both must divide the head dimension."""
    dim = model.head_dim
    if dim % spec.group_size:
        raise MethodConfigError(f"{method}: group_size={spec.group_size} must divide the head dimension ({dim}): "
                                f"values are quantized per token over groups of group_size channels; pass a "
                                f"group_size that divides {dim}")
    if dim * spec.bits % 32:
        raise MethodConfigError(f"{method}: head dimension {dim} x {spec.bits} bits is not a whole number of 32-bit "
                                "words")


class KiviMemoryOracle(MemoryOracle):
    """The policy's slots and pages (a KIVI page holds as many slots as a dense one, in fewer bytes: the pool is sized
    with ``CacheManager.bytes_per_page``), plus the exact K/V bytes of those slots (:meth:`kv_bytes`)."""

    def __init__(self, base: MemoryOracle, layout: KVLayout, spec: KiviSpec, prompt_copies: int = 0) -> None:
        super().__init__(layout)
        self.base, self.spec, self.prompt_copies = base, spec, prompt_copies

    @property
    def prefill_chunk(self) -> int | None:  # the controller sets it; the policy's oracle reads it
        return self.base.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value: int | None) -> None:
        self.base.prefill_chunk = value

    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        return self.base.peak_slots_per_layer(prompt_len, max_new_tokens)

    def resident_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return self.base.resident_slots_per_layer(prompt_len, generated)

    def held_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return self.base.held_slots_per_layer(prompt_len, generated)

    # a resumed row (a chain continuation) and every prompt's rows once its slots are measured (serving): the
    # policy's formulas, which know its decode eviction and its re-read's extra tokens
    def resumed_peak_slots(self, resident: list[int], prompt_len: int, suffix: int) -> list[int]:
        return self.base.resumed_peak_slots(resident, prompt_len, suffix)

    def resumed_resident_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return self.base.resumed_resident_slots(after_prompt, prompt_len, generated)

    def resumed_held_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return self.base.resumed_held_slots(after_prompt, prompt_len, generated)

    def prompt_buffer_bytes(self, prompt_len: int) -> int:
        """A composition's full-precision prompt buffers (``KiviStorage._materialize``: every layer's K and V of the
        row's slots at the policy's prefill peak, padded to pages plus a trash slot, in the model's dtype), kept until
        the step that compacts the prompt ends (``commit_deferred``), ``prompt_copies`` of them at once (KVzip: the
        held prompt and a scoring pass's buffer; H2O: the held chunks and the next chunk's)."""
        lay, P = self.layout, self.layout.page_size
        per_slot = 2 * lay.num_kv_heads * lay.head_dim * lay.dtype.itemsize
        peak = self.base.peak_slots_per_layer(prompt_len, 0)
        return self.prompt_copies * sum((-(-int(s) // P) * P + 1) * per_slot for s in peak)

    def kv_bytes(self, slots_per_layer: list[int]) -> int:
        """Codes, scales, zeros and full-precision residual of these slot counts, all KV heads (positions and the
        ring's unused capacity not counted: ``CacheManager.bytes_per_row`` is the ring)."""
        lay = self.layout
        return sum(lay.num_kv_heads * self.spec.slot_bytes(lay.head_dim, lay.dtype, s) for s in slots_per_layer)

    def resident_bytes(self, prompt_len: int, generated: int) -> int:
        return self.kv_bytes(self.resident_slots_per_layer(prompt_len, generated))


class KiviStorageMixin:
    """The storage-format half of ``kivi`` and ``<policy>+kivi``: sets the CacheManager's format, announces steps
    whose policy moves resident slots, and has them quantized after the policy's compaction."""

    storage_format: ClassVar[str] = "kivi"
    keeps_all_tokens = False  # a crop would have to un-quantize: refused like eviction methods' (controller)
    #: Full-precision copies of the prompt kept outside the pool at once until the policy has compacted it (the
    #: oracle's ``prompt_buffer_bytes``); ``kivi`` alone quantizes each layer as it goes.
    prompt_copies: ClassVar[int] = 1
    needs_cache_access = True
    # A layer's commit quantizes into the pages its attention just read: with inductor's locality reordering the read
    # sank past the write, which then copied every page tensor once per layer: lifecycle order keeps the commit in
    # place (decode steps at 128K x 4 on the H200: 230 ms before, 30 ms after).
    reads_pool_across_layers = True
    #: Every token stays, in order (``kivi`` alone, ``quest+kivi``): each list's quantized slots are its oldest
    #: tokens, none of them empty (:attr:`.KiviSpec.dense_history`, which lets decode skip their positions).
    dense_history: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, model: ModelInfo) -> None:
        super().__init__(config, model)
        self.storage = replace(config.kivi_spec(), dense_history=self.dense_history)
        check_geometry(self.name, self.storage, model)

    def memory_oracle(self, layout: KVLayout) -> MemoryOracle:
        return KiviMemoryOracle(super().memory_oracle(layout), layout, self.storage, self.prompt_copies)

    def prepare_step(self, manager: CacheManager, step: StepState) -> None:
        super().prepare_step(manager, step)
        manager.storage.begin_step(step, defer=self.defers_step(manager, step))

    def defers_step(self, manager: CacheManager, step: StepState) -> bool:
        """This step's slots stay in full precision until the policy has moved them (its compaction)."""
        return bool(np.any(self.rewrites_resident(manager, step)))

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        super().commit_step(manager, step)  # the policy truncates to what it kept
        self.finish_deferred(manager, step)

    def finish_deferred(self, manager: CacheManager, step: StepState) -> None:
        manager.storage.commit_deferred(step)


class ScoredPromptMixin:
    """``<policy>+kivi`` for a policy that compacts a prompt after scoring passes over it (``kvzip``: its
    re-read, then ``scoring_done``): the prompt's step is deferred and its full-precision buffers are held past it
    (``KiviStorage.hold``), the passes read the prompt from them, the compaction moves entries in them, and only
    then are the kept entries quantized, once (``release_held``; at once for prompts that fit the budget and are not
    re-read). Placed before :class:`KiviStorageMixin` in the composed class."""

    prompt_copies = 2  # the held prompt, and a scoring pass's own buffer beside it

    def defers_step(self, manager: CacheManager, step: StepState) -> bool:
        return super().defers_step(manager, step) or bool(step.is_prefill and np.any(step.ends_prompt))

    def finish_deferred(self, manager: CacheManager, step: StepState) -> None:
        manager.storage.hold()

    def scoring_passes(self, manager: CacheManager, rows: list[int]):
        passes = super().scoring_passes(manager, rows)
        scored = {row for p in passes for row in p.rows}
        manager.storage.release_held([r for r in rows if r not in scored])  # kept whole: nothing to wait for
        return passes

    def scoring_done(self, manager: CacheManager, rows: list[int]) -> None:
        super().scoring_done(manager, rows)  # the compaction, in the held buffers
        manager.storage.release_held(rows)


@register_method
class KiviRuntime(KiviStorageMixin, SparseMethod):
    """``kivi``: every token stays, stored as KIVI pages plus the full-precision residual."""

    name = "kivi"
    config_class = KiviConfig
    prompt_copies = 0
    #: a prompt chunk reads the groups that earlier chunks left quantized, so where chunks end changes what it reads:
    #: the serving engine feeds generate()'s chunks whatever else is batched
    prefill_mode = PrefillMode.ALIGNED
    dense_history = True  # every token stays


# ---------------------------------------------------------------------------------------------------- composition
def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(base, name)


def kivi_refusal(policy: type[SparseMethod]) -> str | None:
    """Why ``policy`` cannot be stored as KIVI (None: it can); capabilities, not names, decide."""
    if getattr(policy, "storage_format", None):
        return f"{policy.name} already stores its KV as {policy.storage_format}; compose a retention policy with kivi"
    if getattr(policy, "selects_by_key_bounds", False):  # page bounds from the key groups' ranges (kivi_select.py)
        return None
    if (_overrides(policy, SparseMethod, "build_decode_selection") or _overrides(policy, SparseMethod,
                                                                                 "build_prefill_selection")
            or policy.reads_pool_across_layers):
        return (f"{policy.name} selects tokens to read by scoring the dense pool's keys; over quantized pages that "
                f"would need a KIVI-aware scoring kernel, which does not exist yet (page selection by key bounds "
                f"does: quest+kivi). Use {policy.name} alone, or kivi alone")
    if evicts_by_group(policy):  # decode evicts key groups; scores from the KIVI kernel's logits (kivi_heavy.py)
        return None
    if issubclass(policy, EvictionRuntime) and (policy.chunk_eviction  # (decode_interval: evicts during decode)
                                                or (_overrides(policy, EvictionRuntime, "decode_interval")
                                                    and not policy.window_pages)):
        return (f"{policy.name} evicts resident tokens during decode (evict-and-fill moves the newest token into each "
                f"hole{', and it evicts after every prefill chunk' if policy.chunk_eviction else ''}); KIVI quantizes "
                f"keys per channel over groups of consecutive slots and keeps the newest tokens in full precision, so "
                f"every eviction would re-quantize a key group around the newest token and compound the error. "
                f"Compose a policy that evicts once, after the prompt (snapkv+kivi, pyramidkv+kivi), a sliding "
                f"window (streamingllm+kivi), or one scored from the decode attention's logits, which evicts whole "
                f"key groups (h2o+kivi), or use {policy.name} alone")
    if policy.uses_decode_lse or policy.uses_prefill_lse:
        return f"{policy.name} scores by re-reading every resident key, which KIVI pages do not offer in full precision"
    if policy.needs_prompt_tokens and not getattr(policy, "compacts_after_scoring", False):
        return (f"{policy.name} scores in extra passes that re-read the prompt over the resident keys, which KIVI "
                f"pages do not offer in full precision. Use {policy.name} alone, or snapkv+kivi")
    return None


def compose_kivi(policy: type[SparseMethod]) -> type[SparseMethod]:
    """``<policy>+kivi``: a runtime class that is ``policy`` with KIVI storage, and a config with both option sets."""
    name = f"{policy.name}+kivi"
    reason = kivi_refusal(policy)
    if reason:
        raise MethodConfigError(f"{name}: {reason}")
    base = policy.config_class
    clash = sorted(set(base.option_names()) & set(KiviConfig.option_names()))
    if clash:
        raise MethodConfigError(f"{name}: {policy.name} and kivi both declare option(s) {', '.join(clash)}")

    def validate(self) -> None:
        KiviConfig.validate(self)
        base.validate(self)

    config = dataclass(type(f"{base.__name__}Kivi", (KiviConfig, base), {
        "__doc__": f"Options of ``{name}``: {policy.name}'s and kivi's.", "__module__": __name__,
        "__annotations__": {}, "method": name, "validate": validate}))
    # A policy that moves resident slots does it after a prompt: one forward per prompt keeps those slots in full
    # precision until the compaction (module docstring).
    # (a policy that evicts key groups keeps its own chunks: its prompt stays held in full precision between them)
    mode = policy.prefill_mode if policy.keeps_all_tokens or evicts_by_group(policy) else PrefillMode.WHOLE
    if mode is PrefillMode.CHUNKED:  # as kivi alone (KiviRuntime.prefill_mode)
        mode = PrefillMode.ALIGNED
    bases: tuple[type, ...] = (KiviStorageMixin, policy)
    if getattr(policy, "window_pages", False):  # a sliding window slides a page at a time (kivi_window.py)
        bases = (KiviStorageMixin, PageWindowMixin, policy)
    elif evicts_by_group(policy):  # decode evicts whole quantized key groups (kivi_heavy.py)
        bases = (HeldChunksMixin, KiviStorageMixin, GroupEvictionMixin, policy)
    elif getattr(policy, "compacts_after_scoring", False):  # its prompt held in full precision until the compaction
        bases = (ScoredPromptMixin, KiviStorageMixin, policy)
    elif getattr(policy, "selects_by_key_bounds", False):  # pages chosen by the key groups' ranges (kivi_select.py)
        bases = (KeyBoundsOverQuantizedPages, KiviStorageMixin, policy)
    return type(f"{policy.__name__}Kivi", bases, {
        "__doc__": f"``{name}``: {policy.name} decides which tokens stay, KIVI stores them.", "__module__": __name__,
        "name": name, "config_class": config, "prefill_mode": mode})


register_format("kivi", compose_kivi, kivi_refusal)

__all__ = ["KiviConfig", "KiviMemoryOracle", "KiviRuntime", "compose_kivi", "kivi_refusal"]
