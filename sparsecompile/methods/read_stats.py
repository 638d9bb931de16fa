"""Device-side bookkeeping shared by the dynamic-selection methods (Quest, OmniKV).

They keep every token resident and only change what attention reads, so ``kv_stats`` reports the
slots each layer read in the last decode step next to the resident ones. The count is written on
the device inside the (compiled) decode step and read back on the host only when stats are asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..runtime.compilation import static_address
from .dense_read import DENSE

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager
    from ..runtime.contract import LayerContext
    from ..runtime.step import StepState


def grow_rows(buffer: torch.Tensor | None, rows: int, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device, fill: int = 0) -> torch.Tensor:
    """A static ``[rows, *shape]`` runtime buffer, reallocated (keeping the old rows' contents) when it is too small.

    The new tensor is marked as a static address so compiled / CUDA-graph decode steps can mutate it in place.
    """
    if buffer is not None and buffer.shape[0] >= rows and tuple(buffer.shape[1:]) == shape:
        return buffer
    fresh = torch.full((rows, *shape), fill, dtype=dtype, device=device)
    if buffer is not None and tuple(buffer.shape[1:]) == shape:
        fresh[: buffer.shape[0]] = buffer
    static_address(fresh)
    return fresh


def copy_rows(buffers: list[torch.Tensor | None], sources: list[int], forks: list[int]) -> None:
    """``buffer[forks[i]] = buffer[sources[i]]`` for per-row device buffers (a forked sequence's state)."""
    for buffer in buffers:
        if buffer is not None and sources:
            device = buffer.device
            buffer[torch.tensor(forks, device=device)] = buffer[torch.tensor(sources, device=device)]


class ReadCounter:
    """Slots read per ``(sequence row, layer)`` in the row's last decode step (summed over KV heads)."""

    def __init__(self) -> None:
        self.read: torch.Tensor | None = None  # [max_seqs, layers] int64
        self._decoded: set[int] = set()  # host: rows whose last step was a decode step
        self._dense: set[int] = set()  # host: rows whose last decode step read every slot (nothing recorded)

    def prepare(self, manager: CacheManager, step: StepState) -> None:
        """Host hook (``prepare_step``): size the buffer; a prefill step starts a row's count afresh. A ``dense``
        decode step (``methods/dense_read.py``) reads every resident slot and records nothing (the host knows the
        count)."""
        layout = manager.layout
        self.read = grow_rows(self.read, manager.max_seqs, (layout.num_layers,), torch.int64, layout.device)
        if step.is_prefill:
            self._decoded.difference_update(step.row_ids)
        else:
            self._decoded.update(step.row_ids)
            (self._dense.update if step.variant == DENSE else self._dense.difference_update)(step.row_ids)

    def record(self, ctx: LayerContext) -> None:
        """Device hook (``on_attention_end``): store ``view.slots_read [batch, kv_heads]`` summed over heads (a dense
        step stores nothing)."""
        if ctx.step.variant == DENSE or ctx.step.is_prefill or ctx.view is None or self.read is None:
            return
        self.read[ctx.step.rows, ctx.layer] = ctx.view.slots_read.sum(dim=1).to(torch.int64)

    def fork(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        """``forks[i]`` holds what ``sources[i]`` holds: it read what its source read in its last step."""
        if self.read is not None:  # (the pool may have grown since the last step)
            layout = manager.layout
            self.read = grow_rows(self.read, manager.max_seqs, (layout.num_layers,), torch.int64, layout.device)
        copy_rows([self.read], sources, forks)
        for source, fork in zip(sources, forks):
            for rows in (self._decoded, self._dense):
                (rows.add if source in rows else rows.discard)(fork)

    def forget(self, rows: list[int]) -> None:
        """Freed rows (their ids are reused): nothing read."""
        self._decoded.difference_update(rows)
        self._dense.difference_update(rows)

    def collect(self, manager: CacheManager, rows: list[int]) -> dict[int, int] | None:
        """Per layer, slots the last decode step read over ``rows`` (host sync), or None before any decode."""
        decoded = [row for row in rows if row in self._decoded]
        if self.read is None or not decoded:
            return None
        recorded = [row for row in decoded if row not in self._dense]
        per_layer = np.zeros(manager.layout.num_layers, dtype=np.int64)
        if recorded:
            per_layer += self.read[torch.tensor(recorded, device=self.read.device)].sum(dim=0).cpu().numpy()
        dense = [row for row in decoded if row in self._dense]
        if dense:  # every resident slot of every KV head
            per_layer += manager.slot_count_array(dense).sum(axis=0) * manager.layout.num_kv_heads
        return dict(enumerate(int(n) for n in per_layer))


class CountsReads:
    """Mixed into a runtime that owns ``self.reads`` (:class:`ReadCounter`), before the runtime's other bases: a fork
    read what its source read, a freed row nothing (row ids are reused)."""

    reads: ReadCounter

    def fork_rows(self, manager: CacheManager, sources: list[int], forks: list[int]) -> None:
        super().fork_rows(manager, sources, forks)
        self.reads.fork(manager, sources, forks)

    def release_rows(self, manager: CacheManager, rows: list[int]) -> None:
        super().release_rows(manager, rows)
        self.reads.forget(rows)
