"""KV reuse across requests: the chain cache and the prefix cache over one engine's CacheManager.

:class:`KVReuse` is the scheduler's :class:`~sparsecompile.serving.scheduler.ReuseIndex` (lookup / attach /
reclaim, and the reclaimable ledger) and the engine's hooks for what a request leaves behind:

* **chains** (``chain_cache.py``), any method: a request with a ``chain_id`` that finishes (stop / length) leaves
  its row idle under that id: retained KV of every layer and the method's per-row state, untouched. A request
  whose prompt extends the chain's processed tokens reattaches the row and prefills only the rest, with positions
  continuing from the boundary; its prompt chunks are fed like any prompt's (SnapKV compresses again at the end,
  H2O keeps evicting chunk-wise with its persistent scores). Anything else prefills from scratch and the request's
  metrics say why. Cancellation or preemption invalidates a reattached chain (its row is freed).
* **prefix blocks** (``prefix_cache.py``), methods that keep every token in order (``keeps_all_tokens``): full
  pages shared by reference; a hit attaches them to a fresh row and always leaves one prompt token to compute.

Memory: idle chains and unreferenced blocks hold pages nobody reserved; :meth:`KVReuse.reclaimable_pages` is that
ledger, reclaimed least recently used first (chains and blocks on one clock) before an admission waits or a decode
step preempts. Idle chains also hold manager rows: at most ``max_idle_chains``, the least recently used one going
first past that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..runtime.controller import SparseController
from .chain_cache import Chain, ChainIndex, digest
from .prefix_cache import PrefixCache, PrefixStats
from .request import Request, Resume


@dataclass
class ReuseStats:
    """Counters (since the engine started) and gauges of KV reuse."""

    chain_hits: int = 0
    chain_misses: dict[str, int] = field(default_factory=dict)  # by reason
    chains_reclaimed: int = 0  # idle chains freed to make room (memory or rows)
    chains_invalidated: int = 0  # by cancellation, preemption or failure
    chain_suffix_tokens: int = 0  # prompt tokens prefilled by chain continuations
    chain_reused_tokens: int = 0  # prompt tokens chain continuations did not recompute
    compressed_continuations: int = 0  # continuations of a pruned chain (compressed history)
    idle_chains: int = 0
    prefix: PrefixStats = field(default_factory=PrefixStats)
    cached_blocks: int = 0
    reclaimable_pages: int = 0


def fingerprint(controller: SparseController, model_name: str = "") -> int:
    """What a chain's state depends on besides the tokens: the method and its options, the engine's page and chunk
    sizes (H2O's kept set depends on where chunks end) and the KV layout."""
    rt, layout = controller.runtime, controller.layout
    options = sorted(dataclasses.asdict(rt.config).items()) if dataclasses.is_dataclass(rt.config) else []
    desc = (rt.name, options, controller.config.page_size, controller.prefill_chunk, layout.num_layers,
            layout.num_kv_heads, layout.head_dim, str(layout.dtype), model_name)
    return xxhash.xxh3_64_intdigest(repr(desc).encode())


#: Why a method that does not keep every token as written has no prefix cache.
_NOT_SHARED = "rewrites its pages as it runs (eviction, or kivi's quantization of the tokens that leave its residual)"


class KVReuse:
    """See module docstring. ``prefix_caching`` needs a method that keeps every token."""

    def __init__(self, controller: SparseController, fingerprint: int, *, prefix_caching: bool = False,
                 max_idle_chains: int = 64) -> None:
        if prefix_caching and not controller.runtime.keeps_all_tokens:
            raise ValueError(f"enable_prefix_caching needs a method that keeps every token as written (vanilla, quest, "
                             f"omnikv); {controller.runtime.name} {_NOT_SHARED}, so its pages cannot be shared by "
                             "prefix: pass a chain_id per conversation instead (chain cache)")
        self.controller = controller
        self.manager = controller.manager
        self.fingerprint = fingerprint
        self.chains = ChainIndex(fingerprint)
        self.prefix = PrefixCache(self.manager, fingerprint.to_bytes(8, "little")) if prefix_caching else None
        self.max_idle_chains = max_idle_chains
        self.counters = ReuseStats()
        self._clock = 0
        self._arrays: dict[int, tuple[int, np.ndarray]] = {}  # id(request) -> (tokens, array of them)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn the prefix cache on or off while nothing runs (benchmarks compare both on one engine); its idle blocks
        are freed."""
        if enabled and not self.controller.runtime.keeps_all_tokens:
            raise ValueError(f"{self.controller.runtime.name} {_NOT_SHARED}: it has no prefix cache (use chains)")
        if self.prefix is not None:
            if self.prefix.idle_pages != self.prefix.num_layers * len(self.prefix.blocks):
                raise RuntimeError("prefix blocks are in use; switch the prefix cache only while nothing runs")
            self.prefix.clear_idle()
        self.prefix = PrefixCache(self.manager, self.fingerprint.to_bytes(8, "little")) if enabled else None

    # ------------------------------------------------------------------ ledger
    def reclaimable_pages(self) -> int:
        return self.chains.idle_pages + (self.prefix.idle_pages if self.prefix is not None else 0)

    def stats(self) -> ReuseStats:
        s = dataclasses.replace(self.counters, chain_misses=dict(self.counters.chain_misses),
                                prefix=dataclasses.replace(self.prefix.stats if self.prefix else PrefixStats()))
        s.idle_chains = len(self.chains)
        s.cached_blocks = len(self.prefix.blocks) if self.prefix is not None else 0
        s.reclaimable_pages = self.reclaimable_pages()
        return s

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _tokens(self, request: Request, count: int) -> np.ndarray:
        """``(prompt_ids + output_ids)[:count]`` as int64, memoised per request while it grows."""
        cached = self._arrays.get(id(request))
        if cached is None or cached[0] < count:
            every = request.prompt_ids + request.output_ids
            cached = (len(every), np.asarray(every, dtype=np.int64))
            self._arrays[id(request)] = cached
        return cached[1][:count]

    def _held_pages(self, row: int) -> int:
        return sum(len(self.manager.pages_of(row, layer)) for layer in range(self.manager.layout.num_layers))

    # ------------------------------------------------------------------ scheduler side
    def lookup(self, request: Request, resume_chain: bool = True) -> Resume | None:
        """``resume_chain`` False: not the request's idle chain (a miss, ``too_large``: resuming it needs more than
        the whole pool; the chain stays idle until the request parks its own state under the id)."""
        if request.chain_id is None and self.prefix is None:
            return None
        tokens = self._tokens(request, len(request.prefill_ids))
        resume = Resume()
        if request.chain_id is not None and not resume_chain:
            resume.miss = "too_large"
        elif request.chain_id is not None:
            chain, why = self.chains.match(request.chain_id, tokens)
            if chain is not None:
                resident = self.manager.slot_count_array([chain.row])[0].tolist()
                return Resume(chain.num_tokens, chain.pages, resident, chain=chain)
            resume.miss = why
            if why in ("prefix_mismatch", "fingerprint", "no_suffix"):  # the session moved on: its state is stale
                self._drop(self.chains.remove(request.chain_id, "replaced"))
        if self.prefix is not None:
            limit = (len(tokens) - 1) // self.prefix.page_size  # leave one token to compute the logits from
            resume.blocks = self.prefix.match(tokens, request.block_keys, limit)
            resume.tokens = len(resume.blocks) * self.prefix.page_size
            resume.idle_pages = self.prefix.idle_pages_of(resume.blocks)
        return resume

    def attach(self, request: Request, resume: Resume) -> None:
        now = self._tick()
        c, m = self.counters, request.metrics
        n = len(request.prefill_ids)
        if resume.chain is not None:
            chain = self.chains.take(request.chain_id)
            assert chain is resume.chain
            request.row, request.resumed, request.chain = chain.row, list(resume.resident), chain
            chain.last_used = now
            c.chain_hits += 1
            c.chain_suffix_tokens += n - resume.tokens
            c.chain_reused_tokens += resume.tokens
            c.compressed_continuations += int(chain.compressed)
            m.chain_hit, m.chain_miss_reason, m.compressed_history = True, None, chain.compressed
        else:
            if request.chain_id is not None:
                c.chain_misses[resume.miss] = c.chain_misses.get(resume.miss, 0) + 1
                m.chain_hit, m.chain_miss_reason, m.compressed_history = False, resume.miss, False
            if resume.blocks:
                request.row = self.controller.add_sequences(1)[0]
                self.prefix.attach(request.row, resume.blocks, now)
            if self.prefix is not None:
                self.prefix.stats.queries += n
                self.prefix.stats.hits += resume.tokens
                self.prefix.stats.hit_requests += int(bool(resume.blocks))
        request.num_prefilled = request.num_computed = resume.tokens
        m.num_cached_tokens = resume.tokens

    def reclaim(self, pages: int, protect: Resume | None) -> int:
        start = self.reclaimable_pages()
        keep = {b.key for b in protect.blocks} if protect is not None else set()
        while start - self.reclaimable_pages() < pages:
            chain = self.chains.oldest(protect.chain if protect is not None else None)
            block = self.prefix.oldest_idle(keep) if self.prefix is not None else None
            if chain is None and block is None:
                break
            if block is None or (chain is not None and chain.last_used <= block.last_used):
                self._drop(self.chains.remove(chain.chain_id, "reclaimed"))
                self.counters.chains_reclaimed += 1
            else:
                self.prefix.evict(block)
        return start - self.reclaimable_pages()

    # ------------------------------------------------------------------ engine side
    def progress(self, request: Request) -> None:
        """After a prompt chunk: cache the row's new full blocks (the prompt so far), so concurrent requests with the
        same prefix hit them already."""
        if self.prefix is not None and request.row is not None:
            self.prefix.insert(request.row, self._tokens(request, request.num_computed), request.block_keys,
                               self._tick())

    def finish(self, request: Request, keep: bool) -> None:
        """``request`` ended (the scheduler dropped its reservation): park its row as a chain (``keep``, with a chain
        id), or cache its full blocks and free the row. A cancelled request invalidates its chain id."""
        row, chain_id = request.row, request.chain_id
        request.row = None
        tokens = self._tokens(request, request.num_computed) if row is not None else None
        self._arrays.pop(id(request), None)
        if row is None:
            if chain_id is not None and not keep:
                self._invalidate(chain_id)
            return
        if self.prefix is not None:
            self.prefix.insert(row, tokens, request.block_keys, self._tick())
        reattached, request.chain = request.chain, None
        if reattached is not None:
            self.chains.release_active(chain_id)
        if not (keep and chain_id is not None):
            self._free_row(row)
            if chain_id is not None:
                self._invalidate(chain_id)
                self.counters.chains_invalidated += int(reattached is not None)
            return
        compressed = reattached.compressed if reattached is not None else False
        self._park(Chain(chain_id, row, self.fingerprint, tokens.astype(np.int32), digest(tokens),
                         self._held_pages(row), self._tick(), compressed))

    def preempted(self, request: Request) -> None:
        """``request`` was preempted: cache its full blocks, free its row; a reattached chain is gone."""
        row = request.row
        request.row = None
        if row is None:
            return
        if self.prefix is not None:
            self.prefix.insert(row, self._tokens(request, request.num_computed), request.block_keys, self._tick())
        self._free_row(row)
        if request.chain is not None:
            self.chains.release_active(request.chain_id)
            self.chains.forget(request.chain_id, "invalidated")
            self.counters.chains_invalidated += 1
            request.chain = None

    def _park(self, chain: Chain) -> None:
        self._drop(self.chains.park(chain))
        while len(self.chains) > self.max_idle_chains:  # rows: idle chains may hold at most this many
            self._drop(self.chains.remove(self.chains.oldest().chain_id, "reclaimed"))
            self.counters.chains_reclaimed += 1

    def _invalidate(self, chain_id: str) -> None:
        chain = self.chains.remove(chain_id, "invalidated")
        if chain is not None:
            self._drop(chain)
            self.counters.chains_invalidated += 1

    def _drop(self, chain: Chain | None) -> None:
        if chain is not None:
            self._free_row(chain.row)

    def _free_row(self, row: int) -> None:
        if self.prefix is not None:
            self.prefix.release_row(row)
        self.controller.release_rows([row])

    # ------------------------------------------------------------------ API over idle chains
    def fork_chain(self, source: str, chain_id: str) -> None:
        """A new idle chain ``chain_id`` holding the same state as the idle chain ``source`` (pages shared
        copy-on-write, method state copied): continuing either never changes the other."""
        chain = self.chains.idle.get(source)
        if chain is None:
            raise KeyError(f"no idle chain {source!r} to fork (unknown, running, or reclaimed)")
        if chain_id in self.chains.idle or self.chains.active.get(chain_id):
            state = "idle" if chain_id in self.chains.idle else "in use"
            raise ValueError(f"chain {chain_id!r} already exists ({state}); fork_chain needs a new chain id "
                             "(drop_chain it first to replace it)")
        while len(self.chains) >= self.max_idle_chains:  # a row for the fork
            oldest = self.chains.oldest(protect=chain)
            if oldest is None:  # the source is the only idle chain: nothing to reclaim for the fork's row
                raise ValueError(f"max_idle_chains={self.max_idle_chains} leaves no row for a fork beside {source!r}; "
                                 "serve with a larger max_idle_chains")
            self._drop(self.chains.remove(oldest.chain_id, "reclaimed"))
            self.counters.chains_reclaimed += 1
        row = self.controller.fork_rows([chain.row])[0]
        if self.prefix is not None:
            self.prefix.fork_row(chain.row, row)
        self._park(Chain(chain_id, row, chain.fingerprint, chain.tokens, chain.digest, chain.pages, self._tick(),
                         chain.compressed))

    def drop_chain(self, chain_id: str) -> bool:
        """Free the idle chain ``chain_id`` now; False if there is none."""
        chain = self.chains.remove(chain_id, "dropped")
        self._drop(chain)
        return chain is not None

    def reset_prefix_cache(self) -> int:
        """Evict every idle prefix block (blocks in use stay); returns the pages freed."""
        return self.prefix.clear_idle() if self.prefix is not None else 0

    def release_idle(self) -> None:
        """Free every idle chain and idle prefix block."""
        for chain_id in list(self.chains.idle):
            self.drop_chain(chain_id)
        self.reset_prefix_cache()
