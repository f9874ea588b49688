"""Redis tier against a real redis-server: storage, TTL, integrity handling, every fault, cluster.

Servers come from tests/support/redis_server.py; tests that kill, pause or reconfigure
Redis use a private server. Waiting is always a bounded poll.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixcache.breaker import Backoff, BreakerState, CircuitBreaker, Retry
from prefixcache.codec import decode_block, encode_block, frame_parts
from prefixcache.config import DType, KVLayout
from prefixcache.errors import ConfigError, CorruptBlock
from prefixcache.tiers.redis import RedisOptions, RedisTier
from prefixcache.tiers.redis_options import connect
from tests.slow_proxy import SlowProxy
from tests.support.poll import poll
from tests.support.redis_server import RedisServer, make_tls_files

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, block_size=4, dtype=DType.FLOAT16)
NS = "00112233aabbccdd"
PARENT = bytes(16)
TOKENS = np.arange(4, dtype="<u4")


def block_hash(i: int) -> bytes:
    return i.to_bytes(16, "big")


def frame_for(i: int) -> bytes:
    payload = np.random.default_rng(i).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8).tobytes()
    return encode_block(LAYOUT, NS, block_hash(i), PARENT, TOKENS, payload)


def fast_options(url: str, **overrides) -> RedisOptions:
    """Short backoffs so recovery shows within a test's time budget."""
    values = dict(
        url=url,
        key_prefix=f"t{random.getrandbits(32):08x}",
        breaker_backoff_min_s=0.05,
        breaker_backoff_max_s=0.4,
        write_timeout_s=0.5,
    )
    values.update(overrides)
    return RedisOptions(**values)


@pytest.fixture
def tier(redis_server: RedisServer) -> Iterator[RedisTier]:
    with RedisTier(fast_options(redis_server.url)) as t:
        yield t


# ---- storage and TTL --------------------------------------------------------------------------


def test_submit_then_fetch_returns_the_frame(tier: RedisTier) -> None:
    frames = [frame_for(i) for i in range(3)]
    assert all(tier.submit(NS, block_hash(i), frames[i]) for i in range(3))
    assert tier.wait_idle(5)
    got = tier.fetch(NS, [block_hash(i) for i in range(4)])
    assert got[:3] == frames and got[3] is None
    payload = decode_block(got[1], LAYOUT, NS, block_hash(1), PARENT, TOKENS)
    assert payload.tobytes() == frames[1][-LAYOUT.block_bytes :]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.spills_queued, stats.state) == (3, 1, 3, BreakerState.UP)
    assert stats.bytes_written == stats.bytes_read == sum(map(len, frames))
    assert stats.read_latency.count == 1 and stats.write_latency.count >= 1
    assert tier.key(NS, block_hash(1)) == f"{tier.options.key_prefix}:{NS}:{block_hash(1).hex()}"


def test_a_hit_lengthens_the_ttl(tier: RedisTier, redis_server: RedisServer) -> None:
    tier.submit(NS, block_hash(1), frame_for(1), ttl_s=2.0)
    assert tier.wait_idle(5)
    key = tier.key(NS, block_hash(1))
    with redis_server.client() as raw:
        assert 0 < raw.pttl(key) <= 2000
        assert tier.fetch(NS, [block_hash(1)], ttl_s=600)[0] is not None
        assert raw.pttl(key) > 590_000
        tier.fetch(NS, [block_hash(1)])  # the default TTL from the options (3600 s)
        assert raw.pttl(key) > 3_590_000


def _pttl(server, key: str) -> int:
    """A key's PTTL as Redis holds it: a standalone server, or the cluster node owning the key."""
    if hasattr(server, "nodes"):
        with connect(server.url, RedisOptions(url=server.url)) as cluster:
            return int(cluster.pttl(key))
    with server.client() as raw:
        return int(raw.pttl(key))


@pytest.mark.parametrize("shape", ["standalone", "cluster"])
def test_another_instances_hit_lengthens_a_ttl_but_never_shortens_one(shape, request) -> None:
    """Two instances share one Redis. One keeps a block an hour (a retention hint, a pin); the
    other, whose TTL is a minute, reads it: the hour stands (`PEXPIRE ... GT`, where GETEX PX
    cut it to a minute). A key with less left than the reader's TTL is still lengthened to it."""
    server = request.getfixturevalue("redis_server" if shape == "standalone" else "redis_cluster")
    hinted = fast_options(server.url, ttl_s=3600, socket_timeout_s=0.5)
    with (
        RedisTier(hinted) as keeper,
        RedisTier(dataclasses.replace(hinted, ttl_s=60)) as reader,
    ):
        assert poll(lambda: keeper.is_up() and reader.is_up(), 10)
        assert keeper.submit(NS, block_hash(1), frame_for(1)) and keeper.submit(
            NS, block_hash(2), frame_for(2), ttl_s=2
        )
        assert keeper.wait_idle(5)
        for _ in range(3):
            assert reader.fetch(NS, [block_hash(1), block_hash(2)]) == [frame_for(1), frame_for(2)]
        assert _pttl(server, keeper.key(NS, block_hash(1))) > 3_500_000, "the longer TTL was kept"
        assert 50_000 < _pttl(server, keeper.key(NS, block_hash(2))) <= 60_000, "the shorter one was lengthened"
        assert reader.stats().read_errors == 0


def test_a_redis_that_refuses_pexpire_gt_is_read_with_getex(private_redis: RedisServer, caplog) -> None:
    """Where `PEXPIRE ... GT` is refused (a Redis before 7.0; here an ACL without PEXPIRE), the
    tier logs it once and refreshes with GETEX from then on: reads never fail over a refresh."""
    with private_redis.client() as raw:
        raw.execute_command("ACL", "SETUSER", "nopexpire", "on", ">pw", "~*", "+@all", "-pexpire")
    with RedisTier(fast_options(private_redis.url, ttl_s=60, username="nopexpire", password="pw")) as tier:
        assert poll(tier.is_up, 5)
        assert tier.submit(NS, block_hash(1), frame_for(1), ttl_s=3600) and tier.wait_idle(5)
        with caplog.at_level("WARNING", logger="prefixcache.tiers.redis_reader"):
            for _ in range(3):
                assert tier.fetch(NS, [block_hash(1)]) == [frame_for(1)]
        refusals = [r for r in caplog.records if "PEXPIRE ... GT refused" in r.getMessage()]
        assert len(refusals) == 1, "logged once, then GETEX"
        assert 50_000 < _pttl(private_redis, tier.key(NS, block_hash(1))) <= 60_000, "GETEX sets the TTL"
        stats = tier.stats()
        assert (stats.read_errors, stats.hits) == (0, 3)


def test_fetch_in_byte_bounded_round_trips_keeps_order(tier: RedisTier) -> None:
    frames = {i: frame_for(i) for i in (0, 1, 2, 4, 5)}
    for i, frame in frames.items():
        tier.submit(NS, block_hash(i), frame)
    assert tier.wait_idle(5)
    wanted = [block_hash(i) for i in range(6)]
    expected = [frames.get(i) for i in range(6)]
    # 2 frames per round trip, so three round trips
    assert tier.fetch(NS, wanted, frame_bytes=tier.options.max_fetch_bytes // 2) == expected
    assert tier.fetch(NS, wanted, frame_bytes=10 * tier.options.max_fetch_bytes) == expected  # one per trip
    assert tier.stats().hits == 10 and tier.stats().misses == 2


def test_prefix_only_stops_after_the_first_miss(tier: RedisTier, redis_server: RedisServer) -> None:
    """Blocks past a miss are not fetched, and so their TTL is not refreshed."""
    for i in (0, 2):
        tier.submit(NS, block_hash(i), frame_for(i), ttl_s=5)
    assert tier.wait_idle(5)
    got = tier.fetch(
        NS, [block_hash(i) for i in range(3)], ttl_s=600, frame_bytes=tier.options.max_fetch_bytes, prefix_only=True
    )
    assert got == [frame_for(0), None, None]
    with redis_server.client() as raw:
        assert raw.pttl(tier.key(NS, block_hash(0))) > 500_000
        assert raw.pttl(tier.key(NS, block_hash(2))) <= 5000
    one_trip = tier.fetch(NS, [block_hash(i) for i in range(3)], prefix_only=True)
    assert one_trip == [frame_for(0), None, None]  # block 2 was read in the same trip, but is past the miss


def test_an_expired_key_is_never_served(tier: RedisTier, redis_server: RedisServer) -> None:
    tier.submit(NS, block_hash(2), frame_for(2), ttl_s=0.05)
    assert tier.wait_idle(5)
    with redis_server.client() as raw:
        assert poll(lambda: raw.pttl(tier.key(NS, block_hash(2))) == -2, 3)
    assert tier.fetch(NS, [block_hash(2)]) == [None]


def test_integrity_failure_is_counted_and_the_key_deleted(
    tier: RedisTier, redis_server: RedisServer, tmp_path: Path
) -> None:
    """What the cache does with a pickle stored under a valid-looking key: a counted miss, key gone."""

    class CreatesFile:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    key = tier.key(NS, block_hash(3))
    with redis_server.client() as raw:
        raw.set(key, pickle.dumps(CreatesFile()), px=60_000)
        frame = tier.fetch(NS, [block_hash(3)])[0]
        with pytest.raises(CorruptBlock, match="bad magic"):
            decode_block(frame, LAYOUT, NS, block_hash(3), PARENT, TOKENS)
        tier.record_integrity_failure()
        tier.delete(NS, block_hash(3))
        assert tier.wait_idle(5)
        assert raw.exists(key) == 0
    assert not (tmp_path / "pwned").exists()
    assert tier.stats().integrity_failures == 1


def test_writes_alone_teach_the_link_meter_one_round_trips_latency(redis_server: RedisServer) -> None:
    """A lane sends its SETs one at a time, so a batch of n took n round trips: the link meter must
    see one round trip's share of it, not the whole batch as one round trip's latency."""
    with (
        SlowProxy(redis_server.port, latency_s=0.01, bytes_per_s=1e9) as proxy,
        RedisTier(fast_options(proxy.url, write_lanes=1, socket_timeout_s=2.0, write_timeout_s=5.0)) as tier,
    ):
        for i in range(48):
            assert tier.submit(NS, block_hash(i), frame_for(i))
        assert tier.wait_idle(30)
        estimate = tier.link_estimate()
    assert estimate.samples > 0
    assert 0.015 <= estimate.latency_s <= 0.06, estimate  # a round trip crosses the proxy twice: ~20 ms


def test_delete_namespace_and_flush_touch_only_their_keys(tier: RedisTier, redis_server: RedisServer) -> None:
    other_ns = "ffffffffffffffff"
    for i in range(5):
        tier.submit(NS, block_hash(i), b"a")
        tier.submit(other_ns, block_hash(i), b"b")
    assert tier.wait_idle(5)
    with redis_server.client() as raw:
        raw.set("unrelated:key", b"x")
        tier.delete_namespace(NS)
        assert tier.wait_idle(5)
        assert tier.fetch(NS, [block_hash(i) for i in range(5)]) == [None] * 5
        assert tier.fetch(other_ns, [block_hash(i) for i in range(5)]) == [b"b"] * 5
        tier.flush()
        assert tier.wait_idle(5)
        assert tier.fetch(other_ns, [block_hash(i) for i in range(5)]) == [None] * 5
        assert raw.get("unrelated:key") == b"x"  # never FLUSHDB


def test_a_foreign_value_type_is_a_miss_not_a_fault(tier: RedisTier, redis_server: RedisServer) -> None:
    with redis_server.client() as raw:
        raw.rpush(tier.key(NS, block_hash(9)), b"x")
    tier.submit(NS, block_hash(8), b"frame")
    assert tier.wait_idle(5)
    assert tier.fetch(NS, [block_hash(9), block_hash(8)]) == [None, b"frame"]
    assert tier.stats().read_errors == 0


def test_a_frame_in_parts_is_sent_from_its_buffers_until_done_whatever_the_outcome(private_redis: RedisServer) -> None:
    """The write-through path: header and payload view, never copied by the tier; `done` once per
    accepted write, when it is answered, copied by `own_frames`, or dropped at close."""
    slots = [bytearray(np.random.default_rng(i).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)) for i in range(6)]
    frames = [encode_block(LAYOUT, NS, block_hash(i), PARENT, TOKENS, bytes(slot)) for i, slot in enumerate(slots)]
    calls: list[int] = []

    def submit(tier: RedisTier, i: int) -> bool:
        parts = frame_parts(LAYOUT, NS, block_hash(i), PARENT, TOKENS, memoryview(slots[i]))
        return tier.submit(NS, block_hash(i), parts, done=lambda: calls.append(i))

    tier = RedisTier(fast_options(private_redis.url, write_timeout_s=5, write_lanes=1))  # 2, 3 queue behind 1
    try:
        assert submit(tier, 0) and tier.wait_idle(5)
        assert calls == [0]  # answered
        assert bytes(tier.fetch(NS, [block_hash(0)])[0]) == frames[0]
        private_redis.pause(1000)
        assert submit(tier, 1) and poll(lambda: not len(tier._writer._ops), 2)  # in flight, waiting on the pause
        assert submit(tier, 2) and submit(tier, 3)  # queued behind it
        assert not tier.own_frames(0.05) and calls == [0, 2, 3]  # 2 and 3 copied now; 1 still in flight
        assert tier.own_frames(5)  # 1 answered once the pause ends
        assert calls == [0, 2, 3, 1]
        for slot in slots[1:4]:
            slot[:] = bytes(len(slot))  # the slots are reused: nothing the tier sends may change
        assert tier.wait_idle(5) and tier.stats().writes_failed == 0
        assert [bytes(f) for f in tier.fetch(NS, [block_hash(i) for i in range(4)])] == frames[:4]
        private_redis.pause(1000)
        assert submit(tier, 4) and poll(lambda: not len(tier._writer._ops), 2)
        assert submit(tier, 5)
    finally:
        assert tier.close(timeout_s=0.1)  # 4 answered after the pause, 5 dropped (past the deadline)
    assert sorted(calls) == [0, 1, 2, 3, 4, 5] and len(calls) == 6
    assert tier.stats().spills_dropped == 1
    assert not submit(tier, 0) and len(calls) == 6  # refused: no done


# ---- back-pressure ------------------------------------------------------------------------------


def test_full_queue_drops_and_counts(private_redis: RedisServer) -> None:
    frame = frame_for(0)
    with RedisTier(fast_options(private_redis.url, max_queue_bytes=2 * len(frame) + 1)) as tier:
        assert tier.submit(NS, block_hash(0), frame + frame + frame) is False  # larger than the whole queue
        assert tier.submit(NS, block_hash(50), b"warm") and tier.wait_idle(5)  # the writer is past its first probe
        private_redis.pause(1500)  # the writer's next batch now waits: nothing drains
        accepted = [tier.submit(NS, block_hash(i), frame) for i in range(5)]
        start = time.perf_counter()
        assert tier.submit(NS, block_hash(99), frame) is False
        assert time.perf_counter() - start < 0.01  # refusing never blocks
        assert accepted == [True, True, False, False, False]
        stats = tier.stats()
        assert (stats.spills_queued, stats.spills_dropped) == (3, 5)
        assert stats.queue_bytes == 2 * len(frame)


# ---- faults ---------------------------------------------------------------------------------------


def test_sigkill_then_restart_on_the_same_port(private_redis: RedisServer) -> None:
    with RedisTier(fast_options(private_redis.url)) as tier:
        for i in range(400):
            if i == 100:
                private_redis.kill()
            tier.submit(NS, block_hash(i), frame_for(i % 7))
            got = tier.fetch(NS, [block_hash(i), block_hash(i + 1)])
            assert len(got) == 2
        assert poll(lambda: not tier.is_up(), 3)
        stats = tier.stats()
        assert stats.state is BreakerState.DOWN and stats.breaker_trips >= 1
        assert stats.read_errors + stats.writes_failed >= 1 and stats.reads_skipped > 0

        private_redis.start()
        assert poll(tier.is_up, 5), "the tier must recover without a restart"
        assert tier.submit(NS, block_hash(1000), b"after")
        assert tier.wait_idle(5)
        assert tier.fetch(NS, [block_hash(1000)]) == [b"after"]


# 64 KiB frames, eight to a pipeline: enough pipelines for a fault to land in the middle of one.
BIG_LAYOUT = KVLayout(layers=8, kv_heads=2, head_dim=64, block_size=16, dtype=DType.FLOAT16)
PIPELINED = 1200


def big_frame(i: int) -> bytes:
    payload = np.random.default_rng(i % 8).integers(0, 256, BIG_LAYOUT.block_bytes, dtype=np.uint8).tobytes()
    return encode_block(BIG_LAYOUT, NS, block_hash(i), PARENT, np.full(16, i, dtype="<u4"), payload)


def submit_pipelined(tier: RedisTier, raw) -> int:
    """Queue PIPELINED frames and return once Redis holds some of them and the writer has more."""
    frames = [big_frame(i) for i in range(PIPELINED)]  # encoded first: submitting must outpace the writer
    accepted = sum(tier.submit(NS, block_hash(i), frame) for i, frame in enumerate(frames))
    assert accepted == PIPELINED
    assert poll(lambda: raw.dbsize() > 0, 10)
    assert tier.stats().queue_bytes > 0, "the writer finished before the fault: nothing was in flight"
    return accepted


def test_a_connection_killed_mid_pipeline_loses_no_write_and_leaves_nothing_corrupt(private_redis: RedisServer) -> None:
    """The writer's connection dies with a pipeline sent and unanswered: it is re-sent on a new
    connection (SET is idempotent), every write is accounted, and every value in Redis verifies."""
    options = fast_options(private_redis.url, max_batch=8, max_queue_bytes=256 << 20, write_timeout_s=5)
    with RedisTier(options) as tier, private_redis.client() as raw:
        accepted = submit_pipelined(tier, raw)
        raw.client_kill_filter(_type="normal", skipme=True)
        assert tier.wait_idle(30)
        stats = tier.stats()
        frame_len = len(big_frame(0))
        assert stats.bytes_written % frame_len == 0
        assert stats.bytes_written // frame_len + stats.writes_failed == accepted
        assert stats.writes_failed == 0 and stats.spills_dropped == 0
        for i in range(PIPELINED):
            frame = raw.get(tier.key(NS, block_hash(i)))
            assert frame is not None, i
            decode_block(frame, BIG_LAYOUT, NS, block_hash(i), PARENT, np.full(16, i, dtype="<u4"))


def test_a_server_killed_mid_pipeline_counts_every_write_and_recovers(private_redis: RedisServer) -> None:
    options = fast_options(private_redis.url, max_batch=8, max_queue_bytes=256 << 20)
    with RedisTier(options) as tier:
        with private_redis.client() as raw:
            accepted = submit_pipelined(tier, raw)
        private_redis.kill()
        assert tier.wait_idle(30)
        stats = tier.stats()
        written, frame_len = divmod(stats.bytes_written, len(big_frame(0)))
        assert frame_len == 0
        # each accepted write was stored, failed or dropped once the breaker was down: never lost, never twice
        assert written + stats.writes_failed + stats.spills_dropped == accepted
        assert written < accepted and stats.writes_failed >= 1 and not stats.writes_up

        private_redis.start()
        assert poll(tier.is_up, 5), "the tier must recover without a restart"
        assert tier.submit(NS, block_hash(PIPELINED), big_frame(PIPELINED)) and tier.wait_idle(5)
        (frame,) = tier.fetch(NS, [block_hash(PIPELINED)])
        assert frame is not None
        tokens = np.full(16, PIPELINED, dtype="<u4")
        decode_block(frame, BIG_LAYOUT, NS, block_hash(PIPELINED), PARENT, tokens)


def test_a_paused_redis_costs_at_most_the_read_timeout(private_redis: RedisServer) -> None:
    options = fast_options(private_redis.url, socket_timeout_s=0.05)
    with RedisTier(options) as tier:
        tier.submit(NS, block_hash(1), b"x")
        assert tier.wait_idle(5) and tier.fetch(NS, [block_hash(1)]) == [b"x"]
        private_redis.pause(2000)
        for _ in range(5):
            start = time.perf_counter()
            assert tier.fetch(NS, [block_hash(1), block_hash(2)]) == [None, None]
            assert time.perf_counter() - start < options.socket_timeout_s + 0.1
        assert not tier.is_up()


def test_tier_started_before_redis_starts_fast_and_picks_it_up(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "late")
    try:
        start = time.perf_counter()
        tier = RedisTier(fast_options(server.url))
        assert time.perf_counter() - start < 0.5
        assert tier.fetch(NS, [block_hash(1)]) == [None]
        assert poll(lambda: not tier.is_up(), 2)
        server.start()
        assert poll(tier.is_up, 5)
        assert tier.submit(NS, block_hash(1), b"late") and tier.wait_idle(5)
        assert tier.fetch(NS, [block_hash(1)]) == [b"late"]
        tier.close()
    finally:
        server.kill()


def test_a_read_only_replica_keeps_serving_reads_and_refuses_writes(private_redis: RedisServer) -> None:
    """A replica answers READONLY to the TTL refresh (PEXPIRE) and SET: the tier reads with GET
    alone and only the write side goes down (issue 15.5)."""
    with RedisTier(fast_options(private_redis.url, breaker_failures=2)) as tier:
        assert tier.submit(NS, block_hash(1), b"x") and tier.wait_idle(5)
        with private_redis.client() as raw:
            raw.execute_command("REPLICAOF", "127.0.0.1", "1")  # no such master: keeps its data, read-only
        for i in range(2, 8):
            tier.submit(NS, block_hash(i), b"y")
            assert tier.wait_idle(5)
            assert tier.fetch(NS, [block_hash(1), block_hash(i)]) == [b"x", None]
        stats = tier.stats()
        assert stats.reads_up and not stats.writes_up and stats.writes_failed >= 2 and stats.reads_skipped == 0


def test_a_refused_connection_fails_open(private_redis: RedisServer) -> None:
    with RedisTier(fast_options(private_redis.url, breaker_failures=2)) as tier:
        assert tier.submit(NS, block_hash(1), b"x") and tier.wait_idle(5)
        with private_redis.client() as raw:  # new connections now need a password the tier lacks
            raw.config_set("requirepass", "s3cret")
            raw.client_kill_filter(_type="normal", skipme=True)
        for i in range(4):
            assert tier.fetch(NS, [block_hash(1)]) == [None]
            tier.submit(NS, block_hash(i), b"y")
        assert poll(lambda: not tier.is_up(), 3)
        assert tier.stats().read_errors >= 2


def test_out_of_memory_drops_writes_but_keeps_serving_reads(private_redis: RedisServer) -> None:
    """OOM refuses SET but not GET or PEXPIRE (not denyoom commands): hits continue, spills fail, counted,
    and once the write side is down (its own breaker) writes are dropped at submit, reads not."""
    with RedisTier(fast_options(private_redis.url)) as tier:
        assert tier.submit(NS, block_hash(1), b"x") and tier.wait_idle(5)
        with private_redis.client() as raw:
            raw.config_set("maxmemory-policy", "noeviction")
            raw.config_set("maxmemory", "1")
        accepted = 0
        for i in range(2, 12):
            accepted += tier.submit(NS, block_hash(i), b"y")
            assert tier.wait_idle(5)
            assert tier.fetch(NS, [block_hash(1), block_hash(i)]) == [b"x", None]
        stats = tier.stats()
        assert stats.writes_failed == accepted == tier.options.breaker_failures  # then the write side went down
        assert stats.reads_up and not stats.writes_up and stats.state is BreakerState.UP
        assert stats.write_state is BreakerState.DOWN and stats.reads_skipped == 0


# ---- cluster and connection variants ----------------------------------------------------------


def test_cluster_spreads_blocks_over_every_master(redis_cluster) -> None:
    with RedisTier(fast_options(redis_cluster.url, socket_timeout_s=0.5)) as tier:
        assert poll(tier.is_up, 10)
        hashes = [block_hash(i * 7919) for i in range(200)]
        assert all(tier.submit(NS, h, b"v" + h) for h in hashes)
        assert tier.wait_idle(10)
        assert tier.fetch(NS, hashes) == [b"v" + h for h in hashes]
        assert tier.stats().writes_failed == 0
        per_node = []
        for node in redis_cluster.nodes:
            with node.client() as raw:
                per_node.append(sum(1 for _ in raw.scan_iter(match=f"{tier.options.key_prefix}:*")))
        assert sum(per_node) == 200 and all(n > 0 for n in per_node), per_node
        tier.flush()
        assert tier.wait_idle(10)
        assert tier.fetch(NS, hashes[:10]) == [None] * 10


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = RedisServer(tmp_path / "unix", extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700"))
    server.start()
    try:
        with RedisTier(fast_options(f"unix://{sock}")) as tier:
            assert tier.submit(NS, block_hash(5), b"u") and tier.wait_idle(5)
            assert tier.fetch(NS, [block_hash(5)]) == [b"u"]
    finally:
        server.kill()


def test_tls_url_verifies_the_server_certificate(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    server = RedisServer(tmp_path / "tls-redis", tls=tls).start()
    try:
        assert server.url.startswith("rediss://")
        with RedisTier(fast_options(server.url, tls_ca_file=str(tls.ca))) as tier:
            assert tier.submit(NS, block_hash(6), b"secure") and tier.wait_idle(5)
            assert tier.fetch(NS, [block_hash(6)]) == [b"secure"]
        with RedisTier(fast_options(server.url)) as untrusting:  # system CAs do not know this one
            assert poll(lambda: not untrusting.is_up(), 3)
            assert untrusting.fetch(NS, [block_hash(6)]) == [None]
    finally:
        server.kill()


def test_connect_sets_every_timeout_and_disables_library_retries(redis_server: RedisServer) -> None:
    options = RedisOptions(url=redis_server.url, socket_timeout_s="40ms", connect_timeout_s=0.3)
    client = connect(options.url, options)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.04, 0.3)
    assert kwargs["retry"].get_retries() == 0
    assert client.ping()
    with redis_server.client() as raw:
        assert any(c["name"] == "prefixcache" for c in raw.client_list())  # named for operators
    client.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("url", "http://localhost:6379"),
        ("key_prefix", "a{b}"),
        ("key_prefix", "x*"),
        ("socket_timeout_s", 0),
        ("max_batch", 0),
        ("tls_ca_file", "/ca.pem"),
        ("read_deadline_s", "10ms"),  # under the 50 ms per-wait timeout
        ("write_deadline_s", "x"),
    ],
)
def test_bad_options_name_the_field(field: str, value: object) -> None:
    values = {"url": "redis://127.0.0.1:1", field: value}
    with pytest.raises(ConfigError, match=field if field != "url" else "redis_url"):
        RedisOptions(**values)


def test_whole_exchange_deadlines_default_to_four_timeouts() -> None:
    options = RedisOptions(url="redis://127.0.0.1:1", socket_timeout_s="50ms", write_timeout_s=0.5)
    assert (options.read_deadline_s, options.write_deadline_s) == (0.2, 2.0)
    assert RedisOptions(url="redis://127.0.0.1:1", read_deadline_s="1s").read_deadline_s == 1.0


def test_password_is_not_in_repr() -> None:
    assert "hunter2" not in repr(RedisOptions(url="redis://127.0.0.1:1", password="hunter2"))


# ---- breaker and retry (no Redis: a hand-driven clock) --------------------------------------


def test_breaker_opens_after_n_failures_and_probes_with_growing_jittered_backoff() -> None:
    now = [0.0]
    breaker = CircuitBreaker("dep", 3, Backoff(1.0, 4.0), clock=lambda: now[0], rng=random.Random(7))
    breaker.record_failure("x")
    breaker.record_failure("x")
    breaker.record_success()  # resets the run of failures
    breaker.record_failure("x")
    breaker.record_failure("x")
    assert breaker.is_up()
    breaker.record_failure("x")
    assert breaker.state is BreakerState.DOWN and breaker.trips == 1
    delays = []
    for _ in range(5):
        wait = breaker.seconds_until_probe()
        assert not breaker.probe_due() and wait > 0
        delays.append(wait)
        now[0] += wait
        assert breaker.probe_due()
        breaker.record_failure("probe")
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0
    assert all(2.0 <= d <= 4.0 for d in delays[2:])  # capped at max_s, never below half of it
    breaker.record_success()
    assert breaker.is_up() and breaker.seconds_until_probe() == 0.0


def test_retry_runs_only_on_listed_errors_and_counts_attempts() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    sleeps: list[float] = []
    retry = Retry(2, Backoff(0.01, 0.02), (ConnectionError,))
    assert retry.call(flaky, random.Random(1), sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2
    with pytest.raises(ValueError):
        retry.call(lambda: (_ for _ in ()).throw(ValueError("bug")), random.Random(1), sleep=sleeps.append)
    assert len(sleeps) == 2  # a non-listed error is never retried
