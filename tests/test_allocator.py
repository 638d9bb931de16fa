"""Allocator and CacheManager invariants under arbitrary operation sequences (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsecompile.runtime.allocator import BlockAllocator, OutOfPages
from sparsecompile.runtime.cache_manager import CacheManager, KVLayout


class AllocatorMachine(RuleBasedStateMachine):
    """Model: a dict page -> refcount. Every failure must leave the allocator unchanged."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(24)
        self.refs: dict[int, int] = {}

    def _snapshot(self):
        return (self.alloc.num_free, [self.alloc.refcount(p) for p in range(self.alloc.num_pages)])

    @rule(n=st.integers(0, 30))
    def allocate(self, n):
        before = self._snapshot()
        if n > self.alloc.num_free:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n)
            assert self._snapshot() == before
            return
        free = self.alloc.free_list
        tail = free[len(free) - n:]
        pages = self.alloc.allocate(n).tolist()
        assert len(set(pages)) == n and pages == tail[::-1]  # popped from the end of the free list, in pop order
        for p in pages:
            assert p not in self.refs
            self.refs[p] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.incref([page])
        self.refs[page] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, max_size=4))
        counts = {p: pages.count(p) for p in pages}
        before = self._snapshot()
        if any(c > self.refs[p] for p, c in counts.items()):
            with pytest.raises(ValueError):
                self.alloc.free(pages)
            assert self._snapshot() == before
            return
        self.alloc.free(pages)
        for p, c in counts.items():
            self.refs[p] -= c
        # pages reaching zero join the free list's end in the order of their last reference (the loop's order)
        zeroed = [p for i, p in enumerate(pages) if self.refs[p] == 0 and p not in pages[i + 1:]]
        free = self.alloc.free_list
        assert free[len(free) - len(zeroed):] == zeroed
        for p in zeroed:
            del self.refs[p]

    @rule(page=st.integers(-2, 30))
    def free_unallocated(self, page):
        if page in self.refs:
            return
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.alloc.free([page])
        assert self._snapshot() == before

    @rule(extra=st.integers(0, 4))
    def extend(self, extra):
        self.alloc.extend(self.alloc.num_pages + extra)

    @invariant()
    def consistent(self):
        assert self.alloc.num_free + len(self.refs) == self.alloc.num_pages
        for p in range(self.alloc.num_pages):
            assert self.alloc.refcount(p) == self.refs.get(p, 0)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _layout(layers=3, heads=2, page=4):
    return KVLayout(layers, heads, 8, page, torch.float32, torch.device("cpu"))


class ManagerMachine(RuleBasedStateMachine):
    """Sequences grow, shrink, get released; the manager can grow. No page leaks or is shared."""

    def __init__(self):
        super().__init__()
        self.m = CacheManager(_layout(), num_pages=20, max_seqs=4, max_pages_per_seq=6)
        self.counts: dict[int, np.ndarray] = {}

    @rule()
    def add(self):
        if len(self.counts) == self.m.max_seqs:
            with pytest.raises(OutOfPages):
                self.m.add_sequence()
            return
        self.counts[self.m.add_sequence()] = np.zeros(3, dtype=np.int64)

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def grow_slots(self, data):
        rows = data.draw(st.lists(st.sampled_from(sorted(self.counts)), min_size=1, max_size=3, unique=True))
        extra = np.array([[data.draw(st.integers(0, 9)) for _ in range(3)] for _ in rows])
        new = np.stack([self.counts[r] for r in rows]) + extra
        free_before = self.m.allocator.num_free
        try:
            self.m.ensure_slots(rows, new)
        except OutOfPages:
            assert self.m.allocator.num_free == free_before
            for r in rows:
                assert self.m.slot_counts(r) == self.counts[r].tolist()
            return
        for r, c in zip(rows, new):
            self.counts[r] = c.copy()

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def truncate(self, data):
        row = data.draw(st.sampled_from(sorted(self.counts)))
        layer = data.draw(st.integers(0, 2))
        count = data.draw(st.integers(0, int(self.counts[row][layer])))
        self.m.truncate(row, layer, count)
        self.counts[row][layer] = count

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def truncate_many(self, data):
        """Several pairs at once (an evicting decode step); one pair asked to grow makes it refuse, unchanged."""
        pairs = data.draw(st.lists(st.tuples(st.sampled_from(sorted(self.counts)), st.integers(0, 2)), min_size=1,
                                   max_size=4, unique=True))
        counts = [data.draw(st.integers(0, int(self.counts[r][layer]) + data.draw(st.sampled_from([0, 0, 0, 1]))))
                  for r, layer in pairs]
        free_before = self.m.allocator.num_free
        if any(c > self.counts[r][layer] for (r, layer), c in zip(pairs, counts)):
            with pytest.raises(ValueError, match="only"):
                self.m.truncate_many(*zip(*pairs), counts)
            assert self.m.allocator.num_free == free_before
            return
        self.m.truncate_many(*zip(*pairs), counts)
        for (r, layer), c in zip(pairs, counts):
            self.counts[r][layer] = c

    @precondition(lambda self: self.counts)
    @rule(data=st.data())
    def release(self, data):
        row = data.draw(st.sampled_from(sorted(self.counts)))
        self.m.release_sequence(row)
        del self.counts[row]

    @rule(pages=st.integers(0, 8), rows=st.integers(0, 2), width=st.integers(0, 3))
    def grow_pool(self, pages, rows, width):
        self.m.grow(self.m.num_pages + pages, self.m.max_seqs + rows, self.m.max_pages_per_seq + width)

    @invariant()
    def no_leak_no_sharing(self):
        owned = [p for r in self.counts for layer in range(3) for p in self.m.pages_of(r, layer)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(owned) + self.m.allocator.num_free == self.m.num_pages, "a page leaked"
        for r, c in self.counts.items():
            assert self.m.slot_counts(r) == c.tolist()
            for layer in range(3):
                assert len(self.m.pages_of(r, layer)) == -(-int(c[layer]) // 4)
        self.m.flush()
        for r in self.counts:
            table = self.m.block_table[r].tolist()
            for layer in range(3):
                pages = self.m.pages_of(r, layer)
                assert table[layer][: len(pages)] == pages
            assert self.m.lengths[r].tolist() == self.counts[r].tolist()


TestCacheManager = ManagerMachine.TestCase
TestCacheManager.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
