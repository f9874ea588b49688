"""PrefixCache over a real host tier (shared memory) and a real Redis tier (redis-server).

What only the cache can show: blocks that leave a tiny host tier come back from Redis; a prefix
stored by one instance, or before a restart, is a hit on another; every Redis fault degrades to
the host tier and recovers without recreating the cache; a bad value under a block's key is a
counted miss that is deleted and never executed; a Redis hit slides the key's TTL; the same over
Redis Cluster, including a master killed and restarted. Every hit is compared byte for byte with what was stored (`hit_blocks`).

Servers come from tests/support/redis_server.py (`private_redis` where a test kills or pauses Redis).
Asynchronous writes are awaited with `RedisTier.wait_idle`; breaker state is polled with a
bounded deadline, never slept on.
"""

from __future__ import annotations

import pickle
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, DType, KVLayout, TenantQuota, TenantQuotas
from prefixcache.errors import InvalidArgument
from prefixcache.kinds import MissReason, TierKind
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.redis import RedisOptions, RedisTier
from tests.support.core import ManualClock, block_hashes, kv_for, namespace, read_blocks, same_bytes
from tests.support.poll import poll
from tests.support.redis_server import RedisClusterProcesses, RedisServer

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=DType.FLOAT16)  # 512-byte blocks
BS = LAYOUT.block_size
CACHE_TTL_S = 300.0
REDIS_TTL_S = 900.0  # deliberately not the cache's TTL: the Redis copy follows RedisOptions.ttl_s


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing a server never see each other's keys."""
    return f"c{secrets.token_hex(4)}"


@contextmanager
def redis_cache(
    url: str,
    key_prefix: str,
    host_slots: int = 16,
    clock: ManualClock | None = None,
    cache_ttl_s: float = CACHE_TTL_S,
    **redis_options,
) -> Iterator[tuple[PrefixCache, str]]:
    """A cache over a shared-memory host tier and a Redis tier with short breaker backoffs."""
    options = RedisOptions(
        **{
            "url": url,
            "key_prefix": key_prefix,
            "ttl_s": REDIS_TTL_S,
            "breaker_backoff_min_s": 0.05,
            "breaker_backoff_max_s": 0.4,
            **redis_options,
        }
    )
    host = HostTier(LAYOUT, host_slots * LAYOUT.block_bytes)
    cache = PrefixCache(
        CacheConfig(host_capacity=host_slots * LAYOUT.block_bytes, ttl_s=cache_ttl_s),
        LAYOUT,
        host,
        remote=RedisTier(options),
        clock=clock or ManualClock(),
    )
    try:
        yield cache, cache.attach(namespace(LAYOUT))
    finally:
        cache.close()


def tokens_for(seed: int, blocks: int) -> list[int]:
    """`blocks` full blocks of tokens no other seed shares (so prompts share no prefix)."""
    return [seed * 10_000 + i for i in range(blocks * BS)]


def store(cache: PrefixCache, ns: str, tokens: list[int]):
    return cache.store(ns, tokens, kv_for(tokens, LAYOUT))


def hit_blocks(cache: PrefixCache, ns: str, tokens: list[int]) -> int:
    """Blocks of `tokens` the cache hits, each checked byte for byte against what was stored."""
    result = cache.lookup(ns, tokens)
    hit = result.hit_tokens // BS
    if hit:
        assert same_bytes(read_blocks(cache, result.locations), kv_for(tokens, LAYOUT)[:hit])
    return hit


def keys_of(cache: PrefixCache, ns: str, tokens: list[int]) -> list[str]:
    return [cache.remote_link.tier.key(ns, h) for h in block_hashes(cache, ns, tokens)]


def remote_up(*caches: PrefixCache) -> Callable[[], bool]:
    return lambda: all(c.stats().remote_up is True for c in caches)


def remote_down(*caches: PrefixCache) -> Callable[[], bool]:
    return lambda: all(c.stats().remote_up is False for c in caches)


# ---- spill and return ---------------------------------------------------------------------------


def test_blocks_pushed_out_of_a_tiny_host_tier_come_back_from_redis(redis_server: RedisServer, prefix: str) -> None:
    with redis_cache(redis_server.url, prefix, host_slots=4) as (cache, ns):
        a, b = tokens_for(1, 4), tokens_for(2, 3)
        assert store(cache, ns, a).stored == 4
        assert store(cache, ns, b).stored == 3  # evicts a3, a2, a1 (leaf first); a0 stays
        assert cache.remote_link.tier.wait_idle(5)
        assert cache.stats().spills == {"host": 3}
        result = cache.lookup(ns, a)  # a0 from the host tier, a1..a3 from Redis
        assert result.hit_tokens == 4 * BS and result.miss_reason is None
        assert set(result.locations.tiers.tolist()) == {TierKind.HOST}
        assert same_bytes(read_blocks(cache, result.locations), kv_for(a, LAYOUT))
        stats = cache.stats()
        assert stats.promotions == {"host": 3} and stats.remote["hits"] == 3
        assert stats.spills == {"host": 6}  # admitting a1..a3 pushed b out in turn
        assert hit_blocks(cache, ns, b) == 3  # ...and b comes back the same way
        assert cache.stats().promotions == {"host": 6}


def test_match_counts_the_blocks_redis_is_believed_to_hold_without_asking_it(
    redis_server: RedisServer, prefix: str
) -> None:
    clock = ManualClock()
    with redis_cache(redis_server.url, prefix, host_slots=8, clock=clock, cache_ttl_s=2 * REDIS_TTL_S) as (cache, ns):
        a = tokens_for(1, 3)
        assert store(cache, ns, a).stored == 3
        assert cache.remote_link.tier.wait_idle(5)
        reads = cache.stats().remote.get("hits", 0)
        matched = cache.match(ns, a)
        assert (matched.blocks, matched.remote_blocks) == ({TierKind.HOST: 3}, 3)
        assert cache.stats().remote.get("hits", 0) == reads  # Redis was not asked
        clock.advance(REDIS_TTL_S + 1)  # the written-through copies have expired in Redis
        assert cache.match(ns, a).remote_blocks == 0
        assert cache.match(ns, a).blocks == {TierKind.HOST: 3}


def test_a_block_whose_write_through_was_dropped_is_spilled_on_eviction(
    private_redis: RedisServer, prefix: str
) -> None:
    with redis_cache(private_redis.url, prefix, host_slots=4) as (cache, ns):
        # The writer's first act is a PING; one answered before the kill but read after it would
        # bring the tier up again between the poll and the store. An op queued behind it settles that.
        cache.remote_link.tier.delete(ns, b"\0" * 16)
        assert cache.remote_link.tier.wait_idle(5)
        private_redis.kill()
        assert poll(lambda: hit_blocks(cache, ns, tokens_for(9, 1)) == 0 and remote_down(cache)(), 3)
        a = tokens_for(1, 4)
        assert store(cache, ns, a).stored == 4
        assert cache.stats().spills_dropped == 4  # the write-through found Redis down
        private_redis.start()
        assert poll(remote_up(cache), 5)
        assert store(cache, ns, tokens_for(2, 3)).stored == 3  # evicts a1..a3: now they are written
        assert cache.remote_link.tier.wait_idle(5)
        with private_redis.client() as raw:
            assert [raw.exists(key) for key in keys_of(cache, ns, a)] == [0, 1, 1, 1]
        assert hit_blocks(cache, ns, a) == 4
        assert cache.stats().promotions == {"host": 3}


def test_an_evicted_block_whose_redis_copy_has_expired_is_spilled_again(redis_server: RedisServer, prefix: str) -> None:
    """A host tier can keep a hot block longer than Redis keeps its written-through copy."""
    clock = ManualClock()
    with (
        redis_cache(redis_server.url, prefix, host_slots=4, clock=clock, cache_ttl_s=10 * REDIS_TTL_S) as (a, ns),
        redis_cache(redis_server.url, prefix) as (b, _),
    ):
        tokens = tokens_for(1, 4)
        assert store(a, ns, tokens).stored == 4 and a.remote_link.tier.wait_idle(5)
        with redis_server.client() as raw:
            clock.advance(REDIS_TTL_S + 1)  # past the Redis TTL, and Redis forgot them...
            raw.unlink(*keys_of(a, ns, tokens))
            assert hit_blocks(a, ns, tokens) == 4  # ...while local hits kept them warm here
            assert store(a, ns, tokens_for(2, 4)).stored == 4  # evicts all four
            assert a.remote_link.tier.wait_idle(5)
            assert raw.exists(*keys_of(a, ns, tokens)) == 4
        assert hit_blocks(b, ns, tokens) == 4


def test_a_slot_is_not_reused_while_its_block_is_still_being_sent_to_redis(
    private_redis: RedisServer, prefix: str
) -> None:
    """Write-through sends each block from its host slot. Redis stopped (SIGSTOP: it reads
    nothing) and a 4 KiB send buffer hold the writer mid-way through 4 MiB of blocks: a commit
    that needs those slots is refused after a bounded wait (RELEASE_WAIT_S) rather than reusing
    them or holding the cache up; once Redis reads again it evicts them, and what Redis got is
    exactly what was stored."""
    layout = KVLayout(layers=32, kv_heads=8, head_dim=64, block_size=4, dtype=DType.FLOAT16)  # 1 MiB blocks
    options = RedisOptions(url=private_redis.url, key_prefix=prefix, write_timeout_s=10, socket_timeout_s=10)
    host = HostTier(layout, 4 * layout.block_bytes)
    cache = PrefixCache(
        CacheConfig(host_capacity=4 * layout.block_bytes, ttl_s=CACHE_TTL_S), layout, host, remote=RedisTier(options)
    )
    try:
        ns = cache.attach(namespace(layout))
        tier = cache.remote_link.tier
        warm = tokens_for(9, 1)
        assert cache.store(ns, warm, kv_for(warm, layout)).stored == 1 and tier.wait_idle(5)
        assert cache.flush() == 1 and tier.wait_idle(5)
        pool = tier._link.write_client.connection_pool
        connections = [*pool._available_connections, *pool._in_use_connections]  # the writer's lanes
        for connection in connections:
            connection._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        a, b = tokens_for(1, 4), tokens_for(2, 3)
        private_redis.process.send_signal(signal.SIGSTOP)
        try:
            assert cache.store(ns, a, kv_for(a, layout)).stored == 4
            assert poll(lambda: len(tier._writer._ops.flight(-1)) > 0, 2)  # a pipeline of them stalled mid-send
            started = time.perf_counter()
            refused = cache.store(ns, b, kv_for(b, layout))
            assert (refused.stored, refused.rejected) == (0, 3)  # a's slots are still being read
            assert time.perf_counter() - started < 2.0  # waited RELEASE_WAIT_S, not for Redis
        finally:
            private_redis.process.send_signal(signal.SIGCONT)
        assert tier.wait_idle(10)
        for connection in connections:
            connection._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        assert cache.store(ns, b, kv_for(b, layout)).stored == 3  # a's writes are done: a1..a3 go
        assert tier.wait_idle(10)  # and b's, so that a's blocks can take their slots back
        result = cache.lookup(ns, a)  # a0 from the host tier, a1..a3 back from Redis
        assert result.hit_tokens == 4 * BS
        assert same_bytes(read_blocks(cache, result.locations), kv_for(a, layout))
        stats = cache.stats()
        assert stats.remote["hits"] == 3 and stats.remote["integrity_failures"] == 0
        assert stats.remote["writes_failed"] == 0 and stats.spills_dropped == 0
    finally:
        cache.close()


# ---- sharing across instances and restarts --------------------------------------------------------


def test_a_prefix_stored_through_one_instance_is_a_hit_on_another(redis_server: RedisServer, prefix: str) -> None:
    with redis_cache(redis_server.url, prefix) as (a, ns), redis_cache(redis_server.url, prefix) as (b, ns_b):
        assert ns_b == ns  # the namespace id is a hash, the same everywhere
        prompts = [tokens_for(seed, 5) for seed in (1, 2)]
        for tokens in prompts:
            assert store(a, ns, tokens).stored == 5
        assert a.remote_link.tier.wait_idle(5)
        assert [hit_blocks(b, ns, tokens) for tokens in prompts] == [5, 5]
        stats = b.stats()
        assert (stats.blocks_committed, stats.promotions, stats.remote["hits"]) == (0, {"host": 10}, 10)
        longer = prompts[0] + tokens_for(3, 2)  # shares five blocks, then diverges
        assert hit_blocks(b, ns, longer) == 5
        salted = b.attach(namespace(LAYOUT, cache_salt="tenant-b"))
        assert b.lookup(salted, prompts[0]).hit_tokens == 0  # another namespace never shares a block


def test_a_long_prefix_comes_back_in_several_round_trips_in_order(redis_server: RedisServer, prefix: str) -> None:
    """40 blocks: two probe batches (32 + 8), each split into round trips of at most 3 frames."""
    tokens = tokens_for(8, 40)
    with (
        redis_cache(redis_server.url, prefix, host_slots=48) as (a, ns),
        redis_cache(redis_server.url, prefix, host_slots=48, max_fetch_bytes=3 * LAYOUT.block_bytes) as (b, _),
    ):
        assert store(a, ns, tokens).stored == 40 and a.remote_link.tier.wait_idle(5)
        result = b.lookup(ns, tokens, take_lease=True)
        assert result.hit_tokens == 40 * BS and result.lease_id is not None
        assert same_bytes(read_blocks(b, b.lease(result.lease_id).locations), kv_for(tokens, LAYOUT))
        b.release(result.lease_id)
        remote = b.remote_link.tier.stats()
        assert (remote.hits, remote.misses, remote.read_latency.count) == (40, 0, 2)  # one fetch per probe batch


def test_concurrent_lookups_of_a_prefix_in_redis_all_hit_it(redis_server: RedisServer, prefix: str) -> None:
    """Lookups racing to admit the same blocks: the losers continue through the winner's blocks."""
    tokens = tokens_for(6, 8)
    with redis_cache(redis_server.url, prefix) as (a, ns), redis_cache(redis_server.url, prefix) as (b, _):
        assert store(a, ns, tokens).stored == 8 and a.remote_link.tier.wait_idle(5)
        start = threading.Barrier(6)

        def look() -> int:
            start.wait(5)
            return b.lookup(ns, tokens).hit_tokens // BS

        with ThreadPoolExecutor(6) as pool:
            hits = list(pool.map(lambda _: look(), range(6)))
        assert hits == [8] * 6
        assert b.stats().promotions == {"host": 8}  # each block admitted once
        assert hit_blocks(b, ns, tokens) == 8


def test_a_restarted_instance_hits_prefixes_stored_before_it_started(redis_server: RedisServer, prefix: str) -> None:
    prompts = [tokens_for(seed, 3) for seed in (1, 2, 3)]
    with redis_cache(redis_server.url, prefix) as (first, ns):
        for tokens in prompts:
            assert store(first, ns, tokens).stored == 3
    # no wait_idle: close() drains the write queue, as a graceful shutdown does
    with redis_cache(redis_server.url, prefix) as (restarted, ns):
        assert [hit_blocks(restarted, ns, tokens) for tokens in prompts] == [3, 3, 3]


# ---- faults ------------------------------------------------------------------------------------------


def test_sigkill_mid_stream_degrades_to_the_host_tier_and_recovers(private_redis: RedisServer, prefix: str) -> None:
    url, kill_at = private_redis.url, 6
    with redis_cache(url, prefix, host_slots=24) as (a, ns), redis_cache(url, prefix, host_slots=24) as (b, _):
        prompts = [tokens_for(seed, 4) for seed in range(1, 17)]
        for i, tokens in enumerate(prompts):
            if i == kill_at:
                private_redis.kill()
            assert store(a, ns, tokens).stored == 4
            assert hit_blocks(a, ns, tokens) == 4  # the host tier keeps serving its own blocks
            if i < kill_at:
                assert a.remote_link.tier.wait_idle(5) and hit_blocks(b, ns, tokens) == 4
            else:
                assert hit_blocks(b, ns, tokens) == 0  # never written: Redis was gone
        unknown = tokens_for(99, 1)  # a miss that asks Redis: drives both breakers
        assert poll(lambda: hit_blocks(a, ns, unknown) + hit_blocks(b, ns, unknown) == 0 and remote_down(a, b)(), 3)
        assert hit_blocks(a, ns, prompts[0]) == 0  # pushed out of a's host tier, Redis unreachable
        assert hit_blocks(a, ns, prompts[-1]) == 4
        dropped = a.stats().spills_dropped
        assert store(a, ns, tokens_for(50, 2)).stored == 2
        # refused at once while down, counted; so are the spills of the (up to) two blocks it
        # evicts, if their own write-through had found the breaker already down
        assert dropped + 2 <= a.stats().spills_dropped <= dropped + 4

        private_redis.start()  # empty: persistence is off
        began = time.monotonic()
        assert poll(remote_up(a, b), 5), "the tier must recover without recreating the cache"
        recovered_s = time.monotonic() - began
        fresh = tokens_for(60, 4)
        assert store(a, ns, fresh).stored == 4 and a.remote_link.tier.wait_idle(5)
        assert hit_blocks(b, ns, fresh) == 4
        assert recovered_s < 5


def test_a_paused_redis_costs_a_lookup_at_most_the_read_timeout(private_redis: RedisServer, prefix: str) -> None:
    timeout_s = 0.05
    url = private_redis.url
    with (
        redis_cache(url, prefix, socket_timeout_s=timeout_s) as (a, ns),
        redis_cache(url, prefix, socket_timeout_s=timeout_s) as (b, _),
    ):
        tokens = tokens_for(1, 4)
        assert store(a, ns, tokens).stored == 4 and a.remote_link.tier.wait_idle(5)
        private_redis.pause(1000)
        for _ in range(5):
            began = time.perf_counter()
            assert b.lookup(ns, tokens).hit_tokens == 0  # Redis holds it, but does not answer
            assert time.perf_counter() - began < timeout_s + 0.15
        assert b.stats().remote_up is False
        assert hit_blocks(a, ns, tokens) == 4  # local hits never wait on Redis
        assert poll(remote_up(b), 5)  # the pause ends; a probe brings it back
        assert hit_blocks(b, ns, tokens) == 4


def test_a_cache_created_while_redis_is_down_starts_promptly_and_picks_it_up(tmp_path: Path, prefix: str) -> None:
    server = RedisServer(tmp_path / "late")
    try:
        began = time.perf_counter()
        with redis_cache(server.url, prefix) as (a, ns):
            assert time.perf_counter() - began < 0.5
            early = tokens_for(1, 3)
            assert hit_blocks(a, ns, early) == 0
            assert store(a, ns, early).stored == 3 and hit_blocks(a, ns, early) == 3
            assert poll(remote_down(a), 2)
            server.start()
            assert poll(remote_up(a), 5)
            late = tokens_for(2, 3)
            assert store(a, ns, late).stored == 3 and a.remote_link.tier.wait_idle(5)
            with redis_cache(server.url, prefix) as (b, _):
                assert hit_blocks(b, ns, late) == 3
                assert hit_blocks(b, ns, early) == 0  # its write-through was dropped while down
    finally:
        server.kill()


# ---- integrity -----------------------------------------------------------------------------------------


class _TouchesFile:
    """Unpickling this creates a file: its absence proves nothing was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _flip_payload_byte(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0x01])


CORRUPTIONS: dict[str, Callable[[list[bytes], int, Path], bytes]] = {
    "flipped payload byte": lambda frames, i, _: _flip_payload_byte(frames[i]),
    "truncated value": lambda frames, i, _: frames[i][: len(frames[i]) - 7],
    "another block's value": lambda frames, i, _: frames[i + 1],
    "bad magic": lambda frames, i, _: b"XXXX" + frames[i][4:],
    "unknown version": lambda frames, i, _: frames[i][:4] + struct.pack("<H", 99) + frames[i][6:],
    "absurd header length": lambda frames, i, _: frames[i][:6] + struct.pack("<I", 0xFFFFFFFF) + frames[i][10:],
    "pickle": lambda frames, i, tmp: pickle.dumps(_TouchesFile(tmp / "pwned")),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_bad_value_under_a_block_key_is_a_counted_miss_and_is_deleted(
    redis_server: RedisServer, prefix: str, tmp_path: Path, corruption: str
) -> None:
    tokens = tokens_for(5, 4)
    with redis_cache(redis_server.url, prefix) as (writer, ns), redis_cache(redis_server.url, prefix) as (reader, _):
        assert store(writer, ns, tokens).stored == 4 and writer.remote_link.tier.wait_idle(5)
        keys = keys_of(reader, ns, tokens)
        with redis_server.client() as raw:
            frames = [raw.get(key) for key in keys]
            raw.set(keys[2], CORRUPTIONS[corruption](frames, 2, tmp_path), px=60_000)
            result = reader.lookup(ns, tokens)
            assert result.hit_tokens == 2 * BS  # stops before the bad block
            assert result.miss_reason is MissReason.VERIFICATION_FAILED
            assert same_bytes(read_blocks(reader, result.locations), kv_for(tokens, LAYOUT)[:2])
            stats = reader.stats()
            assert (stats.remote["integrity_failures"], reader.counters.remote_integrity_failures) == (1, 1)
            assert (stats.block_hits, stats.block_misses, stats.miss_reasons) == (2, 2, {"verification_failed": 1})
            assert reader.remote_link.tier.wait_idle(5)
            assert [raw.exists(key) for key in keys] == [1, 1, 0, 1]  # only the bad key is gone
            assert hit_blocks(reader, ns, tokens) == 2  # now a plain miss, not counted again
            assert reader.stats().remote["integrity_failures"] == 1
    assert not (tmp_path / "pwned").exists()


# ---- TTL -------------------------------------------------------------------------------------------------


def test_a_redis_hit_lengthens_the_key_ttl_and_a_local_hit_does_not(redis_server: RedisServer, prefix: str) -> None:
    full_ms = REDIS_TTL_S * 1000
    with redis_cache(redis_server.url, prefix) as (a, ns), redis_cache(redis_server.url, prefix) as (b, _):
        tokens = tokens_for(3, 3)
        assert store(a, ns, tokens).stored == 3 and a.remote_link.tier.wait_idle(5)
        keys = keys_of(a, ns, tokens)
        with redis_server.client() as raw:
            assert all(full_ms - 10_000 < raw.pttl(key) <= full_ms for key in keys)  # RedisOptions.ttl_s
            for key in keys:
                raw.pexpire(key, 2000)  # as if the keys had aged
            assert hit_blocks(a, ns, tokens) == 3  # local hit: Redis is not asked
            assert all(raw.pttl(key) <= 2000 for key in keys)
            assert hit_blocks(b, ns, tokens) == 3  # Redis hit: GETEX ... PX slides the TTL
            assert all(raw.pttl(key) > full_ms - 10_000 for key in keys)


def test_an_expired_redis_key_is_never_served(redis_server: RedisServer, prefix: str) -> None:
    with redis_cache(redis_server.url, prefix) as (a, ns), redis_cache(redis_server.url, prefix) as (b, _):
        tokens = tokens_for(4, 3)
        assert store(a, ns, tokens).stored == 3 and a.remote_link.tier.wait_idle(5)
        keys = keys_of(a, ns, tokens)
        with redis_server.client() as raw:
            raw.pexpire(keys[1], 1)
            assert poll(lambda: raw.pttl(keys[1]) == -2, 2)
        assert hit_blocks(b, ns, tokens) == 1
        assert b.stats().remote["integrity_failures"] == 0


# ---- Redis Cluster ---------------------------------------------------------------------------------------


def test_two_caches_share_prefixes_across_every_cluster_node(redis_cluster, prefix: str) -> None:
    url = redis_cluster.url
    with (
        redis_cache(url, prefix, host_slots=64, socket_timeout_s=0.5) as (a, ns),
        redis_cache(url, prefix, host_slots=64, socket_timeout_s=0.5) as (b, _),
    ):
        assert poll(remote_up(a, b), 10)  # the cluster client connects in the background
        prompts = [tokens_for(seed, 4) for seed in range(1, 13)]
        for tokens in prompts:
            assert store(a, ns, tokens).stored == 4
        assert a.remote_link.tier.wait_idle(10)
        assert [hit_blocks(b, ns, tokens) for tokens in prompts] == [4] * 12
        assert b.stats().remote["hits"] == 48 and a.stats().remote["writes_failed"] == 0
        per_node = []
        for node in redis_cluster.nodes:
            with node.client() as raw:
                per_node.append(sum(1 for _ in raw.scan_iter(match=f"{prefix}:*")))
        assert sum(per_node) == 48 and all(count > 0 for count in per_node), per_node


def test_a_killed_cluster_node_degrades_to_the_host_tier_and_the_cluster_recovers(tmp_path: Path, prefix: str) -> None:
    """A private 3-master cluster (no replicas); one master is SIGKILLed. Every lookup still
    answers, in bounded time, with only verified bytes; local hits never stop; once the node
    is back (its slots, not its data: persistence is off) the tier recovers by itself."""
    cluster = RedisClusterProcesses(tmp_path / "cluster").start()
    try:
        url = cluster.url
        with (
            redis_cache(url, prefix, host_slots=64, socket_timeout_s=0.5) as (a, ns),
            redis_cache(url, prefix, host_slots=64, socket_timeout_s=0.5) as (b, _),
        ):
            assert poll(remote_up(a, b), 10)
            prompts = [tokens_for(seed, 4) for seed in range(1, 13)]
            for tokens in prompts:
                assert store(a, ns, tokens).stored == 4
            assert a.remote_link.tier.wait_idle(10)
            victim = cluster.nodes[1]
            with victim.client() as raw:
                on_victim = sum(1 for _ in raw.scan_iter(match=f"{prefix}:*"))
            assert on_victim > 0
            victim.kill()
            for tokens in prompts:  # b holds nothing locally: every block is Redis's
                began = time.monotonic()
                hit = hit_blocks(b, ns, tokens)  # byte-checked when it hits
                assert 0 <= hit <= 4 and time.monotonic() - began < 3.0
                assert hit_blocks(a, ns, tokens) == 4  # a's own blocks never wait on Redis
            assert poll(lambda: hit_blocks(b, ns, tokens_for(99, 1)) == 0 and remote_down(b)(), 10)

            victim.restart()  # same port and nodes.conf: it rejoins, empty
            cluster.wait_ok(30)
            assert poll(remote_up(a, b), 10), "the tier must recover without recreating the cache"
            fresh = [tokens_for(seed, 4) for seed in range(20, 32)]
            for tokens in fresh:
                assert store(a, ns, tokens).stored == 4
            assert a.remote_link.tier.wait_idle(10)
            assert [hit_blocks(b, ns, tokens) for tokens in fresh] == [4] * 12  # every node serves again
            with victim.client() as raw:
                assert sum(1 for _ in raw.scan_iter(match=f"{prefix}:*")) > 0
    finally:
        cluster.stop()


# ---- operator pins (issue 34) ----------------------------------------------------------------------


def test_a_pin_warms_a_prefix_from_redis_into_the_host_tier_and_keeps_it_there(
    redis_server: RedisServer, prefix: str
) -> None:
    with redis_cache(redis_server.url, prefix, host_slots=4) as (cache, ns):
        a, b, c = tokens_for(1, 3), tokens_for(2, 4), tokens_for(3, 4)
        store(cache, ns, a)
        store(cache, ns, b)  # pushes a out of the host tier: only Redis holds it
        assert cache.remote_link.tier.wait_idle(5)
        assert cache.resident_blocks()[ns][TierKind.HOST] == 4
        pin = cache.pin(ns, a)  # promoted from Redis, then pinned
        assert len(pin.nodes) == 3 and cache.stats().promotions == {"host": 3}
        assert store(cache, ns, c).stored == 1  # one slot is not pinned; c's other blocks are rejected
        assert cache.remote_link.tier.wait_idle(5)
        promotions = cache.stats().promotions
        assert hit_blocks(cache, ns, a) == 3 and cache.stats().promotions == promotions  # from the host tier
        cache.unpin(pin.id)
        with pytest.raises(InvalidArgument) as caught:
            cache.pin(ns, tokens_for(4, 2))  # neither tier holds it: reported, nothing pinned
        assert caught.value.field == "tokens" and cache.pins() == []


def test_a_pin_of_higher_priority_releases_the_tenants_lower_pins_to_make_room(
    redis_server: RedisServer, prefix: str
) -> None:
    with redis_cache(redis_server.url, prefix, host_slots=4) as (cache, ns):
        a, b, d, e = tokens_for(1, 2), tokens_for(2, 3), tokens_for(3, 2), tokens_for(4, 2)
        for tokens in (b, e, a, d):  # b and e pushed out: only Redis holds them
            store(cache, ns, tokens)
        assert cache.remote_link.tier.wait_idle(5)
        low, high = cache.pin(ns, a, priority=1), cache.pin(ns, d, priority=50)
        assert [(p.id, p.priority) for _, p in cache.pins()] == [(low.id, 1), (high.id, 50)]
        with pytest.raises(InvalidArgument) as caught:  # the host tier is pinned full, nothing below 0
            cache.pin(ns, e, priority=0)
        assert caught.value.field == "tokens" and cache.stats().pins_displaced == 0
        middle = cache.pin(ns, b, priority=10)  # a (1) gives way; d (50) does not: 2 of b's 3 blocks fit
        assert len(middle.nodes) == 2 and hit_blocks(cache, ns, b) == 2
        assert {p.id for _, p in cache.pins()} == {middle.id, high.id}
        assert cache.stats().pins_displaced == 1
        with pytest.raises(InvalidArgument, match="unknown"):
            cache.unpin(low.id)  # released: ended like an unpin
        for bad in (101, -1, True, 2.5):
            with pytest.raises(InvalidArgument) as caught:
                cache.pin(ns, d, priority=bad)  # type: ignore[arg-type]
            assert caught.value.field == "priority"


def test_a_pins_redis_keys_outlive_the_redis_ttl_and_an_unpinned_prefixs_do_not(
    redis_server: RedisServer, prefix: str
) -> None:
    clock = ManualClock()
    with redis_cache(redis_server.url, prefix, clock=clock, ttl_s=1.0) as (cache, ns):  # Redis TTL 1 s
        pinned, plain, timed = tokens_for(1, 2), tokens_for(2, 2), tokens_for(3, 2)
        for tokens in (pinned, plain, timed):
            store(cache, ns, tokens)
        assert cache.remote_link.tier.wait_idle(5)
        pin = cache.pin(ns, pinned)  # no TTL: its keys are renewed by expire() every 0.25 s
        cache.pin(ns, timed, ttl_s=60)  # its keys: the pin's time left plus the Redis TTL
        assert cache.remote_link.tier.wait_idle(5)
        with redis_server.client() as raw:
            assert all(60_000 < raw.pttl(key) <= 61_000 for key in keys_of(cache, ns, timed))
            deadline = time.monotonic() + 1.6  # past the Redis TTL of every key written above
            while time.monotonic() < deadline:
                clock.advance(0.1)  # the service's ticker
                cache.expire()
                time.sleep(0.05)
            assert cache.remote_link.tier.wait_idle(5)
            assert all(raw.pttl(key) > 0 for key in keys_of(cache, ns, pinned))
            assert all(raw.pttl(key) == -2 for key in keys_of(cache, ns, plain))  # gone at the tier's TTL
            cache.unpin(pin.id)  # back to the tier's TTL, as if used now
            assert cache.remote_link.tier.wait_idle(5)
            keys = keys_of(cache, ns, pinned)
            assert all(0 < raw.pttl(key) <= 1000 for key in keys)
            assert poll(lambda: all(raw.pttl(key) == -2 for key in keys), 3)


def test_a_retention_hint_keeps_blocks_past_both_ttls_and_never_shortens_them(
    redis_server: RedisServer, prefix: str
) -> None:
    clock = ManualClock()
    with redis_cache(redis_server.url, prefix, clock=clock, cache_ttl_s=60) as (cache, ns):
        kept, plain = tokens_for(1, 3), tokens_for(2, 3)
        assert cache.store(ns, kept, kv_for(kept, LAYOUT), retention_s=7200).stored == 3
        store(cache, ns, plain)
        assert cache.store(ns, kept[: 2 * BS], kv_for(kept, LAYOUT)[:2], retention_s=0).deduplicated == 2
        assert cache.remote_link.tier.wait_idle(5)
        with redis_server.client() as raw:  # the Redis TTL (900 s) lengthened to the hint's
            assert all(7_000_000 < raw.pttl(key) <= 7_200_000 for key in keys_of(cache, ns, kept))
            assert all(raw.pttl(key) <= REDIS_TTL_S * 1000 for key in keys_of(cache, ns, plain))
        clock.advance(61)  # past the cache's TTL
        assert cache.expire() == 3 and cache.resident_blocks()[ns][TierKind.HOST] == 3  # plain's went
        promotions = cache.stats().promotions
        assert hit_blocks(cache, ns, kept) == 3  # retained in the host tier; the hit slides its last use
        assert cache.stats().promotions == promotions
        clock.advance(7199)  # 60 s + 7140 s of retention past the TTL, less a second
        assert cache.expire() == 0 and cache.lookup(ns, kept).miss_reason is None
        clock.advance(7201)
        assert cache.lookup(ns, kept).miss_reason is MissReason.EXPIRED
        assert cache.expire() == 3
        with pytest.raises(InvalidArgument) as caught:
            cache.store(ns, plain, kv_for(plain, LAYOUT), retention_s=-1)
        assert caught.value.field == "retention_seconds"


def test_within_a_tenants_host_quota_its_own_lower_pins_give_way(redis_server: RedisServer, prefix: str) -> None:
    quotas = TenantQuotas(overrides=(("acme", TenantQuota(host=2 * LAYOUT.block_bytes)),))
    options = RedisOptions(url=redis_server.url, key_prefix=prefix, ttl_s=REDIS_TTL_S)
    cache = PrefixCache(
        CacheConfig(host_capacity=8 * LAYOUT.block_bytes, tenant_quotas=quotas),
        LAYOUT,
        HostTier(LAYOUT, 8 * LAYOUT.block_bytes),
        remote=RedisTier(options),
        clock=ManualClock(),
    )
    try:
        ns = cache.attach(namespace(LAYOUT, tenant="acme"))
        a, b = tokens_for(1, 2), tokens_for(2, 2)
        store(cache, ns, b)
        store(cache, ns, a)  # over the quota: acme's own b goes to Redis
        assert cache.remote_link.tier.wait_idle(5) and cache.resident_blocks()[ns][TierKind.HOST] == 2
        low = cache.pin(ns, a, priority=1)
        with pytest.raises(InvalidArgument):  # the quota is pinned full and nothing is below 0
            cache.pin(ns, b, priority=0)
        high = cache.pin(ns, b, priority=5)  # a's pin gives way within the quota; the tier had room
        assert len(high.nodes) == 2 and [p.id for _, p in cache.pins()] == [high.id]
        assert cache.stats().pins_displaced == 1 and low.id not in {p.id for _, p in cache.pins()}
        assert cache.resident_blocks()[ns][TierKind.HOST] == 2  # still within the quota
    finally:
        cache.close()
