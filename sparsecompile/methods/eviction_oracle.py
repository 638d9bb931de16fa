"""Capacity of one sequence under an eviction method (the MemoryOracle the scheduler admits by): prefill holds the
prompt (or, with chunk-wise eviction, the budget plus one chunk), then each layer keeps its budget and decode appends
or cycles between ``budget`` and ``budget + interval``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..runtime.memory_oracle import MemoryOracle, layers_alike

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
        self._memo: dict[int, tuple[list[int], int | None]] = {}  # prompt_len -> (kept, decode budget)

    def _budgets(self, prompt_len: int) -> tuple[list[int], int | None]:
        """``kept(prompt_len)`` and ``decode_budget(prompt_len)``, memoized per prompt length: the scheduler asks
        for every running request at every step, and the method's callables build a list of every layer's budget
        per call (the method's budgets are fixed for its runtime's life). Callers only read the list."""
        found = self._memo.get(prompt_len)
        if found is None:
            if len(self._memo) >= 4096:  # bounded: emptied when it holds 4,096 prompt lengths, then refilled
                self._memo.clear()
            budget = None if self.decode_budget is None else self.decode_budget(prompt_len)
            found = self._memo[prompt_len] = (list(self.kept(prompt_len)), budget)
        return found

    def _after(self, budget: int | None, kept: int, generated: int, transient: bool) -> int:
        """Slots after ``generated`` decode steps (``budget``: the decode budget, :meth:`_budgets`; ``transient``:
        the most any of them held before its eviction)."""
        total = kept + generated
        if budget is None or total < budget + self.interval:
            return total
        return budget + self.interval if transient else budget + (total - budget) % self.interval

    def _decoded(self, prompt_len: int, kept: list[int], generated: int, transient: bool) -> list[int]:
        """:meth:`_after` of each layer's ``kept`` slots; once when every layer keeps alike."""
        budget = self._budgets(prompt_len)[1]
        if kept and layers_alike(kept):
            return [self._after(budget, kept[0], generated, transient)] * len(kept)
        return [self._after(budget, k, generated, transient) for k in kept]

    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        peaks = []
        kept_per_layer, budget = self._budgets(prompt_len)
        for kept in kept_per_layer:
            prefill = prompt_len
            if self.chunk_eviction and self.prefill_chunk:
                prefill = min(prompt_len, kept + self.prefill_chunk)
            peaks.append(max(prefill, self._after(budget, kept, max_new_tokens, transient=True)))
        return peaks

    def resident_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return self._decoded(prompt_len, self._budgets(prompt_len)[0], generated, transient=False)

    def held_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        return self._decoded(prompt_len, self._budgets(prompt_len)[0], generated, transient=True)

    def resumed_peak_slots(self, resident: list[int], prompt_len: int, suffix: int) -> list[int]:
        """A resumed row appends the suffix to what it holds; chunk-wise eviction bounds it by the budget + a chunk."""
        peaks = []
        for held, kept in zip(resident, self._budgets(prompt_len)[0]):
            peak = held + suffix
            if self.chunk_eviction and self.prefill_chunk:
                peak = min(peak, max(held, kept) + self.prefill_chunk)
            peaks.append(peak)
        return peaks

    def resumed_resident_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return self._decoded(prompt_len, list(after_prompt), generated, transient=False)

    def resumed_held_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        return self._decoded(prompt_len, list(after_prompt), generated, transient=True)
