"""What Redis holds, told to every service that shares it: the presence table's remote cells.

A service with a Redis tier can hit blocks its own index lacks: another service's, or its own
that left its slot tiers. Its presence table (prefixcache/presence.py) therefore has remote cells,
and this feed keeps them. Every service announces, on the pub/sub channel `<key prefix>:held`,
the blocks it writes to Redis and those whose TTL it lengthens (a hit's refresh, a pin, a
retention hint), and follows that channel, its own announcements included: each block announced
is held in the remote cells until the TTL it was given ends.

- A message is `TAG`, the TTL in milliseconds (u32, little-endian), then at most `MAX_FPS` block
  fingerprints: each the first 8 bytes of a block's hash, as the key names it. Anything else on the
  channel is counted (`malformed`) and skipped; what a message says is advice (a Lookup still
  verifies every block), so a forged one costs Lookups, never wrong KV.
- Announcing never waits: the cache calls `announce` on its own paths (under its lock) and a
  thread of the feed publishes what has gathered, one pipelined round trip at a time.
- Following starts by subscribing, then reads the key space once (SCAN under the key prefix and
  each key's PTTL, between which it takes in the messages that arrived), then marks the cells
  live. Any fault of the subscription (a reset, a timeout, a PING unanswered for `DEAD_AFTER_S`)
  marks them not live, so engines look up every prompt again, until a new subscription has read
  the key space again: a block announced while no one followed is never reported absent.
- Sized by `RedisOptions.presence_blocks`. A table holding more than `OVERFULL` times that many
  blocks would lose blocks from full rows often enough to cost hits, so it then reads as unknown
  (a warning names the flag) until expiries bring it under `REFILL` times.
- A key Redis drops before its TTL (maxmemory eviction, another service's flush) stays in the
  cells until that TTL: a Lookup that misses, as without the table.
- On Redis Cluster the channel is a classic one, which the cluster bus carries to every node: a
  service subscribes on one node and publishes (one message per round trip: a cluster pipeline
  refuses PUBLISH) wherever its client sends it; the key space is read on every primary. A message
  the bus loses (a partition between two nodes whose PINGs each still answer) costs the hits on
  the blocks it named until they are written again: a Lookup skipped, never wrong KV.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import redis
import redis.exceptions
from redis.cluster import RedisCluster

from ..presence import RemoteHeld
from .redis_link import error_kind
from .redis_options import RedisClient, RedisOptions, connect, redact_url

log = logging.getLogger(__name__)

TAG = b"pfxh"
_HEAD = struct.Struct("<4sI")  # tag, TTL in milliseconds
MAX_FPS = 8192  # fingerprints per message (64 KiB)
MAX_PENDING = 1 << 20  # fingerprints gathered while Redis is slow (8 MiB); more are dropped, counted
GATHER_S = 0.002  # an announcement waits this long for others to share its round trip
PING_EVERY_S = 1.0  # the subscription's health check ...
DEAD_AFTER_S = 5.0  # ... and how long it may go unanswered before the subscription is redone
SWEEP_EVERY_S = 1.0  # expired blocks leave the cells within this
# Held blocks, as a multiple of the cells' capacity (a quarter full), past which full rows displace
# blocks often enough to cost hits: the cells then read as unknown until sweeps bring them under
# REFILL (`--redis-presence-blocks` too small for this Redis: a warning says so).
OVERFULL, REFILL = 2.0, 1.5
SCAN_COUNT = 1000  # keys per SCAN page (each page's PTTLs: one pipelined round trip)
RETRY_MIN_S, RETRY_MAX_S = 0.1, 5.0  # backoff between subscriptions


@dataclass
class FeedCounters:
    announced: int = 0  # fingerprints published
    announce_dropped: int = 0  # fingerprints never published (Redis down or too slow)
    followed: int = 0  # fingerprints taken in from the channel
    seeded: int = 0  # keys taken in from reading the key space
    malformed: int = 0  # messages on the channel that were not announcements
    resyncs: int = 0  # live subscriptions lost to a fault (each then redone)
    expired: int = 0  # blocks the cells forgot at the end of their TTL
    overfull: int = 0  # times the cells held too many blocks to be trusted (OVERFULL)


class RedisPresenceFeed:
    """Announces this service's Redis writes and follows everyone's into `held` (two threads,
    started here, stopped by `close`). `pattern`: a SCAN pattern of every block key."""

    def __init__(self, options: RedisOptions, held: RemoteHeld, pattern: str) -> None:
        self.channel = f"{options.key_prefix}:held"
        self._options = options
        self._held = held
        self._pattern = pattern
        self._pending: dict[int, list[bytes]] = {}  # TTL ms -> fingerprints (8 bytes each)
        self._pending_count = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._clients: set[RedisClient] = set()  # connections in use, cut by close
        self.counters = FeedCounters()
        self._overfull = False  # the cells hold too many blocks to be trusted (follower thread only)
        self._following = False  # the current subscription follows every write (follower thread only)
        self._threads = [
            threading.Thread(target=self._announce_loop, name="prefixcache-presence-announce", daemon=True),
            threading.Thread(target=self._follow_loop, name="prefixcache-presence-follow", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def live(self) -> bool:
        return self._held.live

    def announce(self, hashes: Iterable[bytes], ttl_ms: int) -> None:
        """Blocks written to Redis (or their TTL lengthened) with `ttl_ms`: published soon."""
        fps = [bytes(h[:8]) for h in hashes]
        if not fps:
            return
        with self._lock:
            if self._pending_count + len(fps) > MAX_PENDING:
                self.counters.announce_dropped += len(fps)
                return
            self._pending.setdefault(ttl_ms, []).extend(fps)
            self._pending_count += len(fps)
            self._wake.notify()

    def held(self) -> int:
        return self._held.held()

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop both threads, cutting their connections (a Redis dripping a reply could hold a
        read for ever); the cells are not trusted after this. False if a thread still runs after
        `timeout_s` (it may still write the cells: keep them mapped)."""
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
            clients = list(self._clients)
        for client in clients:
            _cut(client)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._held.set_live(False)
        running = [thread.name for thread in self._threads if thread.is_alive()]
        if running:
            log.warning("presence feed threads %s still running %.1f s after close", running, timeout_s)
        return not running

    def _connect(self, timeout_s: float) -> RedisClient:
        """A client `close` can cut."""
        client = connect(self._options.url, self._options, timeout_s)
        with self._lock:
            self._clients.add(client)
        if self._stop.is_set():  # close ran before it was registered
            _cut(client)
        return client

    def _forget(self, client: RedisClient) -> None:
        with self._lock:
            self._clients.discard(client)
        client.close()

    # ---- announcing -----------------------------------------------------------------------

    def _announce_loop(self) -> None:
        client: RedisClient | None = None
        backoff = RETRY_MIN_S
        while not self._stop.is_set():
            with self._lock:
                self._wake.wait_for(lambda: self._pending_count or self._stop.is_set())
            self._stop.wait(GATHER_S)
            with self._lock:
                pending, self._pending, self._pending_count = self._pending, {}, 0
            messages = [m for ttl_ms, fps in pending.items() for m in _messages(ttl_ms, fps)]
            count = sum(len(fps) for fps in pending.values())
            try:
                if client is None:
                    client = self._connect(self._options.write_timeout_s)
                _publish(client, self.channel, messages)
            except Exception as exc:  # as in _follow_loop: any fault drops these, none ends the feed
                with self._lock:
                    self.counters.announce_dropped += count
                log.debug("presence announcements dropped (%d blocks): %s", count, error_kind(exc))
                if client is not None:
                    self._forget(client)
                    client = None
                self._stop.wait(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
                continue
            backoff = RETRY_MIN_S
            with self._lock:
                self.counters.announced += count
        if client is not None:
            self._forget(client)

    # ---- following ------------------------------------------------------------------------

    def _follow_loop(self) -> None:
        backoff, reported = RETRY_MIN_S, False
        while not self._stop.is_set():
            self._following = False
            try:
                self._follow()
            # The feed is advice: any fault makes it not live, none ends it. That includes what a
            # hostile peer's replies make redis-py's pub/sub parser raise (TypeError, IndexError).
            except Exception as exc:
                if self._following:  # it was live: a new outage
                    reported, backoff = False, RETRY_MIN_S
                if not self._stop.is_set() and not reported:
                    reported = True
                    log.info(
                        "presence feed of %s down (%s); engines look up every prompt until it is back",
                        redact_url(self._options.url),
                        error_kind(exc),
                    )
                self._stop.wait(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)

    def _follow(self) -> None:
        """One subscription: subscribe, read the key space, follow until a fault or `close`."""
        # The writer's timeouts, not a read's: a SCAN page of a large Redis may take longer than 50 ms.
        client = self._connect(self._options.write_timeout_s)
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            self._await_subscribed(pubsub)
            self._seed(client, pubsub)
            if self._stop.is_set():  # closed while seeding: never live again, nor logged so
                return
            self._following = True  # every write from here on
            self._trust()
            log.info("presence feed of %s live: %d blocks held", redact_url(self._options.url), self._held.held())
            next_sweep = next_ping = time.monotonic()
            answered = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    pubsub.ping()
                    next_ping = now + PING_EVERY_S
                if now >= next_sweep:
                    expired = self._held.sweep()
                    with self._lock:
                        self.counters.expired += expired
                    self._trust()
                    next_sweep = now + SWEEP_EVERY_S
                message = pubsub.get_message(timeout=min(PING_EVERY_S, SWEEP_EVERY_S) / 2)
                if message is not None and message["type"] == "pong":
                    answered = time.monotonic()
                elif message is not None:
                    self._take(message)
                if time.monotonic() - answered > DEAD_AFTER_S:
                    raise _Unanswered(f"no PING answered for {DEAD_AFTER_S:.0f} s")
        finally:
            self._held.set_live(False)
            if self._following and not self._stop.is_set():
                with self._lock:
                    self.counters.resyncs += 1
            with contextlib.suppress(Exception):  # a peer's garbage may fail the close too
                pubsub.close()
            self._forget(client)

    def _trust(self) -> None:
        """Let readers trust the cells, unless they hold too many blocks to hold them well."""
        held, capacity = self._held.held(), self._held.capacity
        if not self._overfull and held > OVERFULL * capacity:
            self._overfull = True
            log.warning(
                "the presence table over Redis holds %d blocks, %.1fx the %d of --redis-presence-blocks: "
                "engines look up every prompt until it holds fewer (raise the flag)",
                held,
                held / capacity,
                capacity,
            )
            with self._lock:
                self.counters.overfull += 1
        elif self._overfull and held <= REFILL * capacity:
            self._overfull = False
            log.info("the presence table over Redis holds %d blocks again: trusted", held)
        self._held.set_live(not self._overfull)

    def _await_subscribed(self, pubsub: redis.client.PubSub) -> None:
        deadline = time.monotonic() + DEAD_AFTER_S
        while time.monotonic() < deadline and not self._stop.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message is not None and message["type"] == "subscribe":
                return
            if message is not None:
                self._take(message)
        raise _Unanswered("SUBSCRIBE not confirmed")

    def _seed(self, client: RedisClient, pubsub: redis.client.PubSub) -> None:
        """Every block key's fingerprint and TTL, taking in the channel between pages."""
        keys: list[bytes] = []
        for key in client.scan_iter(match=self._pattern, count=SCAN_COUNT):
            keys.append(key)
            if len(keys) >= SCAN_COUNT:
                self._seed_page(client, keys)
                keys = []
                self._drain(pubsub)
            if self._stop.is_set():
                return
        self._seed_page(client, keys)
        self._drain(pubsub)

    def _seed_page(self, client: RedisClient, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        by_ttl: dict[int, list[bytes]] = {}
        for key, ttl_ms in zip(keys, pipe.execute(), strict=True):
            fp = _key_fingerprint(key)
            if fp is not None and ttl_ms != -2:  # -2: gone since the SCAN
                by_ttl.setdefault(ttl_ms if ttl_ms > 0 else self._options.ttl_ms, []).append(fp)
        for ttl_ms, fps in by_ttl.items():
            self._held.add(np.frombuffer(b"".join(fps), dtype=np.uint64), ttl_ms / 1000)
            with self._lock:
                self.counters.seeded += len(fps)

    def _drain(self, pubsub: redis.client.PubSub) -> None:
        while (message := pubsub.get_message(timeout=0)) is not None:
            if message["type"] != "pong":
                self._take(message)

    def _take(self, message: dict[str, object]) -> None:
        data = message.get("data")
        if message.get("type") != "message" or not isinstance(data, bytes):
            return
        if len(data) < _HEAD.size or (len(data) - _HEAD.size) % 8 or len(data) > _HEAD.size + 8 * MAX_FPS:
            with self._lock:
                self.counters.malformed += 1
            return
        tag, ttl_ms = _HEAD.unpack_from(data)
        if tag != TAG or not ttl_ms:
            with self._lock:
                self.counters.malformed += 1
            return
        fps = np.frombuffer(data, dtype=np.uint64, offset=_HEAD.size)
        self._held.add(fps, ttl_ms / 1000)
        with self._lock:
            self.counters.followed += len(fps)


class _Unanswered(redis.exceptions.ConnectionError):
    """The subscription went quiet: no confirmation, or no PING answered in time."""


def _publish(client: RedisClient, channel: str, messages: list[bytes]) -> None:
    """One round trip for them all, except on a cluster (its pipeline refuses PUBLISH)."""
    if isinstance(client, RedisCluster):
        for message in messages:
            client.publish(channel, message)
        return
    pipe = client.pipeline(transaction=False)
    for message in messages:
        pipe.publish(channel, message)
    pipe.execute()


def _cut(client: RedisClient) -> None:
    """Disconnect every connection of `client`, in use or not: a thread blocked on one fails now."""
    if isinstance(client, RedisCluster):
        pools = [
            node.redis_connection.connection_pool for node in client.get_nodes() if node.redis_connection is not None
        ]
    else:
        pools = [client.connection_pool]
    for pool in pools:
        with contextlib.suppress(Exception):  # racing the thread that uses it: it only ends sooner
            pool.disconnect()


def _messages(ttl_ms: int, fps: list[bytes]) -> list[bytes]:
    head = _HEAD.pack(TAG, min(ttl_ms, 0xFFFFFFFF))
    return [head + b"".join(fps[i : i + MAX_FPS]) for i in range(0, len(fps), MAX_FPS)]


def _key_fingerprint(key: bytes) -> bytes | None:
    """The first 8 bytes of the block hash a key names (`<prefix>:<namespace>:<hash hex>`)."""
    digest = key.rsplit(b":", 1)[-1]
    try:
        return bytes.fromhex(digest[:16].decode("ascii")) if len(digest) >= 32 else None
    except (UnicodeDecodeError, ValueError):
        return None
