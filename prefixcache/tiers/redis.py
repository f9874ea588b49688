"""Redis tier: one key per block, read in pipelined round trips, written behind a bounded queue.

Key `<prefix>:<namespace id>:<block hash hex>`, value one codec frame. The tier
never looks inside a frame; the cache verifies each with `codec.decode_block`
and reports failures back (`record_integrity_failure`, `delete`). Writes are
single-key `PSETEX key ttl frame` (SET with PX, the value last so Redis can keep
its read buffer as the value; atomic, always with a TTL); a hit is `GET key` and
refreshes the TTL with `PEXPIRE key ttl GT` in the same pipeline (sliding TTL that only ever
lengthens: a key another instance gave longer, for a pin or a retention hint, keeps it; on a
Redis before 7.0, which refuses GT, `GETEX key PX ttl`, which sets it). Nothing needs two keys
in one slot, so Redis Cluster spreads blocks by hash.

`RedisTier` is the facade the rest of the code uses; the work is done by three parts, each its
own module: `RedisLink` (redis_link.py: the clients, both breakers, the counters and the link
meter, which the other two share), `RedisReader` (redis_reader.py: fetches, on the caller's
thread) and `RedisWriter` (redis_writer.py: the write queue, its lanes, the completer, probes).

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
  without the TTL refresh, itself a write Redis may refuse too).
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
import dataclasses
import random
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager

from ..breaker import BreakerState
from ..errors import ConfigError
from ..kinds import TierKind
from ..presence import RemoteHeld
from ..transfer import ProbeBudget, TransferEstimate
from .base import Frame
from .redis_link import RedisLink
from .redis_options import RedisClient, RedisOptions
from .redis_presence import RedisPresenceFeed
from .redis_reader import RedisReader
from .redis_stats import RedisStats
from .redis_writer import RedisWriter

_GLOB = re.compile(r"([*?\[\]\\])")


class RedisTier:
    """The shared, slowest tier. Thread-safe; see the module docstring for the guarantees.

    A facade over the parts that do the work: `RedisLink` (clients, breakers, counters, link
    meter), `RedisReader` (fetches) and `RedisWriter` (the write queue and its threads)."""

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
        self._link = RedisLink(options, client, write_client, clock, rng or random.Random())
        self._writer = RedisWriter(self._link)
        self._reader = RedisReader(self._link, self._writer, io_wait)
        self._feed: RedisPresenceFeed | None = None  # follow_presence starts it

    @property
    def presence_blocks(self) -> int:
        """Blocks a presence table's remote cells should hold for this tier (0: none)."""
        return self.options.presence_blocks

    def follow_presence(self, held: RemoteHeld) -> None:
        """Keep `held` (a presence table's remote cells) holding the blocks this Redis holds, whoever
        wrote them: announce this tier's writes and follow every service's (tiers/redis_presence.py)."""
        if not self.presence_blocks:
            raise ConfigError("presence_blocks", "is 0: this tier follows no presence table")
        if self._feed is not None:
            raise RuntimeError("the tier already follows a presence table")
        self._feed = RedisPresenceFeed(self.options, held, f"{_escape(self.options.key_prefix)}:*")

    @property
    def ttl_s(self) -> float:
        return float(self.options.ttl_s)

    @property
    def hmac_key(self) -> bytes | None:
        return self.options.hmac_key

    def key(self, namespace_id: str, block_hash: bytes) -> str:
        return self._link.key(namespace_id, block_hash)

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
        """Frames for `hashes` (None = miss) by pipelined GET, each hit's TTL refreshed to at least `ttl_s`.

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
        ttl_ms = self._link.ttl_ms(ttl_s)
        frames = self._reader.fetch(
            namespace_id,
            hashes,
            ttl_ms,
            frame_bytes=frame_bytes,
            prefix_only=prefix_only,
            budget=budget,
            verify=verify,
            max_frame_bytes=max_frame_bytes,
        )
        if self._feed is not None:  # each hit's TTL was refreshed: others hold it longer too
            self._feed.announce((h for h, frame in zip(hashes, frames, strict=True) if frame is not None), ttl_ms)
        return frames

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
        key, ttl_ms = self._link.key(namespace_id, block_hash), self._link.ttl_ms(ttl_s)
        queued = self._writer.submit(key, frame, ttl_ms, done)
        if queued and self._feed is not None:
            self._feed.announce((block_hash,), ttl_ms)
        return queued

    def delete(self, namespace_id: str, block_hash: bytes) -> None:
        """Queue an UNLINK of one block (e.g. after it failed verification)."""
        self._writer.delete(self._link.key(namespace_id, block_hash))

    def expire(self, namespace_id: str, hashes: Sequence[bytes], ttls_s: Sequence[float]) -> None:
        """Queue one pipelined PEXPIRE per block (after the writes queued before it): pins and
        retention hints set a key's TTL. PEXPIRE never creates a key, so a block Redis lacks stays
        missing."""
        if len(hashes):
            keys = tuple(self._link.key(namespace_id, h) for h in hashes)
            ttls_ms = tuple(self._link.ttl_ms(t) for t in ttls_s)
            self._writer.expire(keys, ttls_ms)
            if self._feed is not None:  # PEXPIRE never creates a key: announced as held only if it was
                by_ttl: dict[int, list[bytes]] = {}
                for block_hash, ttl_ms in zip(hashes, ttls_ms, strict=True):
                    by_ttl.setdefault(ttl_ms, []).append(block_hash)
                for ttl_ms, same_ttl in by_ttl.items():
                    self._feed.announce(same_ttl, ttl_ms)

    def delete_namespace(self, namespace_id: str) -> None:
        """Queue a SCAN+UNLINK of every block of one namespace (on every cluster node)."""
        self._writer.delete_matching(f"{_escape(self.options.key_prefix)}:{_escape(namespace_id)}:*")

    def flush(self) -> None:
        """Queue a SCAN+UNLINK of every key under the key prefix (never FLUSHDB)."""
        self._writer.delete_matching(f"{_escape(self.options.key_prefix)}:*")

    def record_integrity_failure(self) -> None:
        with self._link.lock:
            self._link.counters.integrity_failures += 1

    def is_up(self) -> bool:
        return self._link.is_up()

    def link_estimate(self) -> TransferEstimate:
        """The link's measured latency and bandwidth (the prior until measured)."""
        return self._link.estimate()

    def stats(self) -> RedisStats:
        link = self._link
        with link.lock:
            write_state = link.write_breaker.state if link.breaker.is_up() else BreakerState.DOWN
            stats = RedisStats.of(
                link.counters,
                link.breaker.state,
                self._writer.queue_bytes,
                link.breaker.trips,
                link.meter.estimate(),
                write_state,
                link.write_breaker.trips,
                self._writer.set_seconds,
            )
        feed = self._feed
        if feed is None:
            return stats
        counters = feed.counters
        return dataclasses.replace(
            stats,
            presence_live=feed.live,
            presence_held=feed.held(),
            presence_announced=counters.announced,
            presence_followed=counters.followed,
            presence_resyncs=counters.resyncs,
        )

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued, in flight or unsettled (tests, shutdown)."""
        return self._writer.wait_idle(timeout_s)

    def own_frames(self, timeout_s: float) -> bool:
        """Stop reading the buffers `submit` was given: copy each queued frame that lies in them into
        bytes of its own (its `done` is called now), and wait up to `timeout_s` for the batch in
        flight, if any, to be done. False if it is not (its buffers may still be read until its
        `done`)."""
        return self._writer.own_frames(timeout_s)

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the presence feed and the writer: drain the queue until the deadline, drop the
        rest (counted). False if the writer is still running after that (a write stuck past its
        timeouts: then it may still read the buffers of a frame it was given), or the feed (it
        may still write its presence cells)."""
        feed_stopped = self._feed.close() if self._feed is not None else True
        if not self._writer.close(timeout_s):
            return False
        self._link.close_clients()
        return feed_stopped

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _escape(text: str) -> str:
    """Escape SCAN MATCH glob characters."""
    return _GLOB.sub(r"\\\1", text)
