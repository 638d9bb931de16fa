"""MemoryOracle: per-method capacity questions the scheduler (and pool sizing) asks.

A method names its resources (each a budget with a unit) and tells, for a request, what admitting
it costs in each, and what one more step costs. The scheduler admits a request only when every
cost fits its remaining budget (paper: admission ``c_j(r) <= B_j`` for every resource ``j``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .cache_manager import KVLayout

#: The second resource: bytes of prompt buffers outside the pool (:meth:`MemoryOracle.prompt_buffer_bytes`).
PROMPT_BUFFER = "prompt_buffer_bytes"


class MemoryOracle(ABC):
    """Capacity model of one method over one :class:`KVLayout`."""

    #: Prompt tokens per prefill forward when the scheduler knows it (None: one forward per prompt); methods whose
    #: prefill peak depends on it (chunk-wise eviction) read it.
    prefill_chunk: int | None = None
    #: Bytes the serving engine leaves outside the pool for prompt buffers (:meth:`prompt_buffer_bytes`), set when it
    #: sizes the pool from memory; 0: not counted (a pool of a given size, ``generate()``).
    buffer_budget: int = 0

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    @abstractmethod
    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        """Most row-local slots each layer ever uses for one sequence (transient prefill state included)."""

    def resident_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        """Slots each layer holds between steps after ``generated`` decode tokens (default: the peak)."""
        return self.peak_slots_per_layer(prompt_len, generated)

    def held_slots_per_layer(self, prompt_len: int, generated: int) -> list[int]:
        """Slots whose pages each layer keeps between steps: the resident slots, or more where the method keeps room
        for tokens it takes back before it evicts again (decode eviction keeps ``budget + interval``)."""
        return self.resident_slots_per_layer(prompt_len, generated)

    def pages_for(self, slots_per_layer: list[int]) -> int:
        P, slots = self.layout.page_size, list(slots_per_layer)
        if slots and layers_alike(slots):  # every layer alike (most methods): the scheduler asks this per running
            return len(slots) * -(-int(slots[0]) // P)  # request and step
        return sum(-(-int(s) // P) for s in slots)

    def prompt_buffer_bytes(self, prompt_len: int) -> int:
        """Bytes outside the pool one row may use while its prompt of ``prompt_len`` tokens is prefilled (a storage
        format's full-precision buffers, kept across layers or steps until its last chunk's step ends); 0: none."""
        return 0

    def resources(self, free_pages: int) -> dict[str, int]:
        """Named budgets still available: ``kv_pages`` (pages of ``page_size`` tokens x all KV heads) and, when counted,
        :data:`PROMPT_BUFFER` (bytes)."""
        return {"kv_pages": free_pages, **({PROMPT_BUFFER: self.buffer_budget} if self.buffer_budget else {})}

    def prompt_cost(self, prompt_len: int) -> dict[str, int]:
        """What a prompt reserves besides pages from its admission to its last chunk (when counted)."""
        need = self.prompt_buffer_bytes(prompt_len) if self.buffer_budget else 0
        return {PROMPT_BUFFER: need} if need else {}

    def admission_cost(self, prompt_len: int, max_new_tokens: int) -> dict[str, int]:
        """Reservation that guarantees the request can run to completion."""
        return {"kv_pages": self.pages_for(self.peak_slots_per_layer(prompt_len, max_new_tokens)),
                **self.prompt_cost(prompt_len)}

    def step_cost(self, prompt_len: int, generated: int, new_tokens: int) -> dict[str, int]:
        """Extra pages the next step (``new_tokens`` more) allocates beyond what is resident now.

        A step's tokens are written (``resident + new_tokens`` slots per layer) before any eviction of that step
        runs, so a step that evicts back below a page boundary still needs the page while it runs.
        """
        return self.growth_cost(self.resident_slots_per_layer(prompt_len, generated),
                                self.held_slots_per_layer(prompt_len, generated), new_tokens)

    def growth_cost(self, resident: list[int], held: list[int], new_tokens: int) -> dict[str, int]:
        """Pages ``new_tokens`` more slots per layer take beyond the pages of ``held`` slots."""
        if resident and layers_alike(resident) and layers_alike(held):  # one layer's growth for all layers
            grown = [max(held[0], resident[0] + new_tokens)] * len(held)  # (pages_for takes its fast path)
        else:
            grown = [max(h, s + new_tokens) for s, h in zip(resident, held)]
        return {"kv_pages": self.pages_for(grown) - self.pages_for(held)}

    # ---- resumed rows (a chain continuation: the row already holds a compacted prefix; serving/reuse.py)
    def resumed_peak_slots(self, resident: list[int], prompt_len: int, suffix: int) -> list[int]:
        """Most slots each layer uses while a row that already holds ``resident`` slots per layer prefills ``suffix``
        more prompt tokens (``prompt_len``: the whole logical prompt, resumed prefix included)."""
        return [r + suffix for r in resident]

    def resumed_resident_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        """Slots each layer holds after ``generated`` decode tokens when the prompt (of ``prompt_len`` logical tokens)
        left ``after_prompt`` slots per layer (measured on the row, not derived from ``prompt_len``)."""
        if after_prompt and layers_alike(after_prompt):  # the engine's case for every request after its prompt
            return [after_prompt[0] + generated] * len(after_prompt)
        return [c + generated for c in after_prompt]

    def resumed_held_slots(self, after_prompt: list[int], prompt_len: int, generated: int) -> list[int]:
        """:meth:`held_slots_per_layer` of such a row."""
        return self.resumed_resident_slots(after_prompt, prompt_len, generated)

    def fits(self, cost: dict[str, int], budgets: dict[str, int]) -> bool:
        return all(cost.get(name, 0) <= budgets.get(name, 0) for name in cost)


class DenseMemoryOracle(MemoryOracle):
    """Every token of every layer stays resident: ``prompt + generated`` slots per layer."""

    def peak_slots_per_layer(self, prompt_len: int, max_new_tokens: int) -> list[int]:
        return [prompt_len + max_new_tokens] * self.layout.num_layers


def layers_alike(values: list[int]) -> bool:
    """Every entry of a non-empty per-layer list equals the first (a C-speed count: the lists the scheduler handles
    each step)."""
    return values.count(values[0]) == len(values)
