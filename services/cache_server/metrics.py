"""Prometheus exporter of the service: cache counters from `StatsSnapshot`, RPC counts and latencies,
the Redis tier's counters, op latency histograms and breaker state, and process/platform metrics.

Cache figures are read from `cache.stats()` at scrape time (a collector), so
they are never out of step with GetStats; the Redis tier's from its own
`RedisStats` (`RemoteCollector`). RPC counts and durations are recorded by the
servicer wrappers (status.py).

Invariants:
- Every label has a closed set of values (method name, gRPC status code, tier,
  eviction reason, miss reason, Redis event, op, side, breaker state); no token
  id, prompt, salt, tenant or namespace id ever becomes a label.
- One metric type per name: counters end in `_total` and only grow (so `rate()`
  applies to them, tests/test_cli.py checks the dashboard), gauges never do.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.breaker import BreakerState
from prefixcache.stats import STATS, TIER_STATS, Kind, Stat, StatsSnapshot
from prefixcache.tiers.disk import DiskStats
from prefixcache.tiers.redis_stats import LatencySnapshot, RedisStats

log = logging.getLogger(__name__)

PREFIX = "prefixcache"
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class StatsCollector(Collector):
    """Turns one `StatsSnapshot` into metric families at each scrape, as `stats.STATS` names them."""

    def __init__(self, source: Callable[[], StatsSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self._source()
        ready = GaugeMetricFamily(f"{PREFIX}_ready", "1 once the first Attach created the cache")
        ready.add_metric([], 0.0 if snapshot is None else 1.0)
        yield ready
        if snapshot is None:
            return
        for stat in STATS:
            value = getattr(snapshot, stat.name)
            if stat.metric_name is not None and value is not None:
                yield _family(stat, _samples(value, len(stat.labels)))
        for stat in TIER_STATS:
            yield _family(stat, (([tier.kind.label], getattr(tier, stat.name)) for tier in snapshot.tiers))


def _family(stat: Stat, samples: Iterable[tuple[list[str], float]]) -> Metric:
    kind = CounterMetricFamily if stat.kind is Kind.COUNTER else GaugeMetricFamily
    family = kind(f"{PREFIX}_{stat.metric_name}", stat.help, labels=[label.name for label in stat.labels])
    for labels, value in samples:
        family.add_metric(labels, float(value))
    return family


def _samples(value: Any, depth: int) -> Iterator[tuple[list[str], float]]:
    """(label values, number) of a scalar (a bool is 1 or 0), a dict, or a dict of dicts."""
    if depth == 0:
        yield [], float(value)
        return
    for key, inner in value.items():
        for labels, number in _samples(inner, depth - 1):
            yield [key, *labels], number


# RedisStats counters exported as prefixcache_remote_events_total{event=...} (counts of things).
REMOTE_EVENTS = (
    "hits",
    "misses",
    "reads_skipped",
    "read_errors",
    "spills_queued",
    "spills_dropped",
    "writes_failed",
    "integrity_failures",
    "oversized_replies",
    "read_deadlines",
    "write_deadlines",
    "probes_declined",
    "probe_blocks_declined",
)
BREAKER_SIDES = ("read", "write")


# DiskStats counters exported as prefixcache_disk_events_total{event=...}.
DISK_EVENTS = (
    "hits",
    "misses",
    "admitted",
    "rejected",
    "dropped",
    "integrity_failures",
    "io_errors",
    "reads_declined",
)


def disk_stats_of(cache) -> DiskStats | None:
    """The disk tier's stats of a cache (None: no cache yet, or no disk tier)."""
    disk = None if cache is None else cache.disk
    return None if disk is None else disk.stats()


class DiskCollector(Collector):
    """The disk tier at each scrape (tiers/disk.py): whether it is on, events, bytes, occupancy."""

    def __init__(self, source: Callable[[], DiskStats | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats is None:
            return
        yield GaugeMetricFamily(
            f"{PREFIX}_disk_up", "1 while the disk tier is on (0: off after an I/O error)", stats.up
        )
        events = CounterMetricFamily(f"{PREFIX}_disk_events", "Disk tier events by kind", labels=["event"])
        for event in DISK_EVENTS:
            events.add_metric([event], getattr(stats, event))
        yield events
        evictions = CounterMetricFamily(f"{PREFIX}_disk_evictions", "Blocks evicted from disk", labels=["reason"])
        evictions.add_metric(["lru"], stats.evictions_lru)
        evictions.add_metric(["ttl"], stats.evictions_ttl)
        yield evictions
        moved = CounterMetricFamily(
            f"{PREFIX}_disk_bytes", "Frame bytes read from / written to disk", labels=["direction"]
        )
        moved.add_metric(["read"], stats.bytes_read)
        moved.add_metric(["written"], stats.bytes_written)
        yield moved
        yield GaugeMetricFamily(f"{PREFIX}_disk_blocks", "Blocks on disk", stats.blocks)
        yield GaugeMetricFamily(
            f"{PREFIX}_disk_pinned_blocks", "Blocks on disk kept for operator pins (the pin book)", stats.pinned_blocks
        )
        yield GaugeMetricFamily(f"{PREFIX}_disk_used_bytes", "Frame bytes on disk", stats.used_bytes)
        yield GaugeMetricFamily(f"{PREFIX}_disk_capacity_bytes", "The disk tier's byte budget", stats.capacity_bytes)
        yield GaugeMetricFamily(
            f"{PREFIX}_disk_restore_seconds", "Time the index took to rebuild at start", stats.restore_s
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_disk_read_latency_seconds",
            "The disk reads' estimated latency (0: none timed)",
            stats.read_latency_s,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_disk_read_bytes_per_second",
            "The disk reads' estimated bandwidth (0: none timed)",
            stats.read_bytes_per_s,
        )


def remote_stats_of(cache) -> RedisStats | None:
    """The Redis tier's stats of a cache (None: no cache yet, or no Redis tier)."""
    link = None if cache is None else cache.remote_link
    stats = None if link is None else link.stats()
    return stats if isinstance(stats, RedisStats) else None


def _histogram(name: str, text: str, label: str, series: dict[str, LatencySnapshot]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text, labels=[label])
    for value, snapshot in series.items():
        bounds = [f"{b:g}" for b in snapshot.bounds_s] + ["+Inf"]
        family.add_metric([value], list(zip(bounds, snapshot.cumulative())), sum_value=snapshot.sum_s)
    return family


def _breaker_state(stats: RedisStats, side: str) -> BreakerState:
    # Hook: a tier with one breaker per side exposes `read_state` / `write_state`; until then
    # both sides report the one breaker that guards them.
    return getattr(stats, f"{side}_state", stats.state)


class RemoteCollector(Collector):
    """The Redis tier at each scrape: counters, gauges, op latency histograms, breaker state."""

    def __init__(self, source: Callable[[], RedisStats | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats is None:
            return
        events = CounterMetricFamily(f"{PREFIX}_remote_events", "Redis tier events by kind", labels=["event"])
        for name in REMOTE_EVENTS:
            events.add_metric([name], getattr(stats, name))
        transferred = CounterMetricFamily(
            f"{PREFIX}_remote_bytes", "Bytes read from / written to Redis", labels=["direction"]
        )
        transferred.add_metric(["read"], stats.bytes_read)
        transferred.add_metric(["write"], stats.bytes_written)
        trips = CounterMetricFamily(f"{PREFIX}_remote_breaker_trips", "Times the breaker took the tier down")
        trips.add_metric([], stats.breaker_trips)
        state = GaugeMetricFamily(
            f"{PREFIX}_remote_breaker_state",
            "1 for the breaker's current state, per side (up: calls go through)",
            labels=["side", "state"],
        )
        for side in BREAKER_SIDES:
            current = _breaker_state(stats, side)
            for candidate in BreakerState:
                state.add_metric([side, candidate.value], 1.0 if candidate is current else 0.0)
        queue = GaugeMetricFamily(f"{PREFIX}_remote_queue_bytes", "Bytes queued for Redis writes")
        queue.add_metric([], stats.queue_bytes)
        latency = GaugeMetricFamily(f"{PREFIX}_remote_link_latency_seconds", "Estimated Redis round trip")
        latency.add_metric([], stats.link_latency_s)
        bandwidth = GaugeMetricFamily(f"{PREFIX}_remote_link_bytes_per_second", "Estimated Redis bandwidth")
        bandwidth.add_metric([], stats.link_bytes_per_s)
        pace = GaugeMetricFamily(
            f"{PREFIX}_remote_write_set_seconds", "Measured time per Redis SET (sizes the writer's batches)"
        )
        pace.add_metric([], stats.write_set_s)
        durations = _histogram(
            f"{PREFIX}_remote_op_duration_seconds",
            "Redis operation time (read: one pipelined fetch, write: one batch of SETs)",
            "op",
            {"read": stats.read_latency, "write": stats.write_latency},
        )
        yield from (events, transferred, trips, state, queue, latency, bandwidth, pace, durations)


class HandlerCollector(Collector):
    """Unary calls by state at each scrape: queued for a handler thread, running, and (of the
    running) waiting on Redis. A queue that stays long means the service is saturated."""

    def __init__(self, load: Callable[[], dict[str, int]]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        calls = GaugeMetricFamily(
            f"{PREFIX}_unary_calls", "Unary calls by state (queued, running, waiting)", labels=["state"]
        )
        for state, n in self._load().items():
            calls.add_metric([state], n)
        yield calls


class RefusalCollector(Collector):
    """Refused Attach calls by the request field refused (refusals.py), read at each scrape."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            f"{PREFIX}_attach_refusals",
            "Attach calls refused, by the field refused (the engine then runs without the cache)",
            labels=["field"],
        )
        for field, n in sorted(self._counts().items()):
            refused.add_metric([field], n)
        yield refused


def add_process_collectors(registry: CollectorRegistry) -> None:
    """process_* (CPU, memory, file descriptors; Linux), python_info and python_gc_*."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *_args) -> None:  # one line per scrape is noise
        return None


class ServiceMetrics:
    """The registry the exporter serves; `observe` is the servicer's per-call hook."""

    def __init__(
        self,
        source: Callable[[], StatsSnapshot | None],
        remote: Callable[[], RedisStats | None] | None = None,
        disk: Callable[[], DiskStats | None] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        add_process_collectors(self.registry)
        self._rpcs = Counter(
            f"{PREFIX}_rpcs", "RPCs by method and status code", ["method", "code"], registry=self.registry
        )
        self._latency = Histogram(
            f"{PREFIX}_rpc_duration_seconds",
            "RPC handling time (Lookup is the hot path)",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._denied = Counter(
            f"{PREFIX}_auth_denied", "Calls refused for a missing or wrong token", registry=self.registry
        )
        self.registry.register(StatsCollector(source))
        if remote is not None:
            self.registry.register(RemoteCollector(remote))
        if disk is not None:
            self.registry.register(DiskCollector(disk))
        self._http: WSGIServer | None = None

    def watch_handlers(self, load: Callable[[], dict[str, int]]) -> None:
        self.registry.register(HandlerCollector(load))

    def watch_refusals(self, counts: Callable[[], dict[str, int]]) -> None:
        self.registry.register(RefusalCollector(counts))

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self._rpcs.labels(method, code.name).inc()
        self._latency.labels(method).observe(seconds)

    def denied(self, _method: str) -> None:
        self._denied.inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter; returns the bound port."""
        self._http = http = make_server(
            host, port, make_wsgi_app(self.registry), _Server6 if ":" in host else _Server, handler_class=_QuietHandler
        )
        threading.Thread(
            target=http.serve_forever, kwargs={"poll_interval": 0.05}, name="prefixcache-metrics", daemon=True
        ).start()
        bound = http.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
