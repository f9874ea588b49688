"""Redis tier: one key per block, read in pipelined round trips, written behind a bounded queue.

Key `<prefix>:<namespace id>:<block hash hex>`, value one codec frame. The tier
never looks inside a frame; the cache verifies each with `codec.decode_block`
and reports failures back (`record_integrity_failure`, `delete`). Writes are
single-key `SET key frame PX ttl` (atomic, always with a TTL); a hit refreshes
the TTL with `GETEX key PX ttl` (sliding TTL). Nothing needs two keys in one
slot, so Redis Cluster spreads blocks by hash.

Invariants:
- Fail-open: no public method raises on a Redis fault. Reads turn into misses,
  writes into dropped spills, both counted. Only redis-py errors and OSError
  are caught; anything else is a bug and propagates.
- The caller never waits on a write: `submit` appends to a queue bounded in
  bytes (frames queued or in flight) or refuses at once.
- One background thread owns every write, delete and recovery probe, in queue
  order (a delete queued after a write runs after it). The request path never
  probes: while the breaker is down `fetch` does no I/O at all.
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
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import NamedTuple, cast

import redis.exceptions

from ..transfer import ProbeBudget, TransferEstimate, TransferMeter
from .base import Frame, TierKind
from .breaker import Backoff, BreakerState, CircuitBreaker, Retry
from .redis_options import RedisClient, RedisOptions, connect, is_cluster_url, redact_url
from .redis_stats import RedisCounters, RedisStats
from .resp import RespPipeline

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


# Queue entries are NamedTuples: one is built per submit, and a tuple is several times cheaper to
# build than a frozen dataclass.
class _Set(NamedTuple):
    key: str
    frame: Frame
    ttl_ms: int
    nbytes: int
    done: Callable[[], None] | None  # called once the write is over, whatever its outcome


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
        self._queue: deque[_Op] = deque()
        self._queue_bytes = 0  # queued plus in flight
        self._in_flight = 0
        self._batches = 0  # batches the writer has finished (`own_frames` waits for the next)
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
        self._thread.start()

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
            got = self._round_trip(client, namespace_id, batch, ttl_ms)
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
        op = _Set(self.key(namespace_id, block_hash), frame, self._ttl_ms(ttl_s), nbytes, done)
        with self._lock:
            if self._closing or not self._writes_up() or self._queue_bytes + nbytes > self.options.max_queue_bytes:
                self._counters.spills_dropped += 1
                return False
            self._counters.spills_queued += 1
            self._enqueue_locked(op)
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
        """True once nothing is queued or in flight (tests, shutdown)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def own_frames(self, timeout_s: float) -> bool:
        """Stop reading the buffers `submit` was given: copy each queued frame given as parts into
        bytes of its own (its `done` is called now), and wait up to `timeout_s` for the batch in
        flight, if any, to finish. False if it has not (its buffers may still be read until its
        `done`)."""
        with self._changed:
            owned: deque[_Op] = deque()
            for op in self._queue:
                if isinstance(op, _Set) and op.done is not None:
                    owned.append(op._replace(frame=_joined(op.frame), done=None))
                    op.done()
                else:
                    owned.append(op)
            self._queue = owned
            batches = self._batches
            return self._changed.wait_for(lambda: not self._in_flight or self._batches != batches, timeout_s)

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the writer: drain the queue until the deadline, drop the rest (counted). False if
        the writer is still running after that (a write stuck past its timeouts): then it may
        still read the buffers of a frame it was given."""
        with self._changed:
            if not self._closing:
                self._closing = True
                self._close_deadline = self._clock() + timeout_s
            self._changed.notify_all()
        self._thread.join(timeout_s + 2 * self.options.write_timeout_s)
        if self._thread.is_alive():
            log.warning("redis writer did not stop within %.1fs", timeout_s)
            return False
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
        self, client: RedisClient, namespace_id: str, hashes: Sequence[bytes], ttl_ms: int
    ) -> list[bytes | memoryview | None] | None:
        """One pipelined GETEX per hash; None after a fault (recorded in the breaker)."""
        start = time.perf_counter()
        try:
            try:
                frames = self._read_frames(client, namespace_id, hashes, ttl_ms, self._plain_get)
            except redis.exceptions.ResponseError as exc:
                if self._plain_get or _redis_code(exc) not in WRITE_REFUSALS:
                    raise
                self._plain_get = True  # the TTL refresh is a write Redis refuses now: read without it
                log.warning(
                    "%s: GETEX refused (%s); reading with GET, without refreshing TTLs, until writes work again",
                    self._breaker.name,
                    error_kind(exc),
                )
                frames = self._read_frames(client, namespace_id, hashes, ttl_ms, True)
        except REDIS_ERRORS as exc:
            if isinstance(exc, redis.exceptions.TimeoutError):
                self._observe_link(0, time.perf_counter() - start)  # at least this slow
            self._read_failed(exc)
            return None
        self._observe_link(sum(len(frame) for frame in frames if frame is not None), time.perf_counter() - start)
        self._breaker.record_success()
        return frames

    def _read_frames(
        self, client: RedisClient, namespace_id: str, hashes: Sequence[bytes], ttl_ms: int, plain: bool
    ) -> list[bytes | memoryview | None]:
        """Pipelined GETEX (GET when `plain`: Redis refuses the TTL refresh as a write): read in
        place by the compiled core for a standalone client (tiers/resp.py), else through redis-py."""
        keys = [self.key(namespace_id, block_hash) for block_hash in hashes]
        if isinstance(client, redis.Redis):
            with self._io_wait():
                return cast(
                    list[bytes | memoryview | None], RespPipeline(client).getex(keys, None if plain else ttl_ms)
                )
        pipe = client.pipeline(transaction=False)
        for key in keys:
            if plain:
                pipe.get(key)
            else:
                pipe.getex(key, px=ttl_ms)
        with self._io_wait():
            replies = pipe.execute(raise_on_error=False)
        return _frames_from(replies, len(keys))

    def _observe_link(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._link.observe(nbytes, seconds)

    def _read_failed(self, exc: BaseException) -> None:
        self._breaker.record_failure(f"read: {error_kind(exc)}")
        with self._changed:
            self._counters.read_errors += 1
            self._changed.notify_all()  # the writer may have a probe to schedule

    def _enqueue(self, op: _Op) -> None:
        with self._lock:
            if not self._closing:
                self._enqueue_locked(op)

    def _enqueue_locked(self, op: _Op) -> None:
        self._queue.append(op)
        self._queue_bytes += op.nbytes
        self._changed.notify_all()

    # ---- writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        self._probe()
        while (work := self._next_work()) is not _STOP:
            if work is _PROBE:
                self._probe()
                continue
            work = cast(list[_Op], work)  # _next_work: a batch unless a sentinel
            try:
                self._apply(work)
            finally:
                _done(work)
                with self._changed:
                    self._queue_bytes -= sum(op.nbytes for op in work)
                    self._in_flight = 0
                    self._batches += 1
                    self._changed.notify_all()

    def _next_work(self) -> object:
        with self._changed:
            while True:
                if self._closing and (not self._queue or self._clock() >= self._close_deadline):
                    self._drop_locked(list(self._queue))
                    _done(self._queue)
                    self._queue.clear()
                    self._queue_bytes = 0
                    self._changed.notify_all()
                    return _STOP
                if self._breaker.probe_due() or (self._breaker.is_up() and self._write_breaker.probe_due()):
                    return _PROBE
                if self._queue:
                    return self._pop_batch_locked()
                # Sleep until new work, close, or (while down) the next probe.
                down = self._breaker if not self._breaker.is_up() else self._write_breaker
                self._changed.wait(None if down.is_up() else down.seconds_until_probe())

    def _pop_batch_locked(self) -> list[_Op]:
        """Consecutive single-key ops up to max_batch, or one SCAN-based op alone (keeps queue order)."""
        if isinstance(self._queue[0], _UnlinkMatching):
            batch: list[_Op] = [self._queue.popleft()]
        else:
            batch = []
            while (
                self._queue and len(batch) < self.options.max_batch and not isinstance(self._queue[0], _UnlinkMatching)
            ):
                batch.append(self._queue.popleft())
        self._in_flight = len(batch)
        return batch

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
            reason = f"write of {len(batch)} key(s) from {key_hint(batch[0].key)}: {error_kind(exc)}"
            self._write_failed(exc, reason)
            with self._lock:
                self._counters.writes_failed += sum(1 for op in batch if isinstance(op, _Set))
            log.debug("redis %s failed", reason)
            return
        elapsed = time.perf_counter() - start
        self._wrote()
        written = sum(op.nbytes for op in batch if isinstance(op, _Set))
        with self._lock:
            self._counters.bytes_written += written
            self._counters.write_latency.observe(elapsed)
            self._link.observe(written, elapsed)

    def _pipeline(self, batch: list[_Op]) -> None:
        assert self._writer is not None  # _apply checked
        sets = [op for op in batch if isinstance(op, _Set)]
        if isinstance(self._writer, redis.Redis) and len(sets) == len(batch):
            RespPipeline(self._writer).set(
                [op.key for op in sets], [op.frame for op in sets], [op.ttl_ms for op in sets]
            )
            return
        pipe = self._writer.pipeline(transaction=False)
        for op in batch:
            if isinstance(op, _Set):
                pipe.set(op.key, _joined(op.frame), px=op.ttl_ms)
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
                self._writer.set(f"{self.options.key_prefix}:probe", b"1", px=10_000)
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


def _done(ops: Sequence[_Op] | deque[_Op]) -> None:
    """Tell the submitters of these writes that the tier is done with their frames."""
    for op in ops:
        if isinstance(op, _Set) and op.done is not None:
            op.done()


def _probe_failed(breaker: CircuitBreaker, reason: str) -> None:
    if breaker.is_up():
        breaker.trip(reason)
    else:
        breaker.record_failure(reason)


def _escape(text: str) -> str:
    """Escape SCAN MATCH glob characters."""
    return _GLOB.sub(r"\\\1", text)
