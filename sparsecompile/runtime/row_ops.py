"""The controller's operations on whole rows (sequences) outside a step: fork (pages shared copy-on-write, method
state copied), crop, dropping the newest positions, release; and the capacity buckets the pool grows by."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .cache_manager import CacheManager, KVLayout
    from .contract import SparseMethod


def capacity_bucket(n: int) -> int:
    """Round ``n`` up to one of 32 sizes per power of two (<= 3.2 % waste: a 128K prompt's pool is 16 GiB on the
    8B shape, and prefill memory must not exceed HF's), so capacities, and the compiled graphs that depend on them,
    change rarely."""
    n = max(1, n)
    if n <= 32:
        return 1 << math.ceil(math.log2(n))
    step = 1 << (n.bit_length() - 6)
    return -(-n // step) * step


def table_width(pages: int) -> int:
    """Block-table width for rows of up to ``pages`` pages: a multiple of 16, so that the rows of the table and of
    everything shaped like it (Quest's page scores) start 64-byte aligned, which Triton specialises its loads on.
    At 128K on the H200 an odd width (8,207 pages) made Quest's top-k select take 42 us instead of 32
    (``benchmarks/results/topk_width_h200.jsonl``)."""
    return -(-max(1, pages) // 16) * 16


class RowOperations:
    """Mixed into :class:`~.controller.SparseController`, whose state it uses: ``manager``, ``runtime``, ``layout``,
    ``config`` and the compiled decode steps keyed by capacity (cleared when the pool grows)."""

    manager: CacheManager | None
    runtime: SparseMethod
    layout: KVLayout
    config: EngineConfig
    _decode_steps: dict

    def fork_rows(self, rows: list[int]) -> list[int]:
        """New rows holding the same KV as ``rows`` (pages shared copy-on-write) and a copy of the method's per-row
        state: writing to either never changes the other."""
        if self.manager is None:
            raise RuntimeError("nothing to fork: no sequence was prefilled yet")
        m = self.manager
        if len(m.live_rows) + len(rows) > m.max_seqs and self.config.num_pages is None:
            m.grow(m.num_pages, capacity_bucket(len(m.live_rows) + len(rows)), m.max_pages_per_seq)
            self._decode_steps.clear()
        forks = []
        try:
            for row in rows:
                forks.append(m.fork_sequence(row))
        except BaseException:
            self.release_rows(forks)
            raise
        self.runtime.fork_rows(m, list(rows), forks)
        return forks

    def crop_rows(self, rows: list[int], counts: list[int]) -> None:
        """Keep the first ``counts[i]`` slots of every layer of ``rows[i]`` (exact only when every token is
        resident in order: ``keeps_all_tokens`` methods)."""
        if not self.runtime.keeps_all_tokens:
            raise ValueError(f"cannot crop a {self.runtime.name} cache: it evicts, so its slots no longer hold the "
                             "tokens before a position in order (crop is exact for vanilla, quest and omnikv); "
                             "fork() the cache before the step you want to undo instead")
        m = self.manager
        for row, count in zip(rows, counts):
            for layer in range(self.layout.num_layers):
                m.truncate(row, layer, min(count, int(m.slot_count_array([row])[0, layer])))
        m.flush()
        self.runtime.on_truncate(m, list(rows))

    def drop_positions(self, rows: list[int], first: list[int]) -> None:
        """Remove every resident token at logical position ``>= first[i]`` from ``rows[i]`` (host syncs: for API
        calls such as ``compress(question_ids=...)``, not for steps). The removed tokens must be each list's newest
        (true after a prefill: slots are in position order); a layer whose heads kept different numbers of them
        keeps its slot count, the removed entries becoming empty slots (position -1, never attended)."""
        m = self.manager
        m.prepare_writes(list(rows), np.zeros((len(rows), self.layout.num_layers), dtype=np.int64))
        m.flush()
        for row, cut in zip(rows, first):
            for layer in range(self.layout.num_layers):
                positions = m.retained_positions(row, layer)
                kept = [int((p < cut).sum()) for p in positions]
                count = int(m.slot_count_array([row])[0, layer])
                if len(set(kept)) == 1:
                    m.truncate(row, layer, kept[0])
                    continue
                m.clear_positions(row, layer, count, cut)
                m.truncate(row, layer, max(kept))
        m.flush()
        if self.runtime.keeps_all_tokens:
            self.runtime.on_truncate(m, list(rows))

    def release_rows(self, rows: list[int]) -> None:
        if self.manager is None:
            return
        live = set(self.manager.live_rows)
        freed = [row for row in rows if row in live]
        for row in freed:
            self.manager.release_sequence(row)
        self.runtime.release_rows(self.manager, freed)
