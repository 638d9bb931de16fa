"""Radix prefix cache of full KV pages, for methods that keep every token in order (vanilla, quest, omnikv).

A *block* is one full page of ``page_size`` tokens in every layer: slot ``i`` of every layer holds token ``i``
when nothing is evicted, so the ``i``-th page of each layer of a row holds block ``i``. A block costs
``num_layers`` pool pages; its page metadata (Quest's per-page key min / max) rides with the pages.

Keys: ``h_i = xxh3_64(h_{i-1} || tokens of block i || fingerprint)`` (``h_{-1}`` = 0), so one key names the whole
prefix up to its block and the index is a radix tree of blocks (a block's parent is the one before it). A lookup
walks the prompt's keys from the root and stops at the first miss; the tokens stored with each block are compared
too, so a hash collision is a miss, never a wrong hit.

Sharing: the cache holds one allocator reference to each block page; a row that uses a block holds another (an
attached hit, ``CacheManager.attach_pages``, or the row that computed it). ``users`` counts the live rows holding
a block. A block nobody uses is *idle*: its pages are reclaimable, and idle leaves are evicted least recently used
first (evicting an inner block would orphan its children, so a parent becomes evictable once its last child goes).
Full pages are never written again by these methods (appends go to later pages), so no copy-on-write is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..runtime.cache_manager import CacheManager


@dataclass(eq=False)
class Block:
    """One cached full page per layer."""

    key: int
    parent: Block | None
    tokens: np.ndarray  # [page_size] int64, checked on lookup
    pages: list[int]  # one pool page per layer
    users: int = 0  # live rows holding these pages
    children: int = 0
    last_used: int = 0


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found (attached, not recomputed)
    inserted: int = 0  # blocks inserted
    evicted: int = 0  # blocks evicted to make room
    hit_requests: int = 0


@dataclass
class _RowBlocks:
    """The blocks whose pages one live row holds (its first ones, in order), and the next block index to insert;
    ``done``: a block of the row was already cached with another row's pages, so nothing below it is inserted."""

    blocks: list[Block] = field(default_factory=list)
    next_index: int = 0
    done: bool = False


class PrefixCache:
    """Block index over one CacheManager (see module docstring). Host-only; no device work."""

    def __init__(self, manager: CacheManager, fingerprint: bytes) -> None:
        self.manager = manager
        self.page_size = manager.layout.page_size
        self.num_layers = manager.layout.num_layers
        self.fingerprint = fingerprint
        self.blocks: dict[int, Block] = {}
        self._idle_leaves: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self.idle_pages = 0  # pages of blocks no live row holds
        self._rows: dict[int, _RowBlocks] = {}
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ keys
    def extend_keys(self, tokens: np.ndarray, keys: list[int], upto: int) -> list[int]:
        """Append to ``keys`` (the keys of ``tokens``' first ``len(keys)`` blocks) up to ``upto`` full blocks."""
        P = self.page_size
        upto = min(upto, len(tokens) // P)
        parent = keys[-1] if keys else 0
        for i in range(len(keys), upto):
            parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + tokens[i * P:(i + 1) * P].tobytes()
                                              + self.fingerprint)
            keys.append(parent)
        return keys

    def match(self, tokens: np.ndarray, keys: list[int], limit: int) -> list[Block]:
        """The cached blocks of ``tokens``' first (at most ``limit``) full blocks, from the root; ``keys`` is a
        per-request memo of block keys (extended here only as far as the walk goes)."""
        P = self.page_size
        found: list[Block] = []
        for i in range(limit):
            if i >= len(keys):
                self.extend_keys(tokens, keys, i + 1)
                if i >= len(keys):
                    break
            block = self.blocks.get(keys[i])
            if block is None or not np.array_equal(block.tokens, tokens[i * P:(i + 1) * P]):
                break
            found.append(block)
        return found

    def idle_pages_of(self, blocks: list[Block]) -> int:
        """Pages among ``blocks`` that sit in the idle ledger now."""
        return sum(self.num_layers for b in blocks if b.users == 0)

    # ------------------------------------------------------------------ rows
    def attach(self, row: int, blocks: list[Block], now: int) -> None:
        """Give the fresh ``row`` the pages of ``blocks`` (a hit): it holds them from now on."""
        if blocks:
            pages = [[b.pages[layer] for b in blocks] for layer in range(self.num_layers)]
            self.manager.attach_pages(row, pages, len(blocks) * self.page_size)
        for b in blocks:
            self._use(b)
            b.last_used = now
        self._rows[row] = _RowBlocks(list(blocks), len(blocks))

    def insert(self, row: int, tokens: np.ndarray, keys: list[int], now: int) -> None:
        """Cache ``row``'s full pages of ``tokens`` (the tokens whose KV the row holds in order) not cached yet.

        When a block's key is already cached (another row computed the same prefix at the same time), the row keeps
        its copy private and inserts nothing further: a cached block's ancestors are then always held by the rows
        that hold it, so an idle block never has a block in use below it and every idle page can be reclaimed."""
        P = self.page_size
        mine = self._rows.setdefault(row, _RowBlocks())
        full = len(tokens) // P
        if full <= mine.next_index or mine.done:
            return
        self.extend_keys(tokens, keys, full)
        pages = [self.manager.pages_of(row, layer) for layer in range(self.num_layers)]
        for i in range(mine.next_index, min(full, len(keys))):
            parent = mine.blocks[-1] if mine.blocks else None
            if keys[i] in self.blocks or (i and parent is None):
                mine.done = True
                break
            block = Block(keys[i], parent, tokens[i * P:(i + 1) * P].copy(), [p[i] for p in pages], users=1,
                          last_used=now)
            self.manager.allocator.incref(block.pages)
            self.blocks[block.key] = block
            if parent is not None:
                parent.children += 1
                self._idle_leaves.pop(parent.key, None)
            mine.blocks.append(block)
            self.stats.inserted += 1
        mine.next_index = full

    def release_row(self, row: int) -> None:
        """``row`` is about to be released: it no longer holds its blocks."""
        for b in self._rows.pop(row, _RowBlocks()).blocks:
            self._unuse(b)

    def fork_row(self, source: int, fork: int) -> None:
        """``fork`` shares ``source``'s pages (CacheManager.fork_sequence): it holds the same blocks."""
        mine = self._rows.get(source)
        if mine is None:
            return
        for b in mine.blocks:
            self._use(b)
        self._rows[fork] = _RowBlocks(list(mine.blocks), mine.next_index, mine.done)

    def _use(self, b: Block) -> None:
        if b.users == 0:
            self.idle_pages -= self.num_layers
            self._idle_leaves.pop(b.key, None)
        b.users += 1

    def _unuse(self, b: Block) -> None:
        b.users -= 1
        if b.users == 0:
            self.idle_pages += self.num_layers
            if b.children == 0:
                self._idle_leaves[b.key] = b

    # ------------------------------------------------------------------ eviction
    def oldest_idle(self, protect: set[int] = frozenset()) -> Block | None:
        """The least recently used idle leaf not in ``protect`` (block keys)."""
        return next((b for key, b in self._idle_leaves.items() if key not in protect), None)

    def evict(self, block: Block) -> int:
        """Drop an idle leaf: its pages go back to the allocator. Returns the pages freed."""
        assert block.users == 0 and block.children == 0
        del self._idle_leaves[block.key]
        del self.blocks[block.key]
        self.manager.allocator.free(block.pages)
        self.idle_pages -= self.num_layers
        self.stats.evicted += 1
        parent = block.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.users == 0:  # older than its child: evicted next
                self._idle_leaves[parent.key] = parent
                self._idle_leaves.move_to_end(parent.key, last=False)
        return self.num_layers

    def clear_idle(self) -> int:
        """Evict every idle block (leaves first, so whole idle subtrees go); returns the pages freed."""
        freed = 0
        while self._idle_leaves:
            freed += self.evict(next(iter(self._idle_leaves.values())))
        return freed

    def check(self) -> None:
        """Invariants (tests): users match the rows' holdings, the idle ledger matches, refcounts cover holders."""
        users: dict[int, int] = {}
        for mine in self._rows.values():
            for b in mine.blocks:
                users[b.key] = users.get(b.key, 0) + 1
        children: dict[int, int] = {}
        for b in self.blocks.values():
            assert users.get(b.key, 0) == b.users, (b.key, b.users)
            if b.parent is not None:
                assert self.blocks.get(b.parent.key) is b.parent
                children[b.parent.key] = children.get(b.parent.key, 0) + 1
            rc = self.manager.allocator.refcounts(np.asarray(b.pages))
            assert (rc >= 1 + b.users).all(), (b.key, rc, b.users)
        for b in self.blocks.values():
            assert children.get(b.key, 0) == b.children
            if b.users and b.parent is not None:  # blocks in use pin their ancestors: idle pages are reclaimable
                assert b.parent.users >= b.users
        assert self.idle_pages == sum(self.num_layers for b in self.blocks.values() if b.users == 0)
        assert set(self._idle_leaves) == {b.key for b in self.blocks.values() if b.users == 0 and b.children == 0}
