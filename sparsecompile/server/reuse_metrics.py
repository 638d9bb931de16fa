"""Prometheus metrics of KV reuse across requests: the chain cache and the prefix cache (``serving/reuse.py``).

Read at scrape time from the engine's latest stats snapshot (``EngineStats.reuse``), like the other engine-wide
gauges, so a scrape never touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "sparsecompile"
MISS_REASONS = ("unknown_chain", "in_use", "fingerprint", "prefix_mismatch", "no_suffix", "reclaimed", "invalidated",
                "dropped", "replaced", "too_large")


class ReuseStatsCollector(Collector):
    """Chain hits / misses by reason / reclaimed / suffix tokens, prefix-cache queries and hits, the idle ledger."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        reuse = getattr(stats, "reuse", None)
        if reuse is None:
            return
        counters = (
            ("chain_hits", "Requests that reattached an idle chain (multi-turn KV reuse).", reuse.chain_hits),
            ("chains_reclaimed", "Idle chains freed to make room (least recently used first).",
             reuse.chains_reclaimed),
            ("chains_invalidated", "Chains dropped by cancellation, preemption or failure.", reuse.chains_invalidated),
            ("chain_suffix_tokens", "Prompt tokens prefilled by chain continuations (the new part only).",
             reuse.chain_suffix_tokens),
            ("chain_reused_tokens", "Prompt tokens chain continuations did not recompute.", reuse.chain_reused_tokens),
            ("compressed_history_continuations", "Continuations of a chain whose history was pruned.",
             reuse.compressed_continuations),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", reuse.prefix.queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not recomputed).", reuse.prefix.hits),
            ("prefix_cache_evicted_blocks", "Prefix-cache blocks evicted to make room.", reuse.prefix.evicted),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=value)
        misses = CounterMetricFamily(f"{PREFIX}_chain_misses", "Requests with a chain_id that prefilled from scratch, "
                                     "by reason.", labels=["reason"])
        for reason in sorted(set(MISS_REASONS) | set(reuse.chain_misses)):
            misses.add_metric([reason], reuse.chain_misses.get(reason, 0))
        yield misses
        gauges = (("idle_chains", "Chains idle between turns (KV kept for a continuation).", reuse.idle_chains),
                  ("prefix_cache_blocks", "Blocks (one full page per layer) in the prefix cache.", reuse.cached_blocks),
                  ("kv_pages_reclaimable", "KV pages held by idle chains and unused prefix blocks.",
                   reuse.reclaimable_pages))
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=value)
