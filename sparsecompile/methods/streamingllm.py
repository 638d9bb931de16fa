"""``streamingllm``: attention sinks plus the most recent tokens (Xiao et al., https://arxiv.org/abs/2309.17453).

Each layer keeps ``sinks`` first tokens and the ``budget - sinks`` most recent ones. The prompt is
attended densely and compacted after its last chunk (KVCache-Factory / kvpress); during decode a
layer holding ``budget + 1`` slots drops its oldest non-sink token after the step, like
``StartRecentKVCache`` (between steps a layer holds ``budget`` tokens; a step attends over them plus
its new token). Where the references disagree (methods.md §5) we keep the *original* positions, as
KVCache-Factory and kvpress do, not streaming-llm's ``pos_shift`` re-rotation.

The sinks are the first ``sinks`` row-local slots: the prompt is written in order and compaction
and decode eviction never move a kept slot below the kept count, so they stay there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import MethodConfigError, option
from .eviction import POSITIONS, EvictionConfig, EvictionRuntime
from .eviction_ops import INF, resident
from .registry import register_method

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager
    from ..runtime.step import StepState


@dataclass
class StreamingLLMConfig(EvictionConfig):
    """Options of ``streamingllm``.

    Attributes:
        budget / ratio: tokens kept per layer (sinks included) / fraction of the prompt kept (exactly one).
        sinks: first tokens always kept (attention sinks).
    """

    sinks: int = option(4, "first tokens always kept (attention sinks)")

    method = "streamingllm"

    def protected(self) -> tuple[int, str]:
        return self.sinks + 1, f"sinks + 1 = {self.sinks + 1} (the {self.sinks} sinks and at least one recent token)"

    def validate(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise MethodConfigError(f"streamingllm: sinks must be an integer >= 0, got {self.sinks!r}")
        super().validate()


@register_method
class StreamingLLMRuntime(EvictionRuntime):
    name = "streamingllm"
    config_class = StreamingLLMConfig
    config: StreamingLLMConfig

    victim_values = POSITIONS  # decode: the oldest token past the sinks, one op per layer
    window_pages = True  # so streamingllm+kivi slides a page at a time (methods/kivi_window.py)

    @property
    def decode_interval(self) -> int:
        return 1

    def protected_slots(self) -> int:
        return self.config.sinks

    def _scores(self, pos: torch.Tensor) -> torch.Tensor:
        slot = torch.arange(pos.shape[-1], device=pos.device)
        return torch.where(slot < self.config.sinks, INF, pos.float())

    def prefill_scores(self, manager: CacheManager, step: StepState, layer: int, width: int) -> torch.Tensor:
        return self._scores(resident(manager, layer, step.rows, width)[2])
