"""Prometheus metrics of the server, in a registry of its own (several servers can live in one process).

Per-request counters and histograms are fed by the engine thread as outputs arrive; the engine-wide gauges
(running / waiting requests, free / total KV pages, preemptions) are read at scrape time from the latest
stats snapshot the engine thread took, so a scrape never touches the (not thread-safe) engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .reuse_metrics import ReuseStatsCollector

PREFIX = "sparsecompile"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineStatsCollector(Collector):
    """Yields the engine-wide gauges from ``snapshot()`` (an ``EngineStats`` or None before the first one)."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        if stats is None:
            return
        gauges = (("num_requests_running", "Requests being generated (scheduled in the running batch).",
                   stats.num_running),
                  ("num_requests_waiting", "Requests queued for admission or preempted.", stats.num_waiting),
                  ("kv_pages_free", "Free pages of the paged KV cache pool.", stats.free_pages),
                  ("kv_pages_total", "Pages of the paged KV cache pool.", stats.total_pages))
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=value)
        yield CounterMetricFamily(f"{PREFIX}_num_preemptions", "Requests preempted (pages reclaimed) so far.",
                                  value=stats.num_preemptions)


class ServerMetrics:
    """The server's metrics; ``render()`` gives the Prometheus text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished", "Requests finished, by finish reason (stop, length, abort).",
            ["finish_reason"], registry=self.registry)
        self.requests_rejected = Counter(
            f"{PREFIX}_requests_rejected", "Requests refused with an HTTP error status.", ["status"],
            registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of the admitted requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Seconds from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Seconds from a request's arrival to its end (any reason).",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(finish_reason=reason)  # exposed as 0 before the first one

    def attach_engine_stats(self, snapshot: Callable[[], Any]) -> None:
        """Expose the engine-wide gauges, read from ``snapshot()`` (an ``EngineStats``) at every scrape."""
        self.registry.register(_EngineStatsCollector(snapshot))
        self.registry.register(ReuseStatsCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
