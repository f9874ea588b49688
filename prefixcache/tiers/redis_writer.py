"""The Redis tier's writes: one bounded queue, the threads that empty it, and the probes.

Part of `RedisTier` (tiers/redis.py, whose docstring states the guarantees). The queue is the
compiled core's `RespWriter`: every SET, UNLINK and SCAN+UNLINK in order. Its threads:
- lane 0 (`_run`): the recovery probes, the ops Python runs (deletes, TLS and Redis Cluster
  writes, a batch whose exchange failed), and SETs streamed from the core;
- lanes 1 and up (`_run_lane`): SETs only, streamed by the core without the GIL, each on a
  connection of its own, while streaming is possible (a plain socket, writes up);
- the completer (`_complete`): hands written batches back (counters, each frame's `done`).
A lane's fault that takes writes down interrupts every lane, lane 0's wait in the core included,
so that lane 0 comes out to probe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import redis.exceptions

from ..breaker import Backoff, CircuitBreaker, Retry
from ..native import core
from .base import Frame
from .redis_link import REDIS_ERRORS, WRITE_REFUSALS, RedisLink, error_kind, key_hint, redis_code
from .redis_options import is_cluster_url
from .resp import ExchangeDeadline, RespPipeline

log = logging.getLogger(__name__)

_UNLINK_CHUNK = 500


class _Set:
    """A queued SET; `own_frames` may swap its frame for an owned copy and settle `done` early."""

    __slots__ = ("key", "frame", "ttl_ms", "nbytes", "done")

    def __init__(self, key: str, frame: Frame, ttl_ms: int, nbytes: int, done: Callable[[], None] | None) -> None:
        self.key = key
        self.frame = frame
        self.ttl_ms = ttl_ms
        self.nbytes = nbytes
        self.done = done  # called once the write is over, whatever its outcome (then None)


class _Unlink(NamedTuple):
    key: str

    @property
    def nbytes(self) -> int:
        return len(self.key)


class _UnlinkMatching(NamedTuple):
    pattern: str

    @property
    def nbytes(self) -> int:
        return len(self.pattern)


class _Expire(NamedTuple):
    """PEXPIRE of each key to its TTL, pipelined: run through Python, alone, like a delete."""

    keys: tuple[str, ...]
    ttls_ms: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(key) for key in self.keys)


_Op = _Set | _Unlink | _UnlinkMatching | _Expire
_STOP = object()
_PROBE = object()
_STREAM = object()
_POP = object()
_SET_FIRST = 1  # RespWriter.head(): a SET heads the queue
_EVERY_LANE = -1


class RedisWriter:
    """Owns the write queue and its threads (started here). `queue_bytes` and the queue's
    counts are guarded by the link's lock."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        options = link.options
        self._retry = Retry(options.write_retries, Backoff(0.01, 0.1), (redis.exceptions.ConnectionError,))
        # The write queue, in order; Cluster writes go batch by batch through redis-py, on lane 0 alone.
        self._ops = core.RespWriter(1 if is_cluster_url(options.url) else options.write_lanes)
        self._pending = 0  # ops queued, in flight or written but not yet settled
        self.queue_bytes = 0  # their bytes
        self._settling = threading.Lock()  # held while written batches are settled (own_frames waits on it)
        self._streams = True  # until a TLS connection says otherwise (RespWriter.run needs a plain socket)
        self._closing = False
        self._close_deadline = 0.0
        self._probed = False
        self._thread = threading.Thread(target=self._run, name="prefixcache-redis-writer", daemon=True)
        self._lanes = [
            threading.Thread(target=self._run_lane, args=(lane,), name=f"prefixcache-redis-writer-{lane}", daemon=True)
            for lane in range(1, self._ops.lanes)
        ]
        self._completer = threading.Thread(target=self._complete, name="prefixcache-redis-completer", daemon=True)
        for thread in (self._thread, *self._lanes, self._completer):
            thread.start()

    # ---- callers' side ------------------------------------------------------------------

    def submit(self, key: str, frame: Frame, ttl_ms: int, done: Callable[[], None] | None) -> bool:
        """Queue a SET of `frame` (read, not copied, until `done`); False (a counted drop) when
        full, down or closing."""
        nbytes = len(frame) if isinstance(frame, bytes) else sum(memoryview(part).nbytes for part in frame)
        op = _Set(key, frame, ttl_ms, nbytes, done)
        link = self._link
        with link.lock:
            if self._closing or not link.writes_up() or self.queue_bytes + nbytes > link.options.max_queue_bytes:
                link.counters.spills_dropped += 1
                return False
            self._ops.push(op, key.encode(), frame, op.ttl_ms)
            link.counters.spills_queued += 1
            self._queued_locked(op)
        return True

    def delete(self, key: str) -> None:
        """Queue an UNLINK of one key."""
        self._enqueue(_Unlink(key))

    def expire(self, keys: tuple[str, ...], ttls_ms: tuple[int, ...]) -> None:
        """Queue a PEXPIRE of each key (existing keys only) to its TTL."""
        self._enqueue(_Expire(keys, ttls_ms))

    def delete_matching(self, pattern: str) -> None:
        """Queue a SCAN+UNLINK of every key matching the glob `pattern` (on every cluster node)."""
        self._enqueue(_UnlinkMatching(pattern))

    def interrupt(self) -> None:
        """Every lane streaming from the core returns (the link went down: drop, probe)."""
        self._ops.interrupt()

    @property
    def set_seconds(self) -> float:
        """Seconds per SET measured on the link (0.0 until a batch is over), over the lanes' batches
        or those Python ran: with a batch deadline, a batch takes no more SETs than half of it fits
        (prefixcache/_resp.c)."""
        return self._ops.set_seconds

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued, in flight or unsettled."""
        with self._link.changed:
            return self._link.changed.wait_for(lambda: not self._pending, timeout_s)

    def own_frames(self, timeout_s: float) -> bool:
        """Stop reading the buffers `submit` was given: copy each queued frame that lies in them into
        bytes of its own (its `done` is called now), and wait up to `timeout_s` for the batch in
        flight, if any, to be done. False if it is not (its buffers may still be read until its
        `done`)."""
        changed = self._link.changed
        with changed:
            for op, frame in self._ops.own_queued():
                op.frame = frame
                if op.done is not None:
                    done, op.done = op.done, None
                    done()
        flight = [op for op in self._ops.flight(_EVERY_LANE) if isinstance(op, _Set)]
        self._settle_written()  # the completer may not have got to a batch already written
        with changed:
            return changed.wait_for(lambda: all(op.done is None for op in flight), timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Drain the queue until the deadline, drop the rest (counted). False if a lane is still
        running after that (a write stuck past its timeouts)."""
        link = self._link
        with link.changed:
            if not self._closing:
                self._closing = True
                self._close_deadline = link.clock() + timeout_s
                self._ops.stop(timeout_s)
            link.changed.notify_all()
        deadline = time.monotonic() + timeout_s + 2 * link.options.write_timeout_s
        for thread in (self._thread, *self._lanes):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("redis writer did not stop within %.1fs", timeout_s)
                return False
        self._ops.shutdown()  # every lane is out: the completer settles what they wrote, then stops
        self._completer.join()
        return True

    # ---- the queue's bookkeeping --------------------------------------------------------

    def _enqueue(self, op: _Unlink | _UnlinkMatching | _Expire) -> None:
        """Queue an op the writer runs through Python (in order with the SETs around it)."""
        with self._link.lock:
            if not self._closing:
                self._ops.push(op, None, None, 0)
                self._queued_locked(op)

    def _queued_locked(self, op: _Op) -> None:
        self._pending += 1
        self.queue_bytes += op.nbytes
        self._link.changed.notify_all()  # a writer waiting in Python (not streaming)

    def _settle(self, ops: list[_Op]) -> None:
        """The tier is done with these ops: call their `done`, count them out of the queue."""
        changed = self._link.changed
        dones = []
        with changed:
            for op in ops:
                if isinstance(op, _Set) and op.done is not None:
                    dones.append(op.done)
                    op.done = None
        for done in dones:
            done()
        with changed:
            self.queue_bytes -= sum(op.nbytes for op in ops)
            self._pending -= len(ops)
            changed.notify_all()

    def _drop_locked(self, ops: list[_Op]) -> None:
        self._link.counters.spills_dropped += sum(1 for op in ops if isinstance(op, _Set))

    # ---- the threads --------------------------------------------------------------------

    def _run(self) -> None:
        """Lane 0: probes, the ops Python runs, and SETs."""
        try:
            self._probe()
            while (work := self._next_work()) is not _STOP:
                if work is _PROBE:
                    self._probe()
                elif work is _STREAM:
                    self._stream(0)
                elif batch := self._pop():  # _POP: unlocked, it may wait for lanes
                    self._run_batch(0, batch)
        finally:
            self._stop_lanes()
            dropped = self._ops.drain()
            with self._link.lock:
                self._drop_locked(dropped)
            self._settle(dropped)

    def _run_lane(self, lane: int) -> None:
        """Lanes 1 and up: SETs only, while streaming is possible; once closing, until the queue is
        drained or the deadline passed (RespWriter.stop)."""
        changed = self._link.changed
        while True:
            with changed:
                while not self._closing and not self._can_stream():
                    changed.wait(1.0)  # (a recovered breaker does not notify)
                if not self._can_stream():
                    return
            self._stream(lane)
            if self._closing:
                return

    def _stop_lanes(self) -> None:
        with self._link.changed:
            self._closing = True  # (a lane waits for it; set by close() unless lane 0 died)
            self._link.changed.notify_all()
        self._ops.stop(0.0)

    def _next_work(self) -> object:
        link = self._link
        with link.changed:
            while True:
                if self._closing and (not len(self._ops) or link.clock() >= self._close_deadline):
                    return _STOP
                if link.breaker.probe_due() or (link.breaker.is_up() and link.write_breaker.probe_due()):
                    return _PROBE
                head = self._ops.head()
                if (not head or head == _SET_FIRST) and self._can_stream():
                    return _STREAM  # waits for work in the core, without the GIL
                if head:
                    return _POP
                # Sleep until new work, close, or (while down) the next probe.
                down = link.breaker if not link.breaker.is_up() else link.write_breaker
                link.changed.wait(None if down.is_up() else down.seconds_until_probe())

    def _can_stream(self) -> bool:
        return self._streams and isinstance(self._link.write_client, redis.Redis) and self._link.writes_up()

    def _stream(self, lane: int) -> None:
        """Let the core write SETs from the queue's head on `lane` until it stops (RespWriter.run)."""
        options = self._link.options
        writer = self._link.write_client
        if not isinstance(writer, redis.Redis):  # (_can_stream said it was; a lane may race a rebuild)
            return
        try:
            if not RespPipeline(writer, options.write_deadline_s).stream(self._ops, options.max_batch, lane):
                self._streams = False  # TLS: its socket methods need the GIL; lane 0 goes batch by batch
            return
        except REDIS_ERRORS as exc:
            self._count_write_deadline(exc)
            batch = self._ops.flight(lane) or (self._pop() if lane == 0 else [])
            if not batch:  # no connection to wait on
                self._write_failed(exc, f"connect: {error_kind(exc)}")
                return
            if isinstance(exc, redis.exceptions.ConnectionError):
                self._run_batch(lane, batch)  # sent again on a new connection, under the write retry policy
                return
            try:
                self._failed(batch, exc)
            finally:
                self._settle(self._ops.finish(lane))

    def _pop(self) -> list[_Op]:
        """Lane 0's next batch for Python to run, sized as the core sizes its own (RespWriter.pop)."""
        return self._ops.pop(self._link.options.max_batch, self._link.options.write_deadline_s)

    def _run_batch(self, lane: int, batch: list[_Op]) -> None:
        """Run a lane's batch in flight through Python, then settle it."""
        try:
            self._apply(batch)
        finally:
            self._settle(self._ops.finish(lane))

    def _complete(self) -> None:
        """The completer thread: settles what the core wrote, batch by batch."""
        while self._ops.wait_done(1.0):
            self._settle_written()

    def _settle_written(self) -> None:
        with self._settling:
            for ops, written, seconds, trips in self._ops.completed():
                self._succeeded(written, seconds, trips)
                self._settle(ops)

    # ---- writing through Python ---------------------------------------------------------

    def _apply(self, batch: list[_Op]) -> None:
        link = self._link
        if link.write_client is None or not link.writes_up():
            with link.lock:
                self._drop_locked(batch)
            return
        if isinstance(batch[0], _UnlinkMatching):
            self._unlink_matching(batch[0].pattern)
            return
        if isinstance(batch[0], _Expire):
            self._expire(batch[0])
            return
        sets = sum(1 for op in batch if isinstance(op, _Set))
        start = time.perf_counter()
        try:
            self._retry.call(lambda: self._pipeline(batch), link.rng)
        except REDIS_ERRORS as exc:
            if self._count_write_deadline(exc) and sets:  # the pace that sizes the next batches (pop)
                self._ops.paced(time.perf_counter() - start, sets, True)
            self._failed(batch, exc)
            return
        elapsed = time.perf_counter() - start
        if sets:  # as run() measures its own
            self._ops.paced(elapsed, sets, False)
        self._succeeded(sum(op.nbytes for op in batch if isinstance(op, _Set)), elapsed)

    def _pipeline(self, batch: list[_Op]) -> None:
        writer = self._link.write_client
        assert writer is not None  # _apply checked
        sets = [op for op in batch if isinstance(op, _Set)]
        if isinstance(writer, redis.Redis) and len(sets) == len(batch):
            RespPipeline(writer, self._link.options.write_deadline_s).set(
                [op.key for op in sets], [op.frame for op in sets], [op.ttl_ms for op in sets]
            )
            return
        pipe = writer.pipeline(transaction=False)
        for op in batch:
            if isinstance(op, _Set):
                pipe.psetex(op.key, op.ttl_ms, _joined(op.frame))
            else:
                assert isinstance(op, _Unlink), "an _UnlinkMatching runs alone (_apply)"
                pipe.unlink(op.key)
        pipe.execute(raise_on_error=True)

    def _unlink_matching(self, pattern: str) -> None:
        removed = 0
        writer = self._link.write_client
        assert writer is not None  # _apply checked
        try:
            keys: list[bytes] = []
            for key in writer.scan_iter(match=pattern, count=1000):
                keys.append(key)
                if len(keys) >= _UNLINK_CHUNK:
                    removed += self._unlink_keys(keys)
                    keys = []
            removed += self._unlink_keys(keys)
        except REDIS_ERRORS as exc:
            self._write_failed(exc, f"scan/unlink: {error_kind(exc)}")
            log.warning("redis delete of %s stopped after %d keys: %s", key_hint(pattern), removed, error_kind(exc))
            return
        self._link.wrote()
        log.info("redis: removed %d keys matching %s", removed, pattern)

    def _expire(self, op: _Expire) -> None:
        writer = self._link.write_client
        assert writer is not None  # _apply checked
        try:
            for start in range(0, len(op.keys), _UNLINK_CHUNK):
                pipe = writer.pipeline(transaction=False)
                for key, ttl_ms in zip(
                    op.keys[start : start + _UNLINK_CHUNK], op.ttls_ms[start : start + _UNLINK_CHUNK]
                ):
                    pipe.pexpire(key, ttl_ms)
                pipe.execute(raise_on_error=True)
        except REDIS_ERRORS as exc:
            self._write_failed(exc, f"pexpire: {error_kind(exc)}")
            log.warning(
                "redis TTL change of %d key(s) from %s failed: %s", len(op.keys), key_hint(op.keys[0]), error_kind(exc)
            )
            return
        self._link.wrote()

    def _unlink_keys(self, keys: list[bytes]) -> int:
        """One UNLINK per key in a pipeline: never a multi-key command across cluster slots."""
        if not keys:
            return 0
        writer = self._link.write_client
        assert writer is not None  # _apply checked
        pipe = writer.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        return sum(pipe.execute(raise_on_error=True))

    # ---- outcomes -----------------------------------------------------------------------

    def _failed(self, batch: list[_Op], exc: BaseException) -> None:
        first = batch[0]
        key = (
            first.key
            if isinstance(first, (_Set, _Unlink))
            else first.pattern
            if isinstance(first, _UnlinkMatching)
            else first.keys[0]
        )
        reason = f"write of {len(batch)} key(s) from {key_hint(key)}: {error_kind(exc)}"
        self._write_failed(exc, reason)
        with self._link.lock:
            self._link.counters.writes_failed += sum(1 for op in batch if isinstance(op, _Set))
        log.debug("redis %s failed", reason)

    def _count_write_deadline(self, exc: BaseException) -> bool:
        """Count a batch cut by its deadline; whether `exc` says it was."""
        if not isinstance(exc, ExchangeDeadline):
            return False
        with self._link.lock:
            self._link.counters.write_deadlines += 1
        return True

    def _succeeded(self, written: int, elapsed: float, trips: int = 1) -> None:
        """A batch of `written` bytes took `elapsed` seconds over `trips` round trips (a lane sends
        its SETs one at a time): the latency and the link meter see one round trip's share."""
        link = self._link
        link.wrote()
        with link.lock:
            link.counters.bytes_written += written
            link.counters.write_latency.observe(elapsed / trips)
            link.meter.observe(written // trips, elapsed / trips)

    def _write_failed(self, exc: BaseException, reason: str) -> None:
        """A refusal while the link works counts against writes only; any other fault against the link."""
        link = self._link
        breaker = link.write_breaker if redis_code(exc) in WRITE_REFUSALS else link.breaker
        breaker.record_failure(reason)
        if not link.writes_up():
            # Lanes stream on their own connections: one that failed says nothing to lane 0 waiting
            # for work in the core, which must come out to probe (and no work comes: enqueues drop).
            self._ops.interrupt()

    def _probe(self) -> None:
        """The only I/O done while a breaker is down: PING for the link (building the clients
        first if needed), a small SET with a TTL for writes (PING answers while Redis refuses
        writes)."""
        link = self._link
        starting, self._probed = not self._probed, True
        if starting or link.breaker.probe_due():
            try:
                if link.read_client is None:
                    link.read_client, link.write_client = link.build_clients()
                link.read_client.ping()
            except REDIS_ERRORS as exc:
                _probe_failed(link.breaker, f"probe: {error_kind(exc)}")
                return
            link.breaker.record_success()
        if link.write_breaker.probe_due() and link.write_client is not None:
            try:
                link.write_client.psetex(f"{link.options.key_prefix}:probe", 10_000, b"1")
            except REDIS_ERRORS as exc:
                reason = f"write probe: {error_kind(exc)}"
                link.write_breaker.record_failure(reason)  # down: schedules its next probe
                if redis_code(exc) not in WRITE_REFUSALS:
                    link.breaker.record_failure(reason)
                return
            link.wrote()


def _joined(frame: Frame) -> bytes:
    """A frame as one bytes object of its own (parts copied into it)."""
    return frame if isinstance(frame, bytes) else b"".join(frame)


def _probe_failed(breaker: CircuitBreaker, reason: str) -> None:
    if breaker.is_up():
        breaker.trip(reason)
    else:
        breaker.record_failure(reason)
