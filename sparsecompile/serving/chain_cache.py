"""The chain cache index: per-session KV state kept idle between turns (paper: Chain Cache, appendix B.2).

A chain is one CacheManager row that a finished request left behind under its ``chain_id``: the retained KV of
every layer and the method's per-row state (H2O scores, budgets, OmniKV sets), exactly as the request's last step
left them. The record holds what a continuation must match: the method / configuration fingerprint and the
*processed* token prefix, its count and xxh3 digest (the last sampled token is not in it: it was never fed, so a
continuation computes its KV). The tokens themselves are kept (int32) so a match is exact, not only by digest; the
logical prefix stays the key even when an eviction method holds a fraction of it.

Idle chains are ordered least recently used first; the owner (``reuse.py``) frees their rows when memory is short.
A chain id leaves the index when it is reattached (its row moves to the running request), dropped, reclaimed or
invalidated; the reason is remembered (bounded) so a later miss on that id can say why.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

_FORGET_AFTER = 4096  # gone-chain reasons remembered


def digest(tokens: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())


@dataclass(eq=False)
class Chain:
    """An idle (or reattached) chain."""

    chain_id: str
    row: int
    fingerprint: int
    tokens: np.ndarray  # processed boundary, int32
    digest: int
    pages: int  # pages the row held when it went idle
    last_used: int
    compressed: bool = False  # its history was pruned (interval pruning): continuations use compressed history

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class ChainIndex:
    """Idle chains by id, least recently used first (see module docstring). Host-only."""

    def __init__(self, fingerprint: int) -> None:
        self.fingerprint = fingerprint
        self.idle: OrderedDict[str, Chain] = OrderedDict()
        self.active: dict[str, int] = {}  # chain id -> running requests holding a reattached chain of that id
        self.idle_pages = 0
        self._gone: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.idle)

    def match(self, chain_id: str, prompt: np.ndarray) -> tuple[Chain | None, str | None]:
        """The idle chain ``prompt`` continues, or None and why not (``unknown_chain``, ``in_use``, ``fingerprint``,
        ``prefix_mismatch``, ``no_suffix``, or the reason the chain went away: ``reclaimed``, ``invalidated``,
        ``dropped``)."""
        chain = self.idle.get(chain_id)
        if chain is None:
            if self.active.get(chain_id):
                return None, "in_use"
            return None, self._gone.get(chain_id, "unknown_chain")
        if chain.fingerprint != self.fingerprint:
            return None, "fingerprint"
        n = chain.num_tokens
        if len(prompt) < n or digest(prompt[:n]) != chain.digest or not np.array_equal(prompt[:n], chain.tokens):
            return None, "prefix_mismatch"
        if len(prompt) == n:  # the last token must be fed to produce the first logits
            return None, "no_suffix"
        return chain, None

    def park(self, chain: Chain) -> Chain | None:
        """Make ``chain`` idle (most recently used); returns the idle chain it replaces under the same id, if any
        (the caller frees that one's row)."""
        old = self.idle.pop(chain.chain_id, None)
        if old is not None:
            self.idle_pages -= old.pages
        self.idle[chain.chain_id] = chain
        self.idle_pages += chain.pages
        self._gone.pop(chain.chain_id, None)
        return old

    def take(self, chain_id: str) -> Chain:
        """Remove an idle chain to reattach it (the id counts as in use until :meth:`release_active`)."""
        chain = self.idle.pop(chain_id)
        self.idle_pages -= chain.pages
        self.active[chain_id] = self.active.get(chain_id, 0) + 1
        return chain

    def release_active(self, chain_id: str) -> None:
        """A running request that reattached ``chain_id`` parked it again, or lost it."""
        self.active[chain_id] -= 1
        self._clean(chain_id)

    def remove(self, chain_id: str, reason: str) -> Chain | None:
        """Forget the idle chain ``chain_id`` (the caller frees its row); ``reason`` answers later misses."""
        chain = self.idle.pop(chain_id, None)
        if chain is not None:
            self.idle_pages -= chain.pages
        self.forget(chain_id, reason)
        return chain

    def forget(self, chain_id: str, reason: str) -> None:
        self._gone[chain_id] = reason
        self._gone.move_to_end(chain_id)
        while len(self._gone) > _FORGET_AFTER:
            self._gone.popitem(last=False)

    def oldest(self, protect: Chain | None = None) -> Chain | None:
        return next((c for c in self.idle.values() if c is not protect), None)

    def touch(self, chain: Chain, now: int) -> None:
        chain.last_used = now
        self.idle.move_to_end(chain.chain_id)

    def _clean(self, chain_id: str) -> None:
        if not self.active.get(chain_id):
            self.active.pop(chain_id, None)
