"""The Redis tier's reads: pipelined GET + TTL refresh round trips on the caller's thread, within a probe's
budget, each one a sample of the link; a fault counts against the link breaker.

Part of `RedisTier` (tiers/redis.py, whose docstring states the guarantees). It never probes:
while the link breaker is down a fetch does no I/O. What it asks of the writer: queue the
delete of a key holding a value too long to be ours, and stop streaming when a read fault
takes the link down (queued writes are dropped rather than sent to a dead link).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import cast

import redis.exceptions

from ..transfer import ProbeBudget, TransferEstimate
from .redis_link import REDIS_ERRORS, WRITE_REFUSALS, RedisLink, error_kind, redis_code
from .redis_options import RedisClient
from .redis_writer import RedisWriter
from .resp import ExchangeDeadline, OversizedReply, RefreshRefused, RespPipeline

log = logging.getLogger(__name__)


class MalformedReply(redis.exceptions.RedisError):
    """Redis answered something a GET/SET cannot return."""


class RedisReader:
    """Fetches for any number of caller threads at once (the link's lock guards what they count)."""

    def __init__(self, link: RedisLink, writer: RedisWriter, io_wait: Callable[[], ContextManager[object]]) -> None:
        self._link = link
        self._writer = writer
        self._io_wait = io_wait  # entered around each read's network wait (a server's pool runs another call)

    def fetch(
        self,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_ms: int,
        *,
        frame_bytes: int | None,
        prefix_only: bool,
        budget: ProbeBudget | None,
        verify: TransferEstimate | None,
        max_frame_bytes: int | None,
    ) -> list[bytes | memoryview | None]:
        """`RedisTier.fetch`, which documents it (here with the TTL in milliseconds)."""
        if budget is not None and not frame_bytes:
            raise ValueError("a fetch with a budget needs frame_bytes")
        link = self._link
        client = link.read_client
        if hashes and (client is None or not link.breaker.is_up()):
            with link.lock:
                link.counters.reads_skipped += len(hashes)
            return [None] * len(hashes)
        per_trip = max(1, link.options.max_fetch_bytes // frame_bytes) if frame_bytes else max(1, len(hashes))
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
        with link.lock:
            counters = link.counters
            if budget is not None and budget.declined > declined:
                counters.probes_declined += 1
                counters.probe_blocks_declined += budget.declined - declined
            counters.hits += len(found)
            counters.misses += len(frames) - len(found)
            counters.bytes_read += sum(len(frame) for frame in found)
            if hashes:
                counters.read_latency.observe(time.perf_counter() - start)
        if prefix_only and None in frames:
            frames = frames[: frames.index(None)]
        return frames + [None] * (len(hashes) - len(frames))

    def _grant(
        self, budget: ProbeBudget, wanted: int, frame_bytes: int, per_trip: int, verify: TransferEstimate | None
    ) -> int:
        estimate = self._link.estimate()
        if verify is not None:
            estimate = estimate.then(verify)
        return budget.grant(wanted, estimate, frame_bytes, per_trip, time.perf_counter())

    def _round_trip(
        self, client: RedisClient, namespace_id: str, hashes: Sequence[bytes], ttl_ms: int, most: int | None
    ) -> list[bytes | memoryview | None] | None:
        """One pipelined read (and TTL refresh) per hash; None after a fault (recorded in the breaker)."""
        link = self._link
        start = time.perf_counter()
        try:
            while True:  # a refusal turns one way of refreshing off (at most two): read again
                try:
                    frames = self._read_frames(
                        client, namespace_id, hashes, None if link.plain_get else ttl_ms, not link.extend_ttl, most
                    )
                    break
                except redis.exceptions.ResponseError as exc:
                    if not self._refresh_refused(exc):
                        raise
        except (*REDIS_ERRORS, MemoryError) as exc:  # MemoryError: a read we could not hold is a failed read
            if isinstance(exc, redis.exceptions.TimeoutError):
                link.observe(0, time.perf_counter() - start)  # at least this slow
            if isinstance(exc, OversizedReply):
                self._writer.delete(link.key(namespace_id, hashes[exc.position]))  # not ours: the next lookup misses
                with link.lock:
                    link.counters.oversized_replies += 1
                    link.counters.integrity_failures += 1
            elif isinstance(exc, ExchangeDeadline):
                with link.lock:
                    link.counters.read_deadlines += 1
            self._read_failed(exc)
            return None
        link.observe(sum(len(frame) for frame in frames if frame is not None), time.perf_counter() - start)
        link.breaker.record_success()
        return frames

    def _refresh_refused(self, exc: redis.exceptions.ResponseError) -> bool:
        """Whether a read's error was its TTL refresh refused, now turned off (read again)."""
        link = self._link
        if not link.plain_get and redis_code(exc) in WRITE_REFUSALS:
            link.plain_get = True  # the TTL refresh is a write Redis refuses now: read without it
            log.warning(
                "%s: TTL refresh refused (%s); reading with GET, without refreshing TTLs, until writes work again",
                link.breaker.name,
                error_kind(exc),
            )
            return True
        if isinstance(exc, RefreshRefused) and link.extend_ttl:
            link.extend_ttl = False  # a Redis before 7.0 knows no GT
            log.warning(
                "%s: PEXPIRE ... GT refused (%s; Redis >= 7 takes it); refreshing TTLs with GETEX, which "
                "also shortens a longer TTL another instance set (a pin, a retention hint)",
                link.breaker.name,
                error_kind(exc),
            )
            return True
        return False

    def _read_frames(
        self,
        client: RedisClient,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_ms: int | None,
        reset: bool,
        most: int | None = None,
    ) -> list[bytes | memoryview | None]:
        """Pipelined GET, each key's TTL refreshed to at least `ttl_ms` by `PEXPIRE ... GT`
        (`reset`: GETEX, which sets it; None: no refresh), read in place by the compiled core for
        a standalone client (tiers/resp.py), else through redis-py (which allocates what Redis
        announces: a value longer than `most` is refused after it)."""
        keys = [self._link.key(namespace_id, block_hash) for block_hash in hashes]
        if isinstance(client, redis.Redis):
            pipeline = RespPipeline(client, self._link.options.read_deadline_s)
            with self._io_wait():
                return cast(list[bytes | memoryview | None], pipeline.getex(keys, ttl_ms, most, reset))
        extend = ttl_ms is not None and not reset
        pipe = client.pipeline(transaction=False)
        for key in keys:
            if ttl_ms is None or extend:
                pipe.get(key)
            else:
                pipe.getex(key, px=ttl_ms)
            if extend:
                pipe.pexpire(key, ttl_ms, gt=True)
        with self._io_wait():
            replies = pipe.execute(raise_on_error=False)
        if extend:
            for reply in replies[1::2]:
                if isinstance(reply, redis.exceptions.ResponseError):
                    raise RefreshRefused(str(reply))
            replies = replies[0::2]
        frames = _frames_from(replies, len(keys))
        for position, frame in enumerate(frames):
            if most is not None and frame is not None and len(frame) > most:
                raise OversizedReply(f"a value of {len(frame)} bytes, more than the {most} expected", position)
        return frames

    def _read_failed(self, exc: BaseException) -> None:
        link = self._link
        link.breaker.record_failure(f"read: {error_kind(exc)}")
        if not link.breaker.is_up():
            self._writer.interrupt()  # a streaming writer stops to drop what is queued
        with link.changed:
            link.counters.read_errors += 1
            link.changed.notify_all()  # the writer may have a probe to schedule


def _frames_from(replies: object, expected: int) -> list[bytes | memoryview | None]:
    """GET replies as frames; a wrong-typed key is a miss, anything else unexpected a fault."""
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
