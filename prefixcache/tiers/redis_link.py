"""What the Redis tier's reader and writer share: the clients, the two breakers, the counters
and the link meter, under one lock; and how a Redis error is told apart and logged.

`RedisTier` (tiers/redis.py) builds one `RedisLink` and hands it to its `RedisReader`
(tiers/redis_reader.py) and its `RedisWriter` (tiers/redis_writer.py). The link breaker
(`breaker`) counts faults of the connection from both sides; the write breaker
(`write_breaker`) only writes Redis refused (`WRITE_REFUSALS`). The clients are built here
without I/O, or later by the writer's first probe (a Redis Cluster client does I/O to build).
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable

import redis.exceptions

from ..breaker import Backoff, CircuitBreaker
from ..transfer import TransferEstimate, TransferMeter
from .redis_options import RedisClient, RedisOptions, connect, is_cluster_url, redact_url
from .redis_stats import RedisCounters

# What a Redis fault can raise through redis-py: every RedisError (connection,
# timeout, OOM, READONLY, NOAUTH/NOPERM, CLUSTERDOWN, protocol errors), the
# cluster client's own exception base, and socket/TLS errors.
REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
WRITE_REFUSALS = frozenset({"OOM", "READONLY", "MISCONF", "NOREPLICAS"})  # Redis answered: no writes now
# Until measured: a Redis on the same host or rack (loopback: ~0.2 ms per pipelined round
# trip, ~1 GB/s of replies, see docs/benchmarks.md); the meter replaces it within a few trips.
LINK_PRIOR = TransferEstimate(latency_s=0.0005, bytes_per_s=1e9)


class RedisLink:
    """The tier's shared state. `lock` guards `counters`, `meter` and the writer's queue
    figures; `changed` (on the same lock) wakes the writer's lane 0 (new work, a fault, close)."""

    def __init__(
        self,
        options: RedisOptions,
        client: RedisClient | None,
        write_client: RedisClient | None,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.options = options
        self.clock = clock
        self.rng = rng
        self._default_ttl_ms = options.ttl_ms  # options are frozen; read on every submit
        backoff = Backoff(options.breaker_backoff_min_s, options.breaker_backoff_max_s)
        name = f"redis tier {redact_url(options.url)}"
        self.breaker = CircuitBreaker(name, options.breaker_failures, backoff, clock, rng)
        self.write_breaker = CircuitBreaker(f"{name} writes", options.breaker_failures, backoff, clock, rng)
        self.plain_get = False  # the TTL refresh was refused as a write: read with GET until writes work
        self.extend_ttl = True  # refresh with PEXPIRE ... GT (Redis >= 7); False: GETEX PX, which resets
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.counters = RedisCounters()
        self.meter = TransferMeter(LINK_PRIOR, clock=clock)
        self.owns_clients = client is None
        self.read_client: RedisClient | None = client
        self.write_client: RedisClient | None = write_client or client
        if client is None and not is_cluster_url(options.url):
            self.read_client, self.write_client = self.build_clients()  # no I/O for a standalone client

    def key(self, namespace_id: str, block_hash: bytes) -> str:
        return f"{self.options.key_prefix}:{namespace_id}:{block_hash.hex()}"

    def ttl_ms(self, ttl_s: float | None) -> int:
        return self._default_ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))

    def build_clients(self) -> tuple[RedisClient, RedisClient]:
        """A read client and a write client (a cluster client does I/O to be built)."""
        url = self.options.url
        return (
            connect(url, self.options, self.options.socket_timeout_s),
            connect(url, self.options, self.options.write_timeout_s),
        )

    def close_clients(self) -> None:
        """Close the clients the tier built (never the caller's)."""
        if self.owns_clients:
            for client in {id(c): c for c in (self.read_client, self.write_client) if c is not None}.values():
                client.close()

    def is_up(self) -> bool:
        return self.read_client is not None and self.breaker.is_up()

    def writes_up(self) -> bool:
        return self.breaker.is_up() and self.write_breaker.is_up()

    def wrote(self) -> None:
        """A write went through: the link works, Redis takes writes (and TTL refreshes again)."""
        self.breaker.record_success()
        self.write_breaker.record_success()
        self.plain_get = False

    def observe(self, nbytes: int, seconds: float) -> None:
        """One round trip of the link, read or write (a read that timed out: at least this slow)."""
        with self.lock:
            self.meter.observe(nbytes, seconds)

    def estimate(self) -> TransferEstimate:
        """The link's measured latency and bandwidth (the prior until measured)."""
        with self.lock:
            return self.meter.estimate()


_REDIS_CODE = re.compile(r"[A-Z][A-Z_]{1,31}")


# redis-py turns these codes into exception classes and strips them from the message
_CODE_OF_CLASS = ((redis.exceptions.OutOfMemoryError, "OOM"), (redis.exceptions.ReadOnlyError, "READONLY"))


def redis_code(exc: BaseException) -> str | None:
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
    code = redis_code(exc)
    return f"{type(exc).__name__} {code}" if code else type(exc).__name__


def key_hint(key: str) -> str:
    """`prefix:namespace-prefix…:hash-prefix…` of a key or key pattern: enough to tell which."""
    parts = key.rsplit(":", 2)
    if len(parts) < 3:
        return parts[0][:16]
    prefix, namespace, block = parts
    return f"{prefix}:{namespace[:12]}…:{block[:8]}…" if block != "*" else f"{prefix}:{namespace[:12]}…:*"
