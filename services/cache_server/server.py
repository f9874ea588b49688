"""Builds and runs the gRPC server: servicer, auth, health, reflection, expiry, metrics, drain.

Lifecycle:
1. `build_server(options)` binds the port, reserves the host tier's shared
   memory under a name derived from the bound address (or `--shm-name`;
   tiers/shm.py reclaims a dead predecessor's, refuses a live one's), starts the server and the expiry
   ticker (`cache.expire()` every `expire_interval_s`), then sets health to
   SERVING for "" and "prefixcache.v1.PrefixCache"; the latter (readiness) is NOT_SERVING
   while the service cannot take new work (`CacheServer.full`), "" (liveness) stays SERVING.
   Beside the segment it listens on the control socket (control_socket.py: same-host engines'
   Lookup, Reserve, Commit and Release, the same handlers without gRPC), unless told not to.
2. `shutdown(grace_s)` (SIGTERM in `serve`): health NOT_SERVING, new calls get
   UNAVAILABLE, calls in flight (Fetch streams included) get up to the grace
   period to finish, then the rest are cancelled, the server and the control socket
   stop (its file unlinked), the ticker stops, and the cache closes: leases and
   reservations vanish with it and the host tier's shared-memory segment is unlinked.

Shutdown bound: `shutdown` returns within the grace period plus `SHUTDOWN_BOUND_S`,
plus the Redis write-queue drain when a Redis tier is configured (`RedisTier.close`).
Handlers cancelled at the end of the grace period get `HANDLER_EXIT_S` to return;
the host tier is unmapped only once no handler is copying out of it (the backend's
`TierFence`), and if one still were after `backend.FENCE_S`, the segment is unlinked
but left mapped until the process exits: no handler ever reads unmapped memory.

Defaults are conservative: 127.0.0.1, explicit message-size limits,
keepalive, a bound on calls held at once (RESOURCE_EXHAUSTED with a retry hint beyond it;
health checks and Release are exempt: pools.Admission).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixcache import control_frames
from prefixcache.tiers.shm import segment_name_for

from .auth import AuthInterceptor
from .backend import CacheBackend
from .control_socket import ControlSocketServer
from .kv_events import KvEventPublisher
from .metrics import ServiceMetrics, disk_stats_of, remote_stats_of
from .options import ServerOptions
from .pools import (
    HEALTH_METHODS,
    Admission,
    ByteBudget,
    CountingPool,
    ElasticPool,
    StreamsOnOwnPool,
    StreamWatch,
    TenantShares,
)
from .refusals import AttachRefusals
from .servicer import SERVICE_NAME, Limits, PrefixCacheServicer, register, unary_handlers
from .status import CallTracker

log = logging.getLogger(__name__)

HANDLER_EXIT_S = 0.5  # cancelled handlers return at their next send; a stream handler copies <= 4 MiB first
# The exporter is unauthenticated and service-wide: it binds beyond loopback only when told to
# (--metrics-host), never because --listen does (issue 33).
METRICS_DEFAULT_HOST = "127.0.0.1"
LOAD_CHECK_S = 0.25  # how often health is set from the load (CacheServer.full)
SHUTDOWN_BOUND_S = 1.0  # past the grace period: cancel, HANDLER_EXIT_S, FENCE_S and the unmap, with margin


class Ticker:
    """Calls `fn` every `interval_s` on a daemon thread until stopped."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[], object]) -> None:
        self._stop = threading.Event()
        self._fn = fn
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._fn()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _no_observer(_method: str, _code: grpc.StatusCode, _seconds: float) -> None:
    return None


class CacheServer:
    """One running service; see the module docstring for its lifecycle."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.backend = CacheBackend(options.backend)
        self.tracker = CallTracker()
        self.metrics = (
            ServiceMetrics(
                self.backend.stats,
                remote=lambda: remote_stats_of(self.backend.cache),
                disk=lambda: disk_stats_of(self.backend.cache),
            )
            if options.metrics_port is not None
            else None
        )
        self.health = health.HealthServicer()
        self._ticker = Ticker("prefixcache-expire", options.expire_interval_s, self.backend.expire)
        self.kv_events: KvEventPublisher | None = None
        self.control: ControlSocketServer | None = None
        self._stopped = threading.Event()
        self._shutdown_lock = threading.Lock()
        self.port = 0
        self.metrics_port: int | None = None
        # Unary calls on a few threads, streams on their own (pools.py says why).
        self.unary_pool = ElasticPool(options.workers, options.workers + options.max_concurrent_rpcs, "rpc")
        self.stream_pool = CountingPool(options.stream_workers, "rpc-stream")
        self.control_pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="rpc-control")
        self.admission = Admission(
            options.max_concurrent_rpcs,
            (self.unary_pool, self.stream_pool),
            self.control_pool,
            HEALTH_METHODS | {f"/{SERVICE_NAME}/Release"},
        )
        self.streams = StreamWatch(options.stream_idle_timeout_s, options.stream_timeout_s)
        self.store_buffers = ByteBudget(options.max_store_buffer_bytes or options.backend.cache.host_capacity)
        tenants = {principal.tenant for principal in options.authenticator.principals}
        self.shares = (  # one tenant cannot take every call slot or stream thread from the others
            TenantShares(
                {
                    "calls": max(1, int(options.max_concurrent_rpcs * options.tenant_share)),
                    "streams": max(1, int(options.stream_workers * options.tenant_share)),
                }
            )
            if len(tenants) > 1
            else None
        )
        # Readiness: prefixcache.v1.PrefixCache says NOT_SERVING while the service cannot take
        # new work (every stream thread held, or the calls held at --max-concurrent-rpcs), so a
        # balancer sends work elsewhere; "" (liveness) stays SERVING: a busy pod is not restarted.
        self._load_ticker = Ticker("prefixcache-load", LOAD_CHECK_S, self._report_load)
        self._full = False
        self.refusals = AttachRefusals()
        if self.metrics is not None:
            self.metrics.watch_handlers(self.unary_pool.load)
            self.metrics.watch_refusals(self.refusals.by_field)
        self._server = self._build_grpc()

    def _build_grpc(self) -> grpc.Server:
        options = self.options
        denied = self.metrics.denied if self.metrics else None
        interceptors: list[grpc.ServerInterceptor] = [self.admission, StreamsOnOwnPool(self.stream_pool)]
        if options.authenticator.enabled:
            interceptors.append(AuthInterceptor(options.authenticator, denied))
        server = grpc.server(self.unary_pool, interceptors=interceptors, options=options.grpc_options())
        limits = Limits(options.backend.block_size, options.backend.cache.max_prompt_tokens, options.max_chunk_bytes)
        servicer = PrefixCacheServicer(
            self.backend, options.authenticator, limits, self.streams, self.store_buffers, self.shares, self.refusals
        )
        observe = self.metrics.observe if self.metrics else _no_observer
        register(server, servicer, self.tracker, observe)
        self._servicer, self._observe = servicer, observe
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        return server

    def _bind(self) -> int:
        options = self.options
        try:
            if options.tls_cert_file:
                assert options.tls_key_file is not None  # ServerOptions: both or neither
                with open(options.tls_key_file, "rb") as key, open(options.tls_cert_file, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                return self._server.add_secure_port(options.listen, credentials)
            return self._server.add_insecure_port(options.listen)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {options.listen}: {error}") from None

    @property
    def address(self) -> str:
        host = self.options.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def start(self) -> CacheServer:
        self.port = self._bind()
        # Named after the bound address, so a successor on it finds (and reclaims) a dead predecessor's segment.
        segment = self.options.backend.shm_name or segment_name_for(self.options.host, self.port)
        self.backend.claim_segment(segment, owner=self.address)
        self._start_control_socket(segment)
        self._server.start()
        self._ticker.start()
        self._load_ticker.start()
        if self.options.kv_events_endpoint is not None:
            self.kv_events = KvEventPublisher(
                lambda: self.backend.cache, self.options.kv_events_endpoint, self.options.kv_events_replay_endpoint
            )
        if self.metrics is not None:
            assert self.options.metrics_port is not None  # the exporter exists only with a port
            self.metrics_port = self.metrics.serve(
                self.options.metrics_host or METRICS_DEFAULT_HOST, self.options.metrics_port
            )
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving prefixcache.v1 on %s (%s, auth %s)",
            self.address,
            "TLS" if self.options.tls_cert_file else "plaintext",
            "on" if self.options.authenticator.enabled else "off",
        )
        return self

    def _start_control_socket(self, segment: str) -> None:
        """Listen beside the host tier's segment for same-host calls (control_socket.py), where
        the platform has Unix sockets; without it engines call over gRPC, as before."""
        if not self.options.control_socket or not sys.platform.startswith("linux"):
            return
        handlers = unary_handlers(self._servicer, self.tracker, self._observe)
        try:
            self.control = ControlSocketServer(
                control_frames.socket_path(segment),
                handlers,
                self.options.authenticator,
                self.options.max_concurrent_rpcs,
                on_denied=self.metrics.denied if self.metrics else None,
            ).start()
        except OSError as error:  # e.g. another user's file at that path: engines keep gRPC
            log.warning("no control socket for segment %s (%s); same-host calls go over gRPC", segment, error)
            return
        self._servicer.control_socket = self.control.path

    def shutdown(self, grace_s: float | None = None) -> None:
        """Drain and stop (idempotent); see the module docstring."""
        with self._shutdown_lock:
            if self._stopped.is_set():
                return
            grace = self.options.grace_s if grace_s is None else grace_s
            self.health.enter_graceful_shutdown()
            self.backend.begin_drain()
            log.info("draining: %d call(s) in flight, grace %.1fs", self.tracker.in_flight, grace)
            deadline = time.monotonic() + grace
            if not self.tracker.wait_idle(grace):
                log.warning("grace period over with %d call(s) in flight; cancelling them", self.tracker.in_flight)
            # Every cache handler has returned (or run out of time), but a stream's last
            # messages may still be on their way: let gRPC finish sending them within what
            # is left of the grace period (an open health Watch can hold it that long).
            self._server.stop(max(0.0, deadline - time.monotonic())).wait()
            if self.control is not None:
                self.control.close()
            copying = self.backend.copies_in_progress()
            if copying:  # unmapping now would pull the memory from under them (SIGSEGV)
                log.info("%d handler(s) copying out of the host tier as the server stopped; waiting for them", copying)
            # gRPC's stop cancels the calls but does not wait for their handler threads:
            # give them a bounded moment to return, so that few are left inside the tiers.
            if not self.tracker.wait_idle(HANDLER_EXIT_S):
                log.warning(
                    "%d handler(s) still running %.1fs after cancelling; closing around them",
                    self.tracker.in_flight,
                    HANDLER_EXIT_S,
                )
            self._stop_pools()
            self._ticker.stop()
            self._load_ticker.stop()
            self.streams.close()
            if self.kv_events is not None:
                self.kv_events.close()  # publishes the last changes first
            self.backend.close()
            if self.metrics is not None:
                self.metrics.close()
            self._stopped.set()
            log.info("stopped")

    def full(self) -> bool:
        """The service cannot take new work now: every stream thread is held, or the calls held
        have reached --max-concurrent-rpcs."""
        options = self.options
        return self.stream_pool.held >= options.stream_workers or self.admission.held() >= options.max_concurrent_rpcs

    def _report_load(self) -> None:
        full = self.full()
        if full == self._full or self._stopped.is_set():
            return
        self._full = full
        if full:
            log.warning("health NOT_SERVING: every stream thread or --max-concurrent-rpcs is taken")
        else:
            log.info("health SERVING: new work is taken again")
        state = health_pb2.HealthCheckResponse.NOT_SERVING if full else health_pb2.HealthCheckResponse.SERVING
        self.health.set(SERVICE_NAME, state)  # (ignored once draining: then it stays NOT_SERVING)

    def _stop_pools(self) -> None:
        # gRPC leaves the executors it was given running; their threads are idle by now.
        self.unary_pool.shutdown(wait=False, cancel_futures=True)
        self.stream_pool.shutdown(wait=False, cancel_futures=True)
        self.control_pool.shutdown(wait=False, cancel_futures=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)


def build_server(options: ServerOptions) -> CacheServer:
    """A started server (health SERVING); call `shutdown()` to drain and stop it."""
    server = CacheServer(options)
    try:
        return server.start()
    except BaseException:
        server._server.stop(0)
        if server.control is not None:
            server.control.close()
        server._stop_pools()
        server._ticker.stop()
        server._load_ticker.stop()
        server.streams.close()
        server.backend.close()
        raise
