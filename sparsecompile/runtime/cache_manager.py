"""CacheManager: the paged KV pool, block tables, retained-slot maps and method metadata.

Storage model
-------------
* One pool shared by every layer: ``k_pool, v_pool [num_pages, kv_heads, page_size, head_dim]`` and
  ``pos_pool [num_pages, kv_heads, page_size]`` (int32 logical position of the token in each slot,
  -1 = empty). A page belongs to one ``(sequence row, layer)``, or is shared read-only by several
  (forked sequences, cached prefix blocks: see ``page_sharing.py``, copy-on-write).
* Each ``(row, layer)`` owns a list of pages (``block_table [max_seqs, layers, max_pages]``) and uses
  its first ``lengths[row, layer]`` *row-local slots*; slot ``i`` lives in page ``block_table[i // P]``
  at offset ``i % P``. All KV heads of a layer use the same number of slots, but every head keeps its
  own tokens: ``pos_pool`` is the per-layer, per-KV-head retained-slot map to logical positions.
* Method metadata lives here too: *slot metadata* (pool-shaped, e.g. H2O scores) moves with its
  token on compaction; *page metadata* (e.g. Quest min/max keys) is indexed by page.
* Storage format: ``KVLayout.storage`` None keeps K/V in ``k_pool / v_pool`` (dense, the model's dtype); a
  :class:`~.kivi.KiviSpec` stores them as KIVI pages plus a full-precision residual (``runtime/kivi.py``: then
  ``k_pool / v_pool`` are None and :attr:`CacheManager.storage` owns the K/V tensors). Positions, slot and page
  metadata, block tables and slot counts are the same for every format.

Host / device split
-------------------
The host is authoritative for *how many* slots each ``(row, layer)`` uses (every method here keeps
a count that follows from lengths and budgets), so page allocation happens on the host, before a
step, and is pushed to the device block table with :meth:`flush`. The device is authoritative for
*what* each slot holds. Device-side operations (:meth:`write`, :meth:`build_view`, :meth:`move_slots`; in
``slot_access.py``) contain no host synchronisation and run inside compiled decode graphs.

Physical eviction (:meth:`move_slots` + :meth:`truncate`) frees pages back to the allocator;
logical selection (:meth:`build_view` with a :class:`Selection`) only changes what attention reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .allocator import BlockAllocator, OutOfPages
from .compilation import mark_for_compile, page_indexed, static_address
from .host import to_device
from .kivi import KiviStorage
from .layout import KVLayout
from .page_sharing import SharedPages
from .slot_access import SlotAccess


class CacheManager(SharedPages, SlotAccess):
    """Owns the paged KV pool and every per-sequence map into it (see module docstring)."""

    def __init__(self, layout: KVLayout, num_pages: int, max_seqs: int, max_pages_per_seq: int) -> None:
        self.layout = layout
        self.allocator = BlockAllocator(num_pages)
        self.storage = KiviStorage(self, layout.storage) if layout.storage is not None else None
        self.slot_metadata: dict[str, torch.Tensor] = {}
        self._slot_fill: dict[str, float] = {}
        self.page_metadata: dict[str, torch.Tensor] = {}
        self.key_bounds: tuple[str, str] | None = None  # see track_key_bounds
        L = layout.num_layers
        self._host_table = np.zeros((max_seqs, L, max_pages_per_seq), dtype=np.int32)
        self._table_rows, self._table_width = max_seqs, max_pages_per_seq
        self._host_lengths = np.zeros((max_seqs, L), dtype=np.int64)
        # A (row, layer)'s pages are the first _owned[row, layer] entries of its host table row (the one record of
        # them: page lists are vectorised reads and writes of the table, no per-pair Python)
        self._owned = np.zeros((max_seqs, L), dtype=np.int64)
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._live_rows: set[int] = set()
        # Pending host -> device updates: whole rows (rare), slot counts (every step), new table entries.
        self._dirty_rows: set[int] = set()
        self._dirty_lengths: set[int] = set()
        self._new_entries: list[np.ndarray] = []  # [k, 4] int64 blocks of (row, layer, index, page)
        self._init_sharing()
        self._allocate_device(num_pages, max_seqs, max_pages_per_seq)
        # One index tensor per layer, for device-side ``[rows, layer]`` lookups: a Python int would be a constant in
        # every kernel inductor generates for that layer, so the 32 layers' copies of one kernel would differ only
        # in it and compile 32 times; a tensor is a graph input, and the copies are one kernel. Shape [1], not 0-d:
        # indexing turns a 0-d integer tensor into a Python int (a data-dependent value under compile).
        self._layer_keys = [torch.full((1,), layer, dtype=torch.long, device=layout.device) for layer in range(L)]
        for key in self._layer_keys:
            static_address(key)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def trash_page(self) -> int:
        """The pool's extra last page, never allocated, that absorbs masked scatters (static shapes, no races).

        Read from the pool's shape, not kept as an int: under compile an int attribute is a guarded constant (each
        pool growth would recompile the decode step), a shape is the pages' dynamic size (``page_indexed``), and an
        exported program traced with a symbolic page count keeps it symbolic."""
        return self.pos_pool.shape[0] - 1

    @property
    def bytes_per_page(self) -> int:
        """Device bytes one page costs: K, V, positions and every registered slot / page metadata tensor."""
        return sum(t[0].numel() * t.element_size() for t in self._page_tensors())

    @property
    def bytes_per_row(self) -> int:
        """Device bytes each sequence row costs whether it holds pages or not (the KIVI residual rings)."""
        return 0 if self.storage is None else self.storage.row_bytes

    def _page_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor indexed by page (copied by copy-on-write and growth, counted by :attr:`bytes_per_page`)."""
        kv = (self.k_pool, self.v_pool) if self.storage is None else self.storage.page_tensors()
        return (*kv, self.pos_pool, *self.slot_metadata.values(), *self.page_metadata.values())

    # Plain ints, not the host table's shape: compiled decode steps read these (H2O's decode width), and dynamo
    # turns a numpy array it touches into a tensor it guards by converting the array on every call.
    @property
    def max_seqs(self) -> int:
        return self._table_rows

    @property
    def max_pages_per_seq(self) -> int:
        return self._table_width

    @property
    def slot_capacity(self) -> int:
        """Row-local slots a (row, layer) can hold: the block table's width in slots. For device code: read from the
        device table's shape, a dynamic size under compile (the table widens with the longest sequence without
        recompiling decode steps; ``max_pages_per_seq``, an int attribute, would be a guarded constant)."""
        return self.block_table.shape[2] * self.layout.page_size

    def _allocate_device(self, num_pages: int, max_seqs: int, max_pages_per_seq: int) -> None:
        L, H, P, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.page_size, self.layout.head_dim
        dev, dtype = self.layout.device, self.layout.dtype
        if self.storage is None:
            self.k_pool = torch.zeros(num_pages + 1, H, P, D, dtype=dtype, device=dev)
            self.v_pool = torch.zeros(num_pages + 1, H, P, D, dtype=dtype, device=dev)
        else:
            self.k_pool = self.v_pool = None
            self.storage.allocate(num_pages, max_seqs)
        self.pos_pool = torch.full((num_pages + 1, H, P), -1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(max_seqs, L, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(max_seqs, L, dtype=torch.int32, device=dev)
        for t in (self.k_pool, self.v_pool, self.pos_pool):
            if t is not None:
                page_indexed(t)
        static_address(self.lengths)
        mark_for_compile(self.block_table, dynamic_dims=(2,))  # the table widens with the longest sequence

    def grow(self, num_pages: int, max_seqs: int, max_pages_per_seq: int) -> None:
        """Enlarge the pool, the row count and the block-table width, keeping every live sequence.

        New tensors replace the old ones (compiled graphs that captured them recompile).
        """
        num_pages = max(num_pages, self.num_pages)
        max_seqs = max(max_seqs, self.max_seqs)
        max_pages_per_seq = max(max_pages_per_seq, self.max_pages_per_seq)
        old = (self.k_pool, self.v_pool, self.pos_pool)
        old_meta = dict(self.slot_metadata)
        old_page_meta = dict(self.page_metadata)
        old_pages = self.num_pages
        old_storage = None if self.storage is None else self.storage.tensors()
        self._allocate_device(num_pages, max_seqs, max_pages_per_seq)
        if self.storage is not None:
            self.storage.copy_from(old_storage, old_pages, self._host_table.shape[0])
        self.allocator.extend(num_pages)  # before re-registering page metadata, which is sized by num_pages
        for new, prev in zip((self.k_pool, self.v_pool, self.pos_pool), old):
            if new is not None:
                new[:old_pages] = prev[:old_pages]
        for name, prev in old_meta.items():
            del self.slot_metadata[name]
            self.register_slot_metadata(name, prev.dtype, self._slot_fill[name])[:old_pages] = prev[:old_pages]
        for name, prev in old_page_meta.items():
            del self.page_metadata[name]
            self.register_page_metadata(name, tuple(prev.shape[2:]), prev.dtype)[:old_pages] = prev[:old_pages]
        rows_before, L = self._host_table.shape[0], self.layout.num_layers
        table = np.zeros((max_seqs, L, max_pages_per_seq), dtype=np.int32)
        table[:rows_before, :, : self._host_table.shape[2]] = self._host_table
        lengths = np.zeros((max_seqs, L), dtype=np.int64)
        lengths[:rows_before] = self._host_lengths
        self._host_table, self._host_lengths = table, lengths
        self._table_rows, self._table_width = max_seqs, max_pages_per_seq
        owned = np.zeros((max_seqs, L), dtype=np.int64)
        owned[:rows_before] = self._owned
        self._owned = owned
        self._free_rows = list(range(max_seqs - 1, rows_before - 1, -1)) + self._free_rows
        self._dirty_rows = set(range(max_seqs))
        self.flush()

    # ------------------------------------------------------------------ metadata registration
    def register_slot_metadata(self, name: str, dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """A pool-shaped ``[num_pages, kv_heads, page_size]`` tensor that moves with its token."""
        if name not in self.slot_metadata:
            t = page_indexed(torch.full(self.pos_pool.shape, fill, dtype=dtype, device=self.layout.device))
            self.slot_metadata[name] = t
            self._slot_fill[name] = fill
        return self.slot_metadata[name]

    def register_page_metadata(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``[num_pages, kv_heads, *shape]`` tensor indexed by page (e.g. per-page key min/max)."""
        if name not in self.page_metadata:
            t = page_indexed(torch.zeros(self.num_pages + 1, self.layout.num_kv_heads, *shape, dtype=dtype,
                                         device=self.layout.device))
            self.page_metadata[name] = t
        return self.page_metadata[name]

    def track_key_bounds(self, kmin: str, kmax: str) -> None:
        """Keep per-page key bounds: page metadata ``kmin``, ``kmax [num_pages + 1, kv_heads, head_dim]`` (the KV
        dtype) hold the per-channel minimum and maximum key of every page and KV head, updated by every KV write
        (``kv_write_bounds``: the decode step's in the same launch). A page's first write resets them."""
        if self.storage is not None:
            raise ValueError("key bounds are kept over dense pages only, not over a storage format's codes")
        for name in (kmin, kmax):
            self.register_page_metadata(name, (self.layout.head_dim,), self.layout.dtype)
        self.key_bounds = (kmin, kmax)

    # ------------------------------------------------------------------ sequences (host)
    @property
    def live_rows(self) -> list[int]:
        return sorted(self._live_rows)

    def add_sequence(self) -> int:
        if not self._free_rows:
            raise OutOfPages(f"all {self.max_seqs} sequence rows are in use")
        row = self._free_rows.pop()
        self._live_rows.add(row)
        return row

    def release_sequence(self, row: int) -> None:
        """Free every page of ``row`` and return the row."""
        self._check_row(row)
        # one call for every layer: atomic (a bad page raises before anything is freed) and one vectorised pass
        self.allocator.free(self._held_pages([row] * self.layout.num_layers, range(self.layout.num_layers))[0])
        if self.storage is not None:  # what the storage keeps per row outside the pages (KIVI's held prompts)
            self.storage.on_release(row)
        self._owned[row] = 0
        self._host_lengths[row] = 0
        self._host_table[row] = 0
        self._live_rows.discard(row)
        self._shared_rows.discard(row)
        self._holes.discard(row)
        self._free_rows.append(row)
        self._dirty_rows.add(row)

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

    # ---- storage-format adjustments of page sharing (page_sharing.py)
    def fork_sequence(self, row: int) -> int:
        new = super().fork_sequence(row)
        if self.storage is not None:
            self.storage.fork_row(row, new)
        return new

    def prepare_writes(self, rows: list[int], from_slots: np.ndarray) -> int:
        return super().prepare_writes(rows, self._written_from(from_slots))

    def pages_to_copy(self, rows: list[int], from_slots: np.ndarray) -> int:
        return super().pages_to_copy(rows, self._written_from(from_slots))

    def _written_from(self, from_slots: np.ndarray) -> np.ndarray:
        """A step appending after ``from_slots`` may also write earlier slots (KIVI quantizes from ``Q(from)``)."""
        return from_slots if self.storage is None else self.storage.written_from(np.asarray(from_slots))


def _runs(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair ``i`` covers table indices ``first[i] .. first[i] + counts[i] - 1``: every such index, pair after pair,
    as ``(pair, index)`` int64 arrays of length ``counts.sum()``."""
    pair = np.repeat(np.arange(len(counts)), counts)
    return pair, first[pair] + np.arange(len(pair)) - np.repeat(np.cumsum(counts) - counts, counts)
