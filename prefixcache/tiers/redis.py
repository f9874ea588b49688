"""Redis tier: one key per block, read in pipelined round trips, written behind a bounded queue.

Key `<prefix>:<namespace id>:<block hash hex>`, value one codec frame. The tier
never looks inside a frame; the cache verifies each with `codec.decode_block`
and reports failures back (`record_integrity_failure`, `delete`). Writes are
single-key `PSETEX key ttl frame` (SET with PX, the value last so Redis can keep
its read buffer as the value; atomic, always with a TTL); a hit refreshes the
TTL with `GETEX key PX ttl` (sliding TTL). Nothing needs two keys in one slot,
so Redis Cluster spreads blocks by hash.

Invariants:
- Fail-open: no public method raises on a Redis fault. Reads turn into misses,
  writes into dropped spills, both counted. Only redis-py errors and OSError
  are caught; anything else is a bug and propagates.
- The caller never waits on a write: `submit` appends to a queue bounded in
  bytes (frames queued or in flight) or refuses at once.
- One queue, the compiled core's `RespWriter`, holds every write and delete in
  order (a delete queued after a write runs after it). Background threads own
  every write, delete and recovery probe: on plain connections `write_lanes`
  threads (lane 0 the one that probes and runs what Python must) stream the SETs
  at the queue's head from the core without the GIL (`RespWriter.run`), each on a
  connection of its own, so the first write of a burst is on the wire while
  callers still frame the next ones; deletes, TLS and Redis Cluster writes, and a
  batch whose exchange failed go through Python on the lane that took them. One
  more thread hands written batches back (counters, `done`). The request path
  never probes: while the breaker is down `fetch` does no I/O at all.
- Constructing the tier does no I/O, so a service starts promptly with Redis
  down and picks it up when a probe succeeds.
- Two breakers. The link breaker counts faults of the connection (timeouts, resets,
  anything not a refusal) from reads and writes alike; while it is down neither
  side does I/O. The write breaker counts only writes Redis refused while the link
  works (OOM under `maxmemory-policy noeviction`, READONLY from a replica,
  `WRITE_REFUSALS`): it stops writes, never reads, which go on while they work (then
  with GET instead of GETEX, as the TTL refresh is a write Redis may refuse too).
  `stats()` says which side is down (`state`/`reads_up`, `write_state`/`writes_up`).
- Logs carry the error kind (exception type and Redis error code) and a key's
  prefix, namespace and hash prefix, never the exception text: redis-py puts the
  command, its key and raw frame bytes in it.
- Nothing Redis sends sizes an allocation beyond what the caller can use: a fetch
  given `max_frame_bytes` has a longer value refused from its length line
  (`OversizedReply`: counted in `oversized_replies` and `integrity_failures`, its key
  deleted, and a fault of the link for the breaker), so a planted 32 MiB value or a
  reply announcing a terabyte costs nothing but the fault. A MemoryError in a read
  is a failed read too, never the caller's error.
- Every exchange has a whole deadline (`read_deadline_s` a read round trip,
  `write_deadline_s` a write batch) beyond the per-wait socket timeouts, so a Redis
  dripping bytes cannot hold a lookup or a writer lane; each one cut is a fault for
  the breaker and counted (`read_deadlines`, `write_deadlines`). Redis Cluster's
  redis-py path has only the per-wait timeouts.
- Every successful round trip, read or write, and every read that times out is
  a sample of the link (`TransferMeter`, seeded with `LINK_PRIOR`); a fetch given
  a `ProbeBudget` asks only for the blocks that estimate says are worth it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import NamedTuple, cast

import redis.exceptions

from ..breaker import Backoff, BreakerState, CircuitBreaker, Retry
from ..kinds import TierKind
from ..native import core
from ..transfer import ProbeBudget, TransferEstimate, TransferMeter
from .base import Frame
from .redis_options import RedisClient, RedisOptions, connect, is_cluster_url, redact_url
from .redis_stats import RedisCounters, RedisStats
from .resp import ExchangeDeadline, OversizedReply, RespPipeline

log = logging.getLogger(__name__)

# What a Redis fault can raise through redis-py: every RedisError (connection,
# timeout, OOM, READONLY, NOAUTH/NOPERM, CLUSTERDOWN, protocol errors), the
# cluster client's own exception base, and socket/TLS errors.
REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
_GLOB = re.compile(r"([*?\[\]\\])")
_UNLINK_CHUNK = 500
# Until measured: a Redis on the same host or rack (loopback: ~0.2 ms per pipelined round
# trip, ~1 GB/s of replies, see docs/benchmarks.md); the meter replaces it within a few trips.
LINK_PRIOR = TransferEstimate(latency_s=0.0005, bytes_per_s=1e9)


class MalformedReply(redis.exceptions.RedisError):
    """Redis answered something a GETEX/SET cannot return."""


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


_Op = _Set | _Unlink | _UnlinkMatching
_STOP = object()
_PROBE = object()
_STREAM = object()
_POP = object()
_SET_FIRST = 1  # RespWriter.head(): a SET heads the queue
_EVERY_LANE = -1


def _frames_from(replies: object, expected: int) -> list[bytes | memoryview | None]:
    """GETEX replies as frames; a wrong-typed key is a miss, anything else unexpected a fault."""
    if not isinstance(replies, list) or len(replies) != expected:
        raise MalformedReply(f"expected {expected} replies, got {type(replies).__name__}")
    frames: list[bytes | memoryview | None] = []
    for reply in replies:
        if reply is None or isinstance(reply, bytes):
            frames.append(reply)
        elif isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith("WRONGTYPE"):
            frames.append(None)  # a foreign value under our key; our next SET replaces it
        elif isinstance(reply, redis.exceptions.RedisError):
            raise reply
        else:
            raise MalformedReply(f"unexpected reply of type {type(reply).__name__}")
    return frames


class RedisTier:
    """The shared, slowest tier. Thread-safe; see the module docstring for the guarantees."""

    kind = TierKind.REDIS

    def __init__(
        self,
        options: RedisOptions,
        client: RedisClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        write_client: RedisClient | None = None,
        rng: random.Random | None = None,
        io_wait: Callable[[], ContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.options = options
        self._default_ttl_ms = options.ttl_ms  # options are frozen; read on every submit
        self._io_wait = io_wait  # entered around each read's network wait (a server's pool runs another call)
        self._clock = clock
        self._rng = rng or random.Random()
        backoff = Backoff(options.breaker_backoff_min_s, options.breaker_backoff_max_s)
        name = f"redis tier {redact_url(options.url)}"
        self._breaker = CircuitBreaker(name, options.breaker_failures, backoff, clock, self._rng)
        self._write_breaker = CircuitBreaker(f"{name} writes", options.breaker_failures, backoff, clock, self._rng)
        self._plain_get = False  # GETEX was refused as a write: read with GET until writes work
        self._write_retry = Retry(options.write_retries, Backoff(0.01, 0.1), (redis.exceptions.ConnectionError,))
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # The write queue, in order; Cluster writes go batch by batch through redis-py, on lane 0 alone.
        self._ops = core.RespWriter(1 if is_cluster_url(options.url) else options.write_lanes)
        self._pending = 0  # ops queued, in flight or written but not yet settled
        self._queue_bytes = 0  # their bytes
        self._settling = threading.Lock()  # held while written batches are settled (own_frames waits on it)
        self._streams = True  # until a TLS connection says otherwise (RespWriter.run needs a plain socket)
        self._closing = False
        self._close_deadline = 0.0
        self._counters = RedisCounters()
        self._link = TransferMeter(LINK_PRIOR, clock=clock)
        self._owns_clients = client is None
        self._probed = False
        self._reader: RedisClient | None = client
        self._writer: RedisClient | None = write_client or client
        if client is None and not is_cluster_url(options.url):
            self._reader, self._writer = self._build_clients()  # no I/O for a standalone client
        self._thread = threading.Thread(target=self._run, name="prefixcache-redis-writer", daemon=True)
        self._lanes = [
            threading.Thread(target=self._run_lane, args=(lane,), name=f"prefixcache-redis-writer-{lane}", daemon=True)
            for lane in range(1, self._ops.lanes)
        ]
        self._completer = threading.Thread(target=self._complete, name="prefixcache-redis-completer", daemon=True)
        for thread in (self._thread, *self._lanes, self._completer):
            thread.start()

    @property
    def ttl_s(self) -> float:
        return float(self.options.ttl_s)

    @property
    def hmac_key(self) -> bytes | None:
        return self.options.hmac_key

    # ---- request path -------------------------------------------------------------------

    def key(self, namespace_id: str, block_hash: bytes) -> str:
        return f"{self.options.key_prefix}:{namespace_id}:{block_hash.hex()}"

    def fetch(
        self,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_s: float | None = None,
        *,
        frame_bytes: int | None = None,
        prefix_only: bool = False,
        budget: ProbeBudget | None = None,
        verify: TransferEstimate | None = None,
        max_frame_bytes: int | None = None,
    ) -> list[bytes | memoryview | None]:
        """Frames for `hashes` (None = miss) by pipelined GETEX, which also refreshes each hit's TTL.

        One round trip, or, when the expected frame size `frame_bytes` is given, round
        trips of at most `max_fetch_bytes` of replies (4 MiB: on loopback, 64 KiB values 64
        per trip read ~20% faster than 8 per trip, 2 MiB values two per trip a little faster
        than one, and 128 x 64 KiB or 64 x 2 MiB per trip are slower again; docs/benchmarks.md).
        With `prefix_only` only a contiguous run of hits is wanted: every entry after
        the first miss is None, and no round trip starts after one that held a miss.
        With a `budget` (which needs `frame_bytes`), each round trip asks only for what the
        budget grants; the blocks it declines come back as None. `verify` is the caller's
        cost of checking what comes back (e.g. a frame MAC), counted after the link's.
        A value longer than `max_frame_bytes` (the frame size the namespace implies) is refused
        before it is read (see the module docstring): the round trip fails as a fault.
        """
        if budget is not None and not frame_bytes:
            raise ValueError("a fetch with a budget needs frame_bytes")
        client = self._reader
        if hashes and (client is None or not self._breaker.is_up()):
            with self._lock:
                self._counters.reads_skipped += len(hashes)
            return [None] * len(hashes)
        per_trip = max(1, self.options.max_fetch_bytes // frame_bytes) if frame_bytes else max(1, len(hashes))
        ttl_ms = self._ttl_ms(ttl_s)
        frames: list[bytes | memoryview | None] = []
        start = time.perf_counter()
        declined = budget.declined if budget is not None else 0
        while len(frames) < len(hashes):
            batch = hashes[len(frames) : len(frames) + per_trip]
            if budget is not None and frame_bytes:  # (a budget without frame_bytes was refused above)
                batch = batch[: self._grant(budget, len(batch), frame_bytes, per_trip, verify)]
                if not batch:
                    break
            assert client is not None  # None returned early above whenever there are hashes
            got = self._round_trip(client, namespace_id, batch, ttl_ms, max_frame_bytes)
            if got is None:
                break
            frames.extend(got)
            if prefix_only and None in got:
                break
        found = [frame for frame in frames if frame is not None]
        with self._lock:
            if budget is not None and budget.declined > declined:
                self._counters.probes_declined += 1
                self._counters.probe_blocks_declined += budget.declined - declined
            self._counters.hits += len(found)
            self._counters.misses += len(frames) - len(found)
            self._counters.bytes_read += sum(len(frame) for frame in found)
            if hashes:
                self._counters.read_latency.observe(time.perf_counter() - start)
        if prefix_only and None in frames:
            frames = frames[: frames.index(None)]
        return frames + [None] * (len(hashes) - len(frames))

    def submit(
        self,
        namespace_id: str,
        block_hash: bytes,
        frame: Frame,
        ttl_s: float | None = None,
        *,
        done: Callable[[], None] | None = None,
    ) -> bool:
        """Queue an asynchronous SET; False (and a counted drop) when full, down or closed.

        The frame's buffers are read when the write is sent, not copied here: they must not change
        until `done` is called (once, from the writer, when the write succeeded, failed or was
        dropped; never when this returns False)."""
        nbytes = len(frame) if isinstance(frame, bytes) else sum(memoryview(part).nbytes for part in frame)
        key = self.key(namespace_id, block_hash)
        op = _Set(key, frame, self._ttl_ms(ttl_s), nbytes, done)
        with self._lock:
            if self._closing or not self._writes_up() or self._queue_bytes + nbytes > self.options.max_queue_bytes:
                self._counters.spills_dropped += 1
                return False
            self._ops.push(op, key.encode(), frame, op.ttl_ms)
            self._counters.spills_queued += 1
            self._queued_locked(op)
        return True

    def delete(self, namespace_id: str, block_hash: bytes) -> None:
        """Queue an UNLINK of one block (e.g. after it failed verification)."""
        self._enqueue(_Unlink(self.key(namespace_id, block_hash)))

    def delete_namespace(self, namespace_id: str) -> None:
        """Queue a SCAN+UNLINK of every block of one namespace (on every cluster node)."""
        self._enqueue(_UnlinkMatching(f"{_escape(self.options.key_prefix)}:{_escape(namespace_id)}:*"))

    def flush(self) -> None:
        """Queue a SCAN+UNLINK of every key under the key prefix (never FLUSHDB)."""
        self._enqueue(_UnlinkMatching(f"{_escape(self.options.key_prefix)}:*"))

    def record_integrity_failure(self) -> None:
        with self._lock:
            self._counters.integrity_failures += 1

    def is_up(self) -> bool:
        return self._reader is not None and self._breaker.is_up()

    def link_estimate(self) -> TransferEstimate:
        """The link's measured latency and bandwidth (the prior until measured)."""
        with self._lock:
            return self._link.estimate()

    def stats(self) -> RedisStats:
        with self._lock:
            write_state = self._write_breaker.state if self._breaker.is_up() else BreakerState.DOWN
            return RedisStats.of(
                self._counters,
                self._breaker.state,
                self._queue_bytes,
                self._breaker.trips,
                self._link.estimate(),
                write_state,
                self._write_breaker.trips,
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued, in flight or unsettled (tests, shutdown)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout_s)

    def own_frames(self, timeout_s: float) -> bool:
        """Stop reading the buffers `submit` was given: copy each queued frame that lies in them into
        bytes of its own (its `done` is called now), and wait up to `timeout_s` for the batch in
        flight, if any, to be done. False if it is not (its buffers may still be read until its
        `done`)."""
        with self._changed:
            for op, frame in self._ops.own_queued():
                op.frame = frame
                if op.done is not None:
                    done, op.done = op.done, None
                    done()
        flight = [op for op in self._ops.flight(_EVERY_LANE) if isinstance(op, _Set)]
        self._settle_written()  # the completer may not have got to a batch already written
        with self._changed:
            return self._changed.wait_for(lambda: all(op.done is None for op in flight), timeout_s)

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the writer: drain the queue until the deadline, drop the rest (counted). False if
        the writer is still running after that (a write stuck past its timeouts): then it may
        still read the buffers of a frame it was given."""
        with self._changed:
            if not self._closing:
                self._closing = True
                self._close_deadline = self._clock() + timeout_s
                self._ops.stop(timeout_s)
            self._changed.notify_all()
        deadline = time.monotonic() + timeout_s + 2 * self.options.write_timeout_s
        for thread in (self._thread, *self._lanes):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("redis writer did not stop within %.1fs", timeout_s)
                return False
        self._ops.shutdown()  # every lane is out: the completer settles what they wrote, then stops
        self._completer.join()
        if self._owns_clients:
            for client in {id(c): c for c in (self._reader, self._writer) if c is not None}.values():
                client.close()
        return True

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _ttl_ms(self, ttl_s: float | None) -> int:
        return self._default_ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))

    def _build_clients(self) -> tuple[RedisClient, RedisClient]:
        url = self.options.url
        return (
            connect(url, self.options, self.options.socket_timeout_s),
            connect(url, self.options, self.options.write_timeout_s),
        )

    def _grant(
        self, budget: ProbeBudget, wanted: int, frame_bytes: int, per_trip: int, verify: TransferEstimate | None
    ) -> int:
        with self._lock:
            estimate = self._link.estimate()
        if verify is not None:
            estimate = estimate.then(verify)
        return budget.grant(wanted, estimate, frame_bytes, per_trip, time.perf_counter())

    def _round_trip(
        self, client: RedisClient, namespace_id: str, hashes: Sequence[bytes], ttl_ms: int, most: int | None
    ) -> list[bytes | memoryview | None] | None:
        """One pipelined GETEX per hash; None after a fault (recorded in the breaker)."""
        start = time.perf_counter()
        try:
            try:
                frames = self._read_frames(client, namespace_id, hashes, ttl_ms, self._plain_get, most)
            except redis.exceptions.ResponseError as exc:
                if self._plain_get or _redis_code(exc) not in WRITE_REFUSALS:
                    raise
                self._plain_get = True  # the TTL refresh is a write Redis refuses now: read without it
                log.warning(
                    "%s: GETEX refused (%s); reading with GET, without refreshing TTLs, until writes work again",
                    self._breaker.name,
                    error_kind(exc),
                )
                frames = self._read_frames(client, namespace_id, hashes, ttl_ms, True, most)
        except (*REDIS_ERRORS, MemoryError) as exc:  # MemoryError: a read we could not hold is a failed read
            if isinstance(exc, redis.exceptions.TimeoutError):
                self._observe_link(0, time.perf_counter() - start)  # at least this slow
            if isinstance(exc, OversizedReply):
                self.delete(namespace_id, hashes[exc.position])  # not ours: the next lookup misses
                with self._lock:
                    self._counters.oversized_replies += 1
                    self._counters.integrity_failures += 1
            elif isinstance(exc, ExchangeDeadline):
                with self._lock:
                    self._counters.read_deadlines += 1
            self._read_failed(exc)
            return None
        self._observe_link(sum(len(frame) for frame in frames if frame is not None), time.perf_counter() - start)
        self._breaker.record_success()
        return frames

    def _read_frames(
        self,
        client: RedisClient,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_ms: int,
        plain: bool,
        most: int | None = None,
    ) -> list[bytes | memoryview | None]:
        """Pipelined GETEX (GET when `plain`: Redis refuses the TTL refresh as a write): read in
        place by the compiled core for a standalone client (tiers/resp.py), else through redis-py
        (which allocates what Redis announces: a value longer than `most` is refused after it)."""
        keys = [self.key(namespace_id, block_hash) for block_hash in hashes]
        if isinstance(client, redis.Redis):
            pipeline = RespPipeline(client, self.options.read_deadline_s)
            with self._io_wait():
                return cast(list[bytes | memoryview | None], pipeline.getex(keys, None if plain else ttl_ms, most))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            if plain:
                pipe.get(key)
            else:
                pipe.getex(key, px=ttl_ms)
        with self._io_wait():
            replies = pipe.execute(raise_on_error=False)
        frames = _frames_from(replies, len(keys))
        for position, frame in enumerate(frames):
            if most is not None and frame is not None and len(frame) > most:
                raise OversizedReply(f"a value of {len(frame)} bytes, more than the {most} expected", position)
        return frames

    def _observe_link(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._link.observe(nbytes, seconds)

    def _read_failed(self, exc: BaseException) -> None:
        self._breaker.record_failure(f"read: {error_kind(exc)}")
        if not self._breaker.is_up():
            self._ops.interrupt()  # a streaming writer stops to drop what is queued
        with self._changed:
            self._counters.read_errors += 1
            self._changed.notify_all()  # the writer may have a probe to schedule

    def _enqueue(self, op: _Unlink | _UnlinkMatching) -> None:
        """Queue an op the writer runs through Python (in order with the SETs around it)."""
        with self._lock:
            if not self._closing:
                self._ops.push(op, None, None, 0)
                self._queued_locked(op)

    def _queued_locked(self, op: _Op) -> None:
        self._pending += 1
        self._queue_bytes += op.nbytes
        self._changed.notify_all()  # a writer waiting in Python (not streaming)

    def _settle(self, ops: list[_Op]) -> None:
        """The tier is done with these ops: call their `done`, count them out of the queue."""
        dones = []
        with self._changed:
            for op in ops:
                if isinstance(op, _Set) and op.done is not None:
                    dones.append(op.done)
                    op.done = None
        for done in dones:
            done()
        with self._changed:
            self._queue_bytes -= sum(op.nbytes for op in ops)
            self._pending -= len(ops)
            self._changed.notify_all()

    # ---- writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        """Lane 0: probes, the ops Python runs, and SETs."""
        try:
            self._probe()
            while (work := self._next_work()) is not _STOP:
                if work is _PROBE:
                    self._probe()
                elif work is _STREAM:
                    self._stream(0)
                elif batch := self._ops.pop(self.options.max_batch):  # _POP: unlocked, it may wait for lanes
                    self._run_batch(0, batch)
        finally:
            self._stop_lanes()
            dropped = self._ops.drain()
            with self._lock:
                self._drop_locked(dropped)
            self._settle(dropped)

    def _run_lane(self, lane: int) -> None:
        """Lanes 1 and up: SETs only, while streaming is possible; once closing, until the queue is
        drained or the deadline passed (RespWriter.stop)."""
        while True:
            with self._changed:
                while not self._closing and not self._can_stream():
                    self._changed.wait(1.0)  # (a recovered breaker does not notify)
                if not self._can_stream():
                    return
            self._stream(lane)
            if self._closing:
                return

    def _stop_lanes(self) -> None:
        with self._changed:
            self._closing = True  # (a lane waits for it; set by close() unless lane 0 died)
            self._changed.notify_all()
        self._ops.stop(0.0)

    def _next_work(self) -> object:
        with self._changed:
            while True:
                if self._closing and (not len(self._ops) or self._clock() >= self._close_deadline):
                    return _STOP
                if self._breaker.probe_due() or (self._breaker.is_up() and self._write_breaker.probe_due()):
                    return _PROBE
                head = self._ops.head()
                if (not head or head == _SET_FIRST) and self._can_stream():
                    return _STREAM  # waits for work in the core, without the GIL
                if head:
                    return _POP
                # Sleep until new work, close, or (while down) the next probe.
                down = self._breaker if not self._breaker.is_up() else self._write_breaker
                self._changed.wait(None if down.is_up() else down.seconds_until_probe())

    def _can_stream(self) -> bool:
        return self._streams and isinstance(self._writer, redis.Redis) and self._writes_up()

    def _stream(self, lane: int) -> None:
        """Let the core write SETs from the queue's head on `lane` until it stops (RespWriter.run)."""
        writer = self._writer
        if not isinstance(writer, redis.Redis):  # (_can_stream said it was; a lane may race a rebuild)
            return
        try:
            if not RespPipeline(writer, self.options.write_deadline_s).stream(self._ops, self.options.max_batch, lane):
                self._streams = False  # TLS: its socket methods need the GIL; lane 0 goes batch by batch
            return
        except REDIS_ERRORS as exc:
            self._count_write_deadline(exc)
            batch = self._ops.flight(lane) or (self._ops.pop(self.options.max_batch) if lane == 0 else [])
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

    def _drop_locked(self, ops: list[_Op]) -> None:
        self._counters.spills_dropped += sum(1 for op in ops if isinstance(op, _Set))

    def _apply(self, batch: list[_Op]) -> None:
        if self._writer is None or not self._writes_up():
            with self._lock:
                self._drop_locked(batch)
            return
        if isinstance(batch[0], _UnlinkMatching):
            self._unlink_matching(batch[0].pattern)
            return
        start = time.perf_counter()
        try:
            self._write_retry.call(lambda: self._pipeline(batch), self._rng)
        except REDIS_ERRORS as exc:
            self._count_write_deadline(exc)
            self._failed(batch, exc)
            return
        self._succeeded(sum(op.nbytes for op in batch if isinstance(op, _Set)), time.perf_counter() - start)

    def _failed(self, batch: list[_Op], exc: BaseException) -> None:
        key = batch[0].key if isinstance(batch[0], (_Set, _Unlink)) else batch[0].pattern
        reason = f"write of {len(batch)} key(s) from {key_hint(key)}: {error_kind(exc)}"
        self._write_failed(exc, reason)
        with self._lock:
            self._counters.writes_failed += sum(1 for op in batch if isinstance(op, _Set))
        log.debug("redis %s failed", reason)

    def _count_write_deadline(self, exc: BaseException) -> None:
        if isinstance(exc, ExchangeDeadline):
            with self._lock:
                self._counters.write_deadlines += 1

    def _succeeded(self, written: int, elapsed: float, trips: int = 1) -> None:
        """A batch of `written` bytes took `elapsed` seconds over `trips` round trips (a lane sends
        its SETs one at a time): the latency and the link meter see one round trip's share."""
        self._wrote()
        with self._lock:
            self._counters.bytes_written += written
            self._counters.write_latency.observe(elapsed / trips)
            self._link.observe(written // trips, elapsed / trips)

    def _pipeline(self, batch: list[_Op]) -> None:
        assert self._writer is not None  # _apply checked
        sets = [op for op in batch if isinstance(op, _Set)]
        if isinstance(self._writer, redis.Redis) and len(sets) == len(batch):
            RespPipeline(self._writer, self.options.write_deadline_s).set(
                [op.key for op in sets], [op.frame for op in sets], [op.ttl_ms for op in sets]
            )
            return
        pipe = self._writer.pipeline(transaction=False)
        for op in batch:
            if isinstance(op, _Set):
                pipe.psetex(op.key, op.ttl_ms, _joined(op.frame))
            else:
                assert isinstance(op, _Unlink), "an _UnlinkMatching runs alone (_apply)"
                pipe.unlink(op.key)
        pipe.execute(raise_on_error=True)

    def _unlink_matching(self, pattern: str) -> None:
        removed = 0
        assert self._writer is not None  # _apply checked
        try:
            keys: list[bytes] = []
            for key in self._writer.scan_iter(match=pattern, count=1000):
                keys.append(key)
                if len(keys) >= _UNLINK_CHUNK:
                    removed += self._unlink_keys(keys)
                    keys = []
            removed += self._unlink_keys(keys)
        except REDIS_ERRORS as exc:
            self._write_failed(exc, f"scan/unlink: {error_kind(exc)}")
            log.warning("redis delete of %s stopped after %d keys: %s", key_hint(pattern), removed, error_kind(exc))
            return
        self._wrote()
        log.info("redis: removed %d keys matching %s", removed, pattern)

    def _unlink_keys(self, keys: list[bytes]) -> int:
        """One UNLINK per key in a pipeline: never a multi-key command across cluster slots."""
        if not keys:
            return 0
        assert self._writer is not None  # _apply checked
        pipe = self._writer.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        return sum(pipe.execute(raise_on_error=True))

    def _writes_up(self) -> bool:
        return self._breaker.is_up() and self._write_breaker.is_up()

    def _write_failed(self, exc: BaseException, reason: str) -> None:
        """A refusal while the link works counts against writes only; any other fault against the link."""
        breaker = self._write_breaker if _redis_code(exc) in WRITE_REFUSALS else self._breaker
        breaker.record_failure(reason)
        if not self._writes_up():
            # Lanes stream on their own connections: one that failed says nothing to lane 0 waiting
            # for work in the core, which must come out to probe (and no work comes: enqueues drop).
            self._ops.interrupt()

    def _wrote(self) -> None:
        self._breaker.record_success()
        self._write_breaker.record_success()
        self._plain_get = False

    def _probe(self) -> None:
        """The only I/O done while a breaker is down: PING for the link (building the clients
        first if needed), a small SET with a TTL for writes (PING answers while Redis refuses
        writes)."""
        starting, self._probed = not self._probed, True
        if starting or self._breaker.probe_due():
            try:
                if self._reader is None:
                    self._reader, self._writer = self._build_clients()
                self._reader.ping()
            except REDIS_ERRORS as exc:
                _probe_failed(self._breaker, f"probe: {error_kind(exc)}")
                return
            self._breaker.record_success()
        if self._write_breaker.probe_due() and self._writer is not None:
            try:
                self._writer.psetex(f"{self.options.key_prefix}:probe", 10_000, b"1")
            except REDIS_ERRORS as exc:
                reason = f"write probe: {error_kind(exc)}"
                self._write_breaker.record_failure(reason)  # down: schedules its next probe
                if _redis_code(exc) not in WRITE_REFUSALS:
                    self._breaker.record_failure(reason)
                return
            self._wrote()


WRITE_REFUSALS = frozenset({"OOM", "READONLY", "MISCONF", "NOREPLICAS"})  # Redis answered: no writes now
_REDIS_CODE = re.compile(r"[A-Z][A-Z_]{1,31}")


# redis-py turns these codes into exception classes and strips them from the message
_CODE_OF_CLASS = ((redis.exceptions.OutOfMemoryError, "OOM"), (redis.exceptions.ReadOnlyError, "READONLY"))


def _redis_code(exc: BaseException) -> str | None:
    """The error code Redis put first in its reply (OOM, READONLY, ...), if any."""
    for kind, code in _CODE_OF_CLASS:
        if isinstance(exc, kind):
            return code
    if not isinstance(exc, redis.exceptions.ResponseError) or not exc.args:
        return None
    text = str(exc.args[0]).rsplit("caused error: ", 1)[-1]  # a pipeline wraps the reply after the command
    match = _REDIS_CODE.match(text)
    return match.group() if match else None


def error_kind(exc: BaseException) -> str:
    """What a log may say about a Redis error: its type and Redis's error code, never the
    message (redis-py puts the command there: key, raw frame bytes)."""
    code = _redis_code(exc)
    return f"{type(exc).__name__} {code}" if code else type(exc).__name__


def key_hint(key: str) -> str:
    """`prefix:namespace-prefix…:hash-prefix…` of a key or key pattern: enough to tell which."""
    parts = key.rsplit(":", 2)
    if len(parts) < 3:
        return parts[0][:16]
    prefix, namespace, block = parts
    return f"{prefix}:{namespace[:12]}…:{block[:8]}…" if block != "*" else f"{prefix}:{namespace[:12]}…:*"


def _joined(frame: Frame) -> bytes:
    """A frame as one bytes object of its own (parts copied into it)."""
    return frame if isinstance(frame, bytes) else b"".join(frame)


def _probe_failed(breaker: CircuitBreaker, reason: str) -> None:
    if breaker.is_up():
        breaker.trip(reason)
    else:
        breaker.record_failure(reason)


def _escape(text: str) -> str:
    """Escape SCAN MATCH glob characters."""
    return _GLOB.sub(r"\\\1", text)
