"""Prometheus exporter of the service: cache counters from `StatsSnapshot`, RPC counts and latencies.

Cache figures are read from `cache.stats()` at scrape time (a collector), so
they are never out of step with GetStats. RPC counts and durations are
recorded by the servicer wrappers (status.py).

Invariant: every label has a closed set of values (method name, gRPC status
code, tier, eviction reason, miss reason, Redis stat name); no token id,
prompt, salt, tenant or namespace id ever becomes a label.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from typing import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.stats import StatsSnapshot

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
        remote = GaugeMetricFamily(f"{PREFIX}_remote_stat", "Remote tier counters", labels=["stat"])
        for name, value in s.remote.items():
            remote.add_metric([name], value)
        yield from (up, remote)


class HandlerCollector(Collector):
    """Unary calls by state at each scrape: queued for a handler thread, running, and (of the
    running) waiting on Redis. A queue that stays long means the service is saturated."""

    def __init__(self, load: Callable[[], dict[str, int]]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        calls = GaugeMetricFamily(f"{PREFIX}_unary_calls", "Unary calls by state (queued, running, waiting)",
                                  labels=["state"])
        for state, n in self._load().items():
            calls.add_metric([state], n)
        yield calls


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *_args) -> None:  # one line per scrape is noise
        return None


class ServiceMetrics:
    """The registry the exporter serves; `observe` is the servicer's per-call hook."""

    def __init__(self, source: Callable[[], StatsSnapshot | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._rpcs = Counter(f"{PREFIX}_rpcs", "RPCs by method and status code", ["method", "code"],
                             registry=self.registry)
        self._latency = Histogram(f"{PREFIX}_rpc_duration_seconds", "RPC handling time (Lookup is the hot path)",
                                  ["method"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._denied = Counter(f"{PREFIX}_auth_denied", "Calls refused for a missing or wrong token",
                               registry=self.registry)
        self.registry.register(StatsCollector(source))
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
        self._http = make_server(host, port, make_wsgi_app(self.registry), _Server6 if ":" in host else _Server,
                                 handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                         name="prefixcache-metrics", daemon=True).start()
        bound = self._http.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
