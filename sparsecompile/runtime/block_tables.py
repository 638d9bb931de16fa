"""Host-side block tables of the CacheManager (a mixin): how many slots each ``(row, layer)`` uses, which pages
hold them, page allocation as lists grow, truncation and page drops that give pages back, and :meth:`flush`, which
pushes what changed to the device tables before a step.

The host is authoritative for slot counts and page lists (``cache_manager.py``'s module docstring): every change
here is vectorised over ``(row, layer)`` pairs (no per-pair Python: an evicting decode step shrinks every layer of
every row) and checks every pair before changing anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .allocator import OutOfPages
from .host import to_device

if TYPE_CHECKING:
    from .allocator import BlockAllocator
    from .kivi import KiviStorage
    from .layout import KVLayout


class BlockTables:
    """Slot counts, page lists and their device copies (see module docstring)."""

    # provided by CacheManager
    layout: KVLayout
    allocator: BlockAllocator
    storage: KiviStorage | None
    block_table: torch.Tensor
    lengths: torch.Tensor
    max_pages_per_seq: int
    _host_table: np.ndarray
    _host_lengths: np.ndarray
    _owned: np.ndarray
    _live_rows: set[int]
    _dirty_rows: set[int]
    _dirty_lengths: set[int]
    _new_entries: list[np.ndarray]
    _run_copies: Callable[[], None]

    def slot_counts(self, row: int) -> list[int]:
        """Row-local slots in use per layer (host)."""
        return self._host_lengths[row].tolist()

    def slot_count_array(self, rows: list[int]) -> np.ndarray:
        """``[len(rows), layers]`` int64 copy of the slots in use (host)."""
        return self._host_lengths[rows].copy()

    def pages_of(self, row: int, layer: int) -> list[int]:
        return self._host_table[row, layer, : self._owned[row, layer]].tolist()

    def _held_pages(self, rows: Sequence[int], layers: Sequence[int],
                    first: np.ndarray | int = 0) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The pages of each ``(row, layer)`` pair from index ``first`` (per pair, or one for all) to its end, pair
        after pair in list order, as one int64 array, and their ``(row, layer, index)`` places in the host table."""
        rows, layers = np.asarray(rows, dtype=np.int64), np.asarray(layers, dtype=np.int64)
        first = np.broadcast_to(np.asarray(first, dtype=np.int64), rows.shape)
        pair, index = _runs(first, np.maximum(self._owned[rows, layers] - first, 0))
        place = (rows[pair], layers[pair], index)
        return self._host_table[place].astype(np.int64), place

    def pages_needed(self, rows: list[int], new_counts: np.ndarray) -> int:
        """Pages :meth:`ensure_slots` would allocate for ``new_counts [len(rows), layers]``."""
        want = -(-np.asarray(new_counts, dtype=np.int64) // self.layout.page_size)
        return int(np.maximum(want - self._owned[rows], 0).sum())

    def ensure_slots(self, rows: list[int], new_counts: np.ndarray) -> None:
        """Grow ``(row, layer)`` slot counts to ``new_counts [len(rows), layers]``, allocating pages.

        Atomic: raises :class:`OutOfPages` (or ValueError) before changing anything.
        """
        P, maxp = self.layout.page_size, self.max_pages_per_seq
        new_counts = np.asarray(new_counts, dtype=np.int64).reshape(len(rows), self.layout.num_layers)
        for row in rows:
            self._check_row(row)
        if new_counts.size and int(new_counts.max()) > maxp * P:
            raise OutOfPages(f"a sequence needs {int(new_counts.max())} slots in one layer; "
                             f"the block table holds {maxp * P}")
        owned = self._owned[rows]
        want = -(-new_counts // P)
        grows, layers = np.nonzero(want > owned)  # the (row, layer) pairs that take pages, row-major
        if len(grows):
            have, need = owned[grows, layers], want[grows, layers]
            fresh = np.asarray(self.allocator.allocate(int((need - have).sum())), dtype=np.int64)
            pair, index = _runs(have, need - have)  # each new page's pair and its place in the row's table
            row_ids = np.asarray(rows, dtype=np.int64)[grows]
            entries = np.stack([row_ids[pair], layers[pair], index, fresh], axis=1)  # as flush() sends them
            self._host_table[entries[:, 0], entries[:, 1], entries[:, 2]] = fresh
            self._new_entries.append(entries)
            self._owned[row_ids, layers] = need
        self._host_lengths[rows] = np.maximum(self._host_lengths[rows], new_counts)
        self._dirty_lengths.update(rows)

    def truncate(self, row: int, layer: int, count: int) -> None:
        """Keep only the first ``count`` slots of ``(row, layer)``; pages past them go back to the allocator."""
        self.truncate_many([row], [layer], [count])

    def truncate_many(self, rows: Sequence[int], layers: Sequence[int], counts: Sequence[int],
                      reserve: Sequence[int] | None = None, storage_done: bool = False) -> None:
        """:meth:`truncate` for several distinct ``(row, layer)`` pairs, with one allocator call and no per-pair
        Python (an evicting method's decode step shrinks every layer of every row: 512 pairs at batch 16 of a 32-layer
        model; one call a pair cost about 30 us of host time, 16 ms a step on the H200). Checks every pair before
        changing anything.

        ``reserve`` (slots per pair): keep the pages of that many slots where ``counts`` needs fewer (those the pair
        owns), the room a decoding row takes back before it evicts again: a budget that fills its pages exactly
        would otherwise take a page per pair for each step's new token and free it after the eviction. What sits
        past ``counts`` in kept pages is dead (slots past ``lengths`` are never read).

        ``storage_done``: the storage format already holds the shortened lists (``SlotAccess.remove_groups``); its
        truncation hook (which hands quantized slots back to KIVI's residual) is skipped.
        """
        rows, layers = np.asarray(rows, dtype=np.int64), np.asarray(layers, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        for row in set(rows.tolist()):
            self._check_row(row)
        before = self._host_lengths[rows, layers]
        over = counts > before
        if over.any():
            raise ValueError(f"truncate to {int(counts[over][0])} slots but only {int(before[over][0])} are used")
        kept_slots = counts if reserve is None else np.maximum(counts, np.asarray(reserve, dtype=np.int64))
        keep = np.minimum(-(-kept_slots // self.layout.page_size), self._owned[rows, layers])
        if self.storage is not None and not storage_done:
            for row, layer, old, new in zip(rows.tolist(), layers.tolist(), before.tolist(), counts.tolist()):
                self.storage.on_truncate(row, layer, old, new)
        shrink = np.nonzero(self._owned[rows, layers] > keep)[0]  # only these pairs give pages back
        if len(shrink):
            freed, place = self._held_pages(rows[shrink], layers[shrink], keep[shrink])
            self.allocator.free(freed)
            self._host_table[place] = 0  # the device keeps stale ids past `lengths`
        self._owned[rows, layers] = keep
        self._host_lengths[rows, layers] = counts
        self._dirty_lengths.update(rows.tolist())

    def drop_pages(self, rows: Sequence[int], layers: Sequence[int], index: int) -> None:
        """Remove the page at list index ``index`` from each distinct ``(row, layer)`` pair: its ``page_size`` slots
        leave and every later slot moves down by ``page_size``, by shifting the pair's block-table entries (the
        pages keep their contents: K/V, positions and metadata move with them, nothing is rewritten); the page loses
        one reference. A sliding window over a storage format whose slots must not be rewritten (KIVI's quantized
        groups) slides this way. Checks every pair before changing anything."""
        P = self.layout.page_size
        rows, layers = np.asarray(rows, dtype=np.int64), np.asarray(layers, dtype=np.int64)
        if not len(rows):
            return
        for row in set(rows.tolist()):
            self._check_row(row)
        before = self._host_lengths[rows, layers]
        if (self._owned[rows, layers] <= index).any() or (before < (index + 1) * P).any():
            raise ValueError(f"drop_pages: page {index} is not a full page of every pair")
        if self.storage is not None:
            self.storage.on_drop_pages(rows, layers, before, index)
        dropped = self._host_table[rows, layers, index].astype(np.int64)
        owned = self._owned[rows, layers]
        pair, moved = _runs(np.full(len(rows), index, dtype=np.int64), owned - 1 - index)  # new places index..
        self._host_table[rows[pair], layers[pair], moved] = self._host_table[rows[pair], layers[pair], moved + 1]
        self._host_table[rows, layers, owned - 1] = 0
        self.allocator.free(dropped)
        self._owned[rows, layers] = owned - 1
        self._host_lengths[rows, layers] = before - P
        self._new_entries.append(np.stack([rows[pair], layers[pair], moved,
                                           self._host_table[rows[pair], layers[pair], moved]], axis=1))
        self._dirty_lengths.update(rows.tolist())

    def flush(self) -> None:
        """Push host changes of block tables and slot counts to the device (before a step).

        Only what changed travels (slot counts of the touched rows, new table entries), through pinned
        buffers and non-blocking copies, so the host does not wait for the GPU's previous step.
        """
        dev = self.layout.device
        self._run_copies()  # copy-on-write first: the tables below already point at the copies
        entries = self._entries_to_send()
        if self._dirty_rows:
            rows = np.array(sorted(self._dirty_rows), dtype=np.int64)
            self.block_table[to_device(rows, dev)] = to_device(self._host_table[rows], dev)
            self._dirty_lengths.update(self._dirty_rows)
            self._dirty_rows.clear()
        if len(entries):
            entries = to_device(entries, dev)  # [n, 4]: (row, layer, index, page)
            self.block_table.index_put_((entries[:, 0], entries[:, 1], entries[:, 2]), entries[:, 3].to(torch.int32))
        if self._dirty_lengths:
            rows = np.array(sorted(self._dirty_lengths), dtype=np.int64)
            self.lengths[to_device(rows, dev)] = to_device(self._host_lengths[rows].astype(np.int32), dev)
            self._dirty_lengths.clear()

    def _entries_to_send(self) -> np.ndarray:
        """The queued table entries ``[n, 4]`` that go one by one; a row whose whole table row goes anyway (a new
        or released row), or whose entries outweigh it (32 bytes an entry against 4 a table slot: a long prompt's
        prefill), joins the dirty rows instead, so a flush sends each row's changes once and as few bytes as it can.
        """
        if not self._new_entries:
            return np.empty((0, 4), dtype=np.int64)
        entries = np.concatenate(self._new_entries)
        self._new_entries.clear()
        per_row = np.bincount(entries[:, 0], minlength=self._host_table.shape[0])
        self._dirty_rows.update(np.nonzero(per_row * 8 > self._host_table[0].size)[0].tolist())
        if not self._dirty_rows:
            return entries
        return entries[~np.isin(entries[:, 0], np.fromiter(self._dirty_rows, dtype=np.int64))]

    def _check_row(self, row: int) -> None:
        if row not in self._live_rows:
            raise ValueError(f"row {row} is not a live sequence")


def _runs(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair ``i`` covers table indices ``first[i] .. first[i] + counts[i] - 1``: every such index, pair after pair,
    as ``(pair, index)`` int64 arrays of length ``counts.sum()``."""
    pair = np.repeat(np.arange(len(counts)), counts)
    return pair, first[pair] + np.arange(len(pair)) - np.repeat(np.cumsum(counts) - counts, counts)
