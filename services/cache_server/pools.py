"""Handler threads: a few for unary calls, room made while one waits on Redis, streams apart.

gRPC Python's sync server runs each call on a thread of an executor. On a small machine the
GIL makes every extra runnable thread a cost: with 16 Lookups in flight, 16 handler threads
spend about three times the CPU per call of 2 threads (wake-ups and GIL hand-offs, measured
with benchmarks/service_bench.py; docs/benchmarks.md). So unary calls run on an `ElasticPool`, which runs at most
`active` of them at once and queues the rest, and a handler about to wait on the network (a
Lookup reading Redis) says so with `waiting()`: the pool runs one more call meanwhile, so a
slow Redis cannot hold local hits up behind it.

Streams (Fetch, Store, reflection) hold their thread for as long as the peer reads or
writes, so `StreamsOnOwnPool` moves every streaming handler onto a plain pool of their own
(through the handler attribute `experimental_thread_pool`, which gRPC's own health service
uses; tests/test_handler_pools.py fails if a gRPC release stops honouring it).

`Admission` bounds the calls of new work held at once (`--max-concurrent-rpcs`: queued for
a thread or running, on both pools) and refuses the rest with RESOURCE_EXHAUSTED and a retry
hint (trailer `prefixcache-retry-after-ms`). Health checks and Release are never refused for
load and never wait behind other calls: they run on a small pool of their own. (gRPC's own
`maximum_concurrent_rpcs` is not used: it counts health checks and Release like any call.)

`StreamWatch` cancels a stream whose peer stalls (idle or too long in all), so stalled peers
cannot keep the stream threads; `ByteBudget` bounds what Store streams buffer at once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from prefixcache.client.errors import RETRY_METADATA

_current = threading.local()  # .pool: the ElasticPool whose worker this thread is


class ElasticPool(futures.ThreadPoolExecutor):
    """Runs at most `active` calls at once, plus one for each call inside `waiting()`,
    on at most `max_threads` threads. Only `submit` and `shutdown` are used by gRPC."""

    def __init__(self, active: int, max_threads: int, name: str) -> None:
        if not 1 <= active <= max_threads:
            raise ValueError(f"need 1 <= active ({active}) <= max_threads ({max_threads})")
        super().__init__(max_workers=max_threads, thread_name_prefix=name)  # never starts its own threads
        self.active = active
        self.max_threads = max_threads
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[futures.Future, Callable, tuple, dict]] = deque()
        self._workers: list[threading.Thread] = []
        self._running = 0  # calls started and not finished
        self._waiting = 0  # of those, calls inside waiting()
        self._idle = 0  # threads parked for work
        self._notified = 0  # parked threads notified and not yet up
        self._pending = 0  # threads notified or started for a queued call and not yet up
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queue.append((future, fn, args, kwargs))
            self._start_one()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._closed = True
            while cancel_futures and self._queue:
                self._queue.popleft()[0].cancel()
            self._cond.notify_all()
            threads = list(self._workers)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    @property
    def threads(self) -> int:
        return len(self._workers)

    @property
    def held(self) -> int:
        """Calls queued or running."""
        with self._cond:
            return len(self._queue) + self._running

    def load(self) -> dict[str, int]:
        """Calls by state, for the metrics exporter: queued for a thread, running, waiting (of running)."""
        with self._cond:
            return {"queued": len(self._queue), "running": self._running, "waiting": self._waiting}

    def _may_start(self) -> bool:
        """A worker may take a queued call now (lock held)."""
        return bool(self._queue) and self._running - self._waiting < self.active

    def _start_one(self) -> None:
        """Wake a parked thread, or start one, if a queued call may run and no thread is
        already on its way to it (lock held)."""
        if len(self._queue) <= self._pending or self._running + self._pending - self._waiting >= self.active:
            return
        self._pending += 1
        if self._idle > self._notified:
            self._notified += 1
            self._cond.notify()
        elif len(self._workers) < self.max_threads:
            thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True)
            self._workers.append(thread)
            thread.start()
        else:
            self._pending -= 1  # every thread is busy: the first to finish takes the call

    def _work(self) -> None:
        _current.pool = self
        with self._cond:
            self._pending -= 1  # up
            call = self._next_call()
        while call is not None:
            future, fn, args, kwargs = call
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 - handed to the future, as the stdlib pool does
                    future.set_exception(error)
                else:
                    future.set_result(result)
            with self._cond:  # one critical section: no other thread is started for the next call
                self._running -= 1
                call = self._next_call()

    def _next_call(self) -> tuple[futures.Future, Callable, tuple, dict] | None:
        """The next call this thread runs, once it may; None when closed and drained (lock held)."""
        while not self._closed and not self._may_start():
            self._idle += 1
            self._cond.wait()  # no spurious wake-ups: only notify() (one of ours) or close
            self._idle -= 1
            if self._notified:
                self._notified -= 1
                self._pending -= 1
        if not self._queue:
            return None
        self._running += 1
        return self._queue.popleft()

    @contextlib.contextmanager
    def _waiting_section(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._start_one()
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= 1


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a blocking wait (network I/O): if this thread runs calls of an `ElasticPool`,
    the pool may run another call until the wait is over. Elsewhere it does nothing."""
    pool = getattr(_current, "pool", None)
    if pool is None:
        yield
        return
    with pool._waiting_section():
        yield


def _on_pool(behavior: Callable, pool: futures.ThreadPoolExecutor) -> Callable:
    moved = functools.partial(behavior)
    moved.experimental_thread_pool = pool  # type: ignore[attr-defined]  # grpc reads this off the behavior
    return moved


class StreamsOnOwnPool(grpc.ServerInterceptor):
    """Every streaming handler runs on `pool`; unary handlers stay on the server's pool.

    A handler already given a pool, or one that does not hold a thread while its stream is
    open (gRPC's non-blocking health Watch), is left as it is."""

    def __init__(self, pool: futures.ThreadPoolExecutor) -> None:
        self._pool = pool
        self._moved: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # method -> (as found, as run)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        moved = self._moved.get(handler_call_details.method)
        if moved is None or moved[0] is not handler:
            moved = (handler, self._move(handler))
            self._moved[handler_call_details.method] = moved
        return moved[1]

    def _move(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        field = (
            ("stream_stream" if handler.response_streaming else "stream_unary")
            if handler.request_streaming
            else "unary_stream"
        )
        behavior = getattr(handler, field)
        if getattr(behavior, "experimental_thread_pool", None) is not None or getattr(
            behavior, "experimental_non_blocking", False
        ):
            return handler
        return handler._replace(**{field: _on_pool(behavior, self._pool)})


class CountingPool(futures.ThreadPoolExecutor):
    """A plain pool that knows how many calls it holds (queued or running)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._count_lock = threading.Lock()
        self._held = 0

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        with self._count_lock:
            self._held += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)  # also runs for a future cancelled at shutdown
        return future

    def _done(self, _future) -> None:
        with self._count_lock:
            self._held -= 1

    @property
    def held(self) -> int:
        return self._held


HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class Admission(grpc.ServerInterceptor):
    """New work beyond `limit` calls held by `pools` is refused with RESOURCE_EXHAUSTED and a
    retry hint; `control` methods (health, Release) are never refused and run on `control_pool`.

    The count is the pools' own (queued or running), so a call cancelled before its handler
    ran is never counted twice or leaked."""

    def __init__(
        self,
        limit: int,
        pools: tuple,
        control_pool: futures.ThreadPoolExecutor,
        control: frozenset[str],
        retry_after_ms: int = 100,
    ) -> None:
        self._limit = limit
        self._pools = pools
        self._control_pool = control_pool
        self._control = control
        self._retry_after_ms = retry_after_ms
        self._moved: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def held(self) -> int:
        return sum(pool.held for pool in self._pools)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        if method in self._control:
            if handler.request_streaming or handler.response_streaming:
                return handler  # the health Watch: non-blocking, holds no thread
            moved = self._moved.get(method)
            if moved is None or moved[0] is not handler:
                moved = (handler, handler._replace(unary_unary=_on_pool(handler.unary_unary, self._control_pool)))
                self._moved[method] = moved
            return moved[1]
        held = self.held()
        if held < self._limit:
            return handler
        return self._refusal(handler, held)

    def _refusal(self, handler: grpc.RpcMethodHandler, held: int) -> grpc.RpcMethodHandler:
        details = (
            f"overloaded: {held} calls held, the limit is {self._limit} (--max-concurrent-rpcs); "
            f"retry after {self._retry_after_ms} ms or on another instance"
        )
        trailer = ((RETRY_METADATA, str(self._retry_after_ms)),)

        def refuse(_request, context):
            context.set_trailing_metadata(trailer)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)

        refuse = _on_pool(refuse, self._control_pool)  # answered at once, not queued behind the load
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class StreamWatch:
    """Ends streams whose peer stalls: a Fetch or Store with no message through for `idle_s`, or
    open for `total_s` in all, is cancelled (the peer sees CANCELLED), which frees its thread.

    Why: a stream holds a thread of `StreamsOnOwnPool`'s pool while it is open, blocked in gRPC
    on the peer (a Store waiting for its next message, a Fetch whose peer does not read), and
    nothing else ever ends it; 16 stalled streams held every stream thread for good. One daemon
    thread checks every `tick_s`; a handler marks progress after each message (`Watched.moved`)."""

    def __init__(self, idle_s: float, total_s: float, tick_s: float = 0.25) -> None:
        self.idle_s = idle_s
        self.total_s = total_s
        self._lock = threading.Lock()
        self._open: dict[int, Watched] = {}
        self._next = 0
        self.cancelled = {"idle": 0, "total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(tick_s,), name="rpc-stream-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watching(self, context: grpc.ServicerContext) -> Iterator[Watched]:
        now = time.monotonic()
        with self._lock:
            self._next += 1
            watched = Watched(self._next, context, now)
            self._open[watched.key] = watched
        try:
            yield watched
        finally:
            with self._lock:
                self._open.pop(watched.key, None)

    def open_streams(self) -> int:
        with self._lock:
            return len(self._open)

    def _run(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            now = time.monotonic()
            with self._lock:
                due = []
                for watched in list(self._open.values()):
                    reason = (
                        "total"
                        if now - watched.started > self.total_s
                        else "idle"
                        if now - watched.last > self.idle_s
                        else None
                    )
                    if reason is not None:
                        del self._open[watched.key]
                        self.cancelled[reason] += 1
                        due.append(watched)
            for watched in due:
                watched.context.cancel()  # wakes the handler blocked on the peer; its thread returns

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Watched:
    """One open stream under a `StreamWatch`."""

    __slots__ = ("key", "context", "started", "last")

    def __init__(self, key: int, context: grpc.ServicerContext, now: float) -> None:
        self.key = key
        self.context = context
        self.started = now
        self.last = now

    def moved(self) -> None:
        self.last = time.monotonic()


class ByteBudget:
    """Bytes that Store streams may buffer at once (each buffers its whole payload before the
    store); a stream that does not fit is refused at its header, before any byte is buffered."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.used = 0

    @contextlib.contextmanager
    def holding(self, nbytes: int, refuse: Callable[[int, int], BaseException]) -> Iterator[None]:
        with self._lock:
            if self.used + nbytes > self.limit:
                raise refuse(self.used, self.limit)
            self.used += nbytes
        try:
            yield
        finally:
            with self._lock:
                self.used -= nbytes


class TenantShares:
    """In multi-tenant mode, each tenant may hold at most a share of the service's unary calls
    (`--max-concurrent-rpcs`) and of its stream threads (`--stream-workers`) at once; a call
    beyond its tenant's share is refused (RESOURCE_EXHAUSTED) when it starts, so one tenant
    can no longer take every thread or call slot from the others. A call is counted from its
    handler's start until gRPC ends it (`context.add_callback`)."""

    def __init__(self, shares: dict[str, int]) -> None:
        self.shares = shares  # kind ("calls", "streams") -> most held by one tenant
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}

    def enter(self, kind: str, tenant: str, context: grpc.ServicerContext, refuse: Callable[[int], Exception]) -> None:
        key = (kind, tenant)
        with self._lock:
            if self._held.get(key, 0) >= self.shares[kind]:
                raise refuse(self.shares[kind])
            self._held[key] = self._held.get(key, 0) + 1
        if not context.add_callback(functools.partial(self._leave, key)):
            self._leave(key)  # the call is over already

    def held(self, kind: str, tenant: str) -> int:
        with self._lock:
            return self._held.get((kind, tenant), 0)

    def _leave(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
