"""A sliding window over KIVI storage (``streamingllm+kivi``): decode drops the oldest unpinned *page* at a time.

StreamingLLM alone evicts the oldest token past the sinks every decode step and moves the newest token into its
hole. Over KIVI pages that would re-quantize a key group at every step (keys share a scale and zero per channel
over a group of consecutive slots). Here the window slides by whole pages instead, so nothing is ever re-quantized:

* decode appends, as ``snapkv+kivi`` does (no eviction inside the compiled step);
* after a step, a ``(row, layer)`` holding ``budget + P`` slots (``P`` the page size, a multiple of the KIVI group)
  gives up its first unpinned page: ``CacheManager.drop_pages`` shifts the block table (the page's ``P`` tokens leave,
  every later page keeps its codes, scales and positions) and ``KiviStorage.on_drop_pages`` turns the residual ring
  by ``P`` slots. Between steps a layer holds ``budget`` to ``budget + P - 1`` tokens (StreamingLLM: ``budget``);
* the pinned pages are the first ``ceil(sinks / P)``: the sinks and, when ``sinks`` is not a multiple of ``P``,
  the oldest tokens kept after them share a page that never leaves (``sinks=4``, ``P=32``: the first 32 kept tokens);
* the page that leaves must already be quantized, so a row's decode budget is at least the pinned slots plus the
  residual (``budget`` below that is refused; a ``ratio`` budget is raised to it).

The prompt is compacted by the policy in full precision and quantized once, as for every ``<policy>+kivi``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..config import MethodConfigError
from .eviction_oracle import EvictionMemoryOracle

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.memory_oracle import MemoryOracle
    from ..runtime.step import StepState


class PageWindowMixin:
    """Mixed in between :class:`~.kivi.KiviStorageMixin` and a policy that declares ``window_pages`` (its decode
    eviction always takes the oldest token past :meth:`protected_slots`): the module docstring's page window."""

    def __init__(self, config, model) -> None:
        super().__init__(config, model)
        self._page_size: int | None = None

    @property
    def decode_interval(self) -> int:
        return 0  # the compiled decode step only appends; pages leave between steps (commit_step)

    def pinned_pages(self, page_size: int) -> int:
        return -(-self.protected_slots() // page_size)

    def window_floor(self, page_size: int) -> int:
        """The smallest decode budget: the pinned slots plus the residual, so that the page that leaves is
        quantized."""
        return self.pinned_pages(page_size) * page_size + self.storage.residual

    def decode_slot_bound(self) -> int | None:
        if self.config.budget is None or self._page_size is None:
            return None
        return max(self.config.budget, self.window_floor(self._page_size)) + self._page_size

    def memory_oracle(self, layout: KVLayout) -> MemoryOracle:
        self._page_size = P = layout.page_size
        floor = self.window_floor(P)
        if self.config.budget is not None and self.config.budget < floor:
            raise MethodConfigError(
                f"{self.name}: budget={self.config.budget} is below {floor}, the pinned pages ({self.pinned_pages(P)} "
                f"of {P} slots, holding the {self.protected_slots()} sinks) plus the residual "
                f"({self.storage.residual}): the window slides a page at a time and only quantized pages may leave; "
                f"pass budget >= {floor}, or a smaller residual")
        return EvictionMemoryOracle(layout, lambda n: [min(n, b) for b in self.layer_budgets(n)],
                                    self.row_decode_budget, P, self.chunk_eviction)

    def row_decode_budget(self, prompt_len: int) -> int:
        return max(super().row_decode_budget(prompt_len), self.window_floor(self._page_size))

    def commit_step(self, manager: CacheManager, step: StepState) -> None:
        super().commit_step(manager, step)
        if step.is_prefill:
            return
        P = manager.layout.page_size
        rows = np.asarray(step.row_ids, dtype=np.int64)
        over, layers = np.nonzero(manager.slot_count_array(step.row_ids) >= self._decode_budget[rows][:, None] + P)
        if len(over):
            manager.drop_pages(rows[over], layers, self.pinned_pages(P))
