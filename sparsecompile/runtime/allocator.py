"""Reference-counted page allocator for the paged KV pool (host side)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing was allocated."""


class BlockAllocator:
    """Hands out page ids ``0..num_pages-1`` with reference counts.

    ``allocate`` returns pages with count 1; ``incref`` shares a page (a forked sequence, a cached prefix
    block); ``free`` decrements and returns a page to the free list when its count reaches zero. A page
    with count > 1 is shared: whoever writes to it copies it first (``CacheManager`` copy-on-write).
    Every failure raises before any state changes, so the allocator is never left half-updated.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = np.zeros(num_pages, dtype=np.int64)
        # The free pages as a stack in a numpy buffer (``_stack[:_top]``; a page is free at most once, so
        # ``num_pages`` entries always suffice), popped from the top: low page ids are handed out first, which keeps
        # small runs compact. An array, not a Python list: a 128K prompt takes 262,144 pages at once on the 8B shape,
        # and a list's conversions to and from numpy cost milliseconds of host time while the GPU waits.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    @property
    def free_list(self) -> list[int]:
        """The free pages, bottom of the stack first (the last one is handed out next)."""
        return self._stack[:self._top].tolist()

    def extend(self, num_pages: int) -> None:
        """Grow the pool to ``num_pages`` pages; the new ones are free (at the bottom of the stack)."""
        if num_pages < self.num_pages:
            raise ValueError(f"cannot shrink the pool from {self.num_pages} to {num_pages} pages")
        self._refcount = np.concatenate([self._refcount, np.zeros(num_pages - self.num_pages, dtype=np.int64)])
        new = np.arange(num_pages - 1, self.num_pages - 1, -1, dtype=np.int64)
        stack = np.empty(num_pages, dtype=np.int64)
        stack[:new.size], stack[new.size:new.size + self._top] = new, self._stack[:self._top]
        self._stack, self._top, self.num_pages = stack, new.size + self._top, num_pages

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def refcounts(self, pages: np.ndarray) -> np.ndarray:
        """Reference counts of ``pages`` (any int array shape), vectorised."""
        return self._refcount[pages]

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free pages (count 1 each), as an int64 array in pop order; raises :class:`OutOfPages` if fewer
        are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._top:
            raise OutOfPages(f"asked for {n} pages, {self._top} of {self.num_pages} are free")
        pages = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._refcount[pages] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        arr = self._live(pages)
        np.add.at(self._refcount, arr, 1)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; pages reaching zero return to the free list (in the order of their
        last reference in ``pages``)."""
        arr = self._live(pages)
        if arr.size == 0:
            return
        uniq, first_from_end, counts = np.unique(arr[::-1], return_index=True, return_counts=True)
        over = counts > self._refcount[uniq]
        if over.any():
            page = int(uniq[over][0])
            raise ValueError(f"page {page} freed more times than it is referenced ({self._refcount[page]})")
        self._refcount[uniq] -= counts
        zero = self._refcount[uniq] == 0
        last = arr.size - 1 - first_from_end[zero]
        released = uniq[zero][np.argsort(last, kind="stable")]
        self._stack[self._top:self._top + released.size] = released
        self._top += released.size

    def _live(self, pages: Iterable[int]) -> np.ndarray:
        """``pages`` as an int64 array, every one inside the pool and allocated (else ValueError, nothing changed)."""
        arr = np.asarray(pages if isinstance(pages, np.ndarray) else list(pages), dtype=np.int64).reshape(-1)
        outside = (arr < 0) | (arr >= self.num_pages)
        if outside.any():
            raise ValueError(f"page {int(arr[outside][0])} is outside the pool (0..{self.num_pages - 1})")
        dead = self._refcount[arr] == 0
        if dead.any():
            raise ValueError(f"page {int(arr[dead][0])} is not allocated (double free or use after free)")
        return arr
