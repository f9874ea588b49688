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
from collections.abc import Callable, Iterator
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

from prefixcache.stats import StatsSnapshot
from prefixcache.tiers.breaker import BreakerState
from prefixcache.tiers.redis_stats import LatencySnapshot, RedisStats

log = logging.getLogger(__name__)

PREFIX = "prefixcache"
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

_COUNTERS = (
    ("lookups", "Lookups served"),
    ("request_hits", "Lookups that matched at least one block"),
    ("request_misses", "Lookups that matched nothing"),
    ("block_hits", "Full blocks found"),
    ("block_misses", "Full blocks not found"),
    ("tokens_looked_up", "Prompt tokens looked up"),
    ("tokens_saved", "Prompt tokens served from the cache"),
    ("blocks_committed", "New blocks stored"),
    ("blocks_deduplicated", "Blocks committed that were already cached"),
    ("spills_dropped", "Blocks that could not be queued for the remote tier"),
)


class StatsCollector(Collector):
    """Turns one `StatsSnapshot` into metric families at each scrape."""

    def __init__(self, source: Callable[[], StatsSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self._source()
        ready = GaugeMetricFamily(f"{PREFIX}_ready", "1 once the first Attach created the cache")
        ready.add_metric([], 0.0 if snapshot is None else 1.0)
        yield ready
        if snapshot is None:
            return
        for name, text in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=getattr(snapshot, name))
        yield from _labelled(snapshot)
        yield from _tier_gauges(snapshot)


def _labelled(s: StatsSnapshot) -> Iterator[Metric]:
    spills = CounterMetricFamily(f"{PREFIX}_spills", "Blocks moved down from a tier", labels=["tier"])
    for tier, n in s.spills.items():
        spills.add_metric([tier], n)
    promotions = CounterMetricFamily(f"{PREFIX}_promotions", "Blocks moved up into a tier", labels=["tier"])
    for tier, n in s.promotions.items():
        promotions.add_metric([tier], n)
    evictions = CounterMetricFamily(f"{PREFIX}_evictions", "Blocks evicted", labels=["tier", "reason"])
    for tier, reasons in s.evictions.items():
        for reason, n in reasons.items():
            evictions.add_metric([tier, reason], n)
    misses = CounterMetricFamily(f"{PREFIX}_miss_reasons", "Why lookups stopped", labels=["reason"])
    for reason, n in s.miss_reasons.items():
        misses.add_metric([reason], n)
    yield from (spills, promotions, evictions, misses)


def _tier_gauges(s: StatsSnapshot) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(f"{PREFIX}_tier_blocks", "Blocks resident", labels=["tier"])
    used = GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes used", labels=["tier"])
    capacity = GaugeMetricFamily(f"{PREFIX}_tier_capacity_bytes", "Byte budget", labels=["tier"])
    for tier in s.tiers:
        blocks.add_metric([tier.kind.label], tier.blocks)
        used.add_metric([tier.kind.label], tier.bytes_used)
        capacity.add_metric([tier.kind.label], tier.capacity_bytes)
    leases = GaugeMetricFamily(f"{PREFIX}_active_leases", "Leases held by workers")
    leases.add_metric([], s.active_leases)
    uptime = GaugeMetricFamily(f"{PREFIX}_uptime_seconds", "Seconds since the cache was created")
    uptime.add_metric([], s.uptime_s)
    yield from (blocks, used, capacity, leases, uptime)
    if s.remote_up is not None:
        up = GaugeMetricFamily(f"{PREFIX}_remote_up", "1 while the remote tier answers")
        up.add_metric([], 1.0 if s.remote_up else 0.0)
        yield up


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
    "probes_declined",
    "probe_blocks_declined",
)
BREAKER_SIDES = ("read", "write")


def remote_stats_of(cache) -> RedisStats | None:
    """The Redis tier's stats of a cache (None: no cache yet, or no Redis tier)."""
    link = None if cache is None else cache.remote_link
    return None if link is None else link.stats()


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
        durations = _histogram(
            f"{PREFIX}_remote_op_duration_seconds",
            "Redis operation time (read: one pipelined fetch, write: one batch of SETs)",
            "op",
            {"read": stats.read_latency, "write": stats.write_latency},
        )
        yield from (events, transferred, trips, state, queue, latency, bandwidth, durations)


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
        self, source: Callable[[], StatsSnapshot | None], remote: Callable[[], RedisStats | None] | None = None
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
        self._http = None

    def watch_handlers(self, load: Callable[[], dict[str, int]]) -> None:
        self.registry.register(HandlerCollector(load))

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self._rpcs.labels(method, code.name).inc()
        self._latency.labels(method).observe(seconds)

    def denied(self, _method: str) -> None:
        self._denied.inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter; returns the bound port."""
        self._http = make_server(
            host, port, make_wsgi_app(self.registry), _Server6 if ":" in host else _Server, handler_class=_QuietHandler
        )
        threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="prefixcache-metrics", daemon=True
        ).start()
        bound = self._http.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
