"""Capacity of one sequence under an eviction method (the MemoryOracle the scheduler admits by): prefill holds the
prompt (or, with chunk-wise eviction, the budget plus one chunk), then each layer keeps its budget and decode appends
or cycles between ``budget`` and ``budget + interval``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..runtime.memory_oracle import MemoryOracle

if TYPE_CHECKING:
    from ..runtime.cache_manager import KVLayout


class EvictionMemoryOracle(MemoryOracle):
    """Slots per layer of one sequence under an eviction method.

    Prefill holds the prompt transiently: all of it, or with chunk-wise eviction at most the budget plus one
    chunk (set ``prefill_chunk`` when the scheduler knows its chunk size; None = one forward per prompt).
    After the prompt a layer keeps ``kept(n)[layer]`` slots. Decode then appends (``decode_budget`` None) or
    grows to ``budget + interval`` slots and drops back to ``budget``, keeping the pages of ``budget + interval``
    slots from its first decode eviction on (it takes those slots back before the next one).
    """

    def __init__(self, layout: KVLayout, kept: Callable[[int], list[int]],
                 decode_budget: Callable[[int], int] | None = None, interval: int = 1, chunk_eviction: bool = False,
                 prefill_chunk: int | None = None) -> None:
        super().__init__(layout)
        self.kept, self.decode_budget, self.interval = kept, decode_budget, interval
        self.chunk_eviction, self.prefill_chunk = chunk_eviction, prefill_chunk

    def _after(self, prompt_len: int, kept: int, generated: int, transient: bool) -> int:
        """Slots after ``generated`` decode steps (``transient``: the most any of them held before its eviction)."""
        total = kept + generated
        if self.decode_budget is None:
            return total
        budget = self.decode_budget(prompt_len)
        if total < budget + self.interval:
            return total
        return budget + self.interval if transient else budget + (total - budget) % self.interval

    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        peaks = []
        for kept in self.kept(prompt_len):
            prefill = prompt_len
            if self.chunk_eviction and self.prefill_chunk:
                prefill = min(prompt_len, kept + self.prefill_chunk)
            peaks.append(max(prefill, self._after(prompt_len, kept, max_new_tokens, transient=True)))
        return peaks

    def resident_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return [self._after(prompt_len, kept, generated, transient=False) for kept in self.kept(prompt_len)]

    def held_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return [self._after(prompt_len, kept, generated, transient=True) for kept in self.kept(prompt_len)]

    def resumed_peak_slots(self, resident: list[int], prompt_len: int, suffix: int) -> list[int]:
        """A resumed row appends the suffix to what it holds; chunk-wise eviction bounds it by the budget + a chunk."""
        peaks = []
        for held, kept in zip(resident, self.kept(prompt_len)):
            peak = held + suffix
            if self.chunk_eviction and self.prefill_chunk:
                peak = min(peak, max(held, kept) + self.prefill_chunk)
            peaks.append(peak)
        return peaks

    def resumed_resident_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return [self._after(prompt_len, held, generated, transient=False) for held in after_prompt]

    def resumed_held_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return [self._after(prompt_len, held, generated, transient=True) for held in after_prompt]
