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
step, and is pushed to the device block table with :meth:`flush` (``block_tables.py``). The device is
authoritative for *what* each slot holds. Device-side operations (:meth:`write`, :meth:`build_view`,
:meth:`move_slots`; in ``slot_access.py``) contain no host synchronisation and run inside compiled decode graphs.

Physical eviction (:meth:`move_slots` + :meth:`truncate`) frees pages back to the allocator;
logical selection (:meth:`build_view` with a :class:`Selection`) only changes what attention reads.
"""

from __future__ import annotations

import numpy as np
import torch

from .allocator import BlockAllocator, OutOfPages
from .block_tables import BlockTables
from .compilation import mark_for_compile, page_indexed, static_address
from .kivi import KiviStorage
from .layout import KVLayout
from .page_sharing import SharedPages
from .slot_access import SlotAccess


class CacheManager(BlockTables, SharedPages, SlotAccess):
    """Owns the paged KV pool and every per-sequence map into it (see module docstring; the host tables' edits are
    ``block_tables.py``'s, sharing ``page_sharing.py``'s, device-side access ``slot_access.py``'s)."""

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
