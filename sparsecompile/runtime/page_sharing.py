"""Pages shared between sequences: forks, cached prefix blocks, and copy-on-write (a mixin of CacheManager).

A page is shared when its allocator reference count is above one: a forked sequence holds the pages of its
parent, a prefix-cache hit holds the pages of a cached block. Readers never care; a writer must own the page.
The KV core writes to a page in two ways, and the controller announces both before a step
(:meth:`SharedPages.prepare_writes`):

* appends: a step's new tokens land in the slots after the resident ones, so only the pages from the first new
  slot on are written (the partially filled tail page, when it is shared);
* rewrites of resident slots: methods that accumulate per-slot statistics or move slots (H2O scores, eviction
  and compaction) write anywhere in the sequence's list, so every page of the step's rows must be private.

A shared page that is about to be written is copied to a fresh page (K, V, positions, slot and page metadata)
and the sequence's block table points at the copy; the original loses one reference. The copies are queued on
the host and run on the device in :meth:`CacheManager.flush`, before the step's kernels, without a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .host import to_device

if TYPE_CHECKING:
    from .allocator import BlockAllocator


class SharedPages:
    """Fork, attach and copy-on-write over a CacheManager's host tables (see module docstring)."""

    # provided by CacheManager
    allocator: BlockAllocator
    _host_table: np.ndarray
    _host_lengths: np.ndarray
    _owned: np.ndarray
    _held_pages: Callable[..., tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]]
    _dirty_rows: set[int]
    _dirty_lengths: set[int]

    def _init_sharing(self) -> None:
        self._shared_rows: set[int] = set()  # rows that may hold pages with a reference count above one
        self._copies: list[tuple[int, int]] = []  # (source page, destination page), run by flush()
        self._holes: set[int] = set()  # rows with empty slots (position -1) inside their used slots

    def fork_sequence(self, row: int) -> int:
        """A new row holding the same pages as ``row`` (shared; each gets one more reference) and the same slot
        counts. Neither row's later writes change the other (copy-on-write)."""
        self._check_row(row)
        new = self.add_sequence()
        layers = range(self._host_table.shape[1])
        self.allocator.incref(self._held_pages([row] * len(layers), layers)[0])
        self._host_table[new] = self._host_table[row]
        self._host_lengths[new] = self._host_lengths[row]
        self._owned[new] = self._owned[row]
        self._shared_rows.update((row, new))
        if row in self._holes:  # the same slots, so the same empty ones
            self._holes.add(new)
        self._dirty_rows.add(new)
        return new

    def attach_pages(self, row: int, pages: list[list[int]], tokens: int) -> None:
        """Give an empty ``row`` the full pages ``pages[layer]`` (shared) holding its first ``tokens`` slots."""
        self._check_row(row)
        if self._owned[row].any():
            raise ValueError(f"row {row} already holds pages; attach to a fresh row")
        if any(len(p) * self.layout.page_size != tokens for p in pages):
            raise ValueError(f"attached blocks must be full pages covering exactly {tokens} tokens in every layer")
        for layer, layer_pages in enumerate(pages):
            self.allocator.incref(layer_pages)
            self._host_table[row, layer, : len(layer_pages)] = layer_pages
        self._owned[row] = len(pages[0])
        self._host_lengths[row] = tokens
        self._shared_rows.add(row)
        self._dirty_rows.add(row)

    def has_holes(self, rows: list[int]) -> bool:
        return bool(self._holes) and not self._holes.isdisjoint(rows)

    def has_shared_rows(self, rows: list[int]) -> bool:
        return bool(self._shared_rows) and not self._shared_rows.isdisjoint(rows)

    def _shared_from(self, row: int, layer: int, from_slot: int) -> np.ndarray:
        """Indices (in the row's page list) of the shared pages holding a slot at or after ``from_slot``."""
        owned = int(self._owned[row, layer])
        first = from_slot // self.layout.page_size
        if owned <= first:
            return np.zeros(0, dtype=np.int64)
        shared = self.allocator.refcounts(self._host_table[row, layer, first:owned]) > 1
        return np.nonzero(shared)[0] + first

    def pages_to_copy(self, rows: list[int], from_slots: np.ndarray) -> int:
        """Pages :meth:`prepare_writes` would copy (and allocate)."""
        return sum(len(self._shared_from(row, layer, int(from_slots[i, layer])))
                   for i, row in enumerate(rows) if row in self._shared_rows
                   for layer in range(self._host_table.shape[1]))

    def prepare_writes(self, rows: list[int], from_slots: np.ndarray) -> int:
        """Copy-on-write before a step: make private every shared page of ``rows`` that holds a slot at or after
        ``from_slots [len(rows), layers]`` (0: the whole list). Returns the number of pages copied."""
        copied = 0
        for i, row in enumerate(rows):
            if row not in self._shared_rows:
                continue
            for layer in range(self._host_table.shape[1]):
                for index in self._shared_from(row, layer, int(from_slots[i, layer])):
                    self._copy_page(row, layer, int(index))
                    copied += 1
            if not any(len(self._shared_from(row, layer, 0)) for layer in range(self._host_table.shape[1])):
                self._shared_rows.discard(row)
        return copied

    def _copy_page(self, row: int, layer: int, index: int) -> None:
        """Replace page ``index`` of ``(row, layer)`` by a private copy (queued device copy; host tables now)."""
        old = int(self._host_table[row, layer, index])
        new = int(self.allocator.allocate(1)[0])
        self.allocator.free([old])  # still referenced by the other holders: it stays allocated
        self._host_table[row, layer, index] = new
        self._new_entries.append(np.array([[row, layer, index, new]], dtype=np.int64))
        self._copies.append((old, new))

    def _run_copies(self) -> None:
        """Device half of copy-on-write: every pool-shaped tensor and page metadata, source pages read first."""
        if not self._copies:
            return
        pairs = to_device(np.array(self._copies, dtype=np.int64), self.layout.device)
        src, dst = pairs[:, 0], pairs[:, 1]
        for pool in self._page_tensors():  # K/V in the manager's storage format, positions, metadata
            pool.index_copy_(0, dst, pool.index_select(0, src))
        self._copies.clear()

    def shared_page_count(self) -> int:
        """Pages with more than one holder (statistics, tests)."""
        used = self.allocator.refcounts(np.arange(self.allocator.num_pages))
        return int((used > 1).sum())
