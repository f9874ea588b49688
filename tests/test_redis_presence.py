"""The presence table of services that share one Redis (prefixcache/tiers/redis_presence.py): each
service's table shows what the other stored, what Redis held before it started, and drops what
Redis's TTL ended; while its feed is not live (subscribing, reading the key space, after a fault)
its engines read None and look every prompt up. Real services, real gRPC, real shared memory and a
real redis-server."""

from __future__ import annotations

import contextlib
import logging
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.hashing import Hasher
from prefixcache.presence import MAGIC_V1, WAYS, PresenceView, RemoteHeld
from prefixcache.tiers.redis import RedisTier
from prefixcache.tiers.redis_options import RedisOptions
from prefixcache.tiers.redis_presence import DEAD_AFTER_S, TAG, RedisPresenceFeed
from prefixcache.tiers.shm import SHM_DIR, OwnedSegment
from prefixcache_services.cache_server.auth import Authenticator
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.command import options_from
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from prefixcache_services.cli import build_parser
from tests.support.service import BLOCK, layout_of, prompt, random_kv

pytestmark = pytest.mark.process

SETTLE_S = 10.0  # a feed goes live, or an announcement arrives, well within this on loopback


@pytest.fixture
def services(private_redis) -> Iterator[Callable[..., object]]:
    """`make(**redis_options)`: a started service over `private_redis`, with a same-host client
    attached (returned as (server, client)); all stopped on exit."""
    with _services(private_redis.url) as make:
        yield make


@contextlib.contextmanager
def _services(url: str) -> Iterator[Callable[..., object]]:
    from prefixcache.client.api import CacheClient

    started = []

    def make(**redis_options):
        options = RedisOptions(url=url, **redis_options)
        backend = BackendOptions(
            cache=CacheConfig(host_capacity=64 * layout_of().block_bytes),
            block_size=BLOCK,
            remote_factory=lambda _layout: RedisTier(options),
        )
        server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0", authenticator=Authenticator.open()))
        client = CacheClient(server.address, timeout_s=10)
        client.attach("model", layout_of())
        started.append((server, client))
        return server, client

    try:
        yield make
    finally:
        for server, client in started:
            client.close()
            server.shutdown(0)


def _until(read: Callable[[], object], expected: object, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (got := read()) != expected:
        assert time.monotonic() < deadline, f"{what}: {got!r}, expected {expected!r}"
        time.sleep(0.01)


def _store(client, tokens: list[int], seed: int = 0) -> None:
    client.store(tokens, random_kv(len(tokens) // BLOCK, layout_of(), seed=seed))


def _remote(server) -> dict[str, float]:
    return server.backend.cache.remote_link.figures()


def test_each_service_sees_what_another_stored_and_its_lookup_hits(services):
    server_a, a = services()
    server_b, b = services()
    tokens = prompt(6)
    _until(lambda: b.held_tokens(tokens), 0, "b's table once live")  # None until its feed is live
    _store(a, tokens[: 4 * BLOCK])
    _until(lambda: b.held_tokens(tokens), 4 * BLOCK, "b's table after a stored 4 blocks")
    hit = b.lookup(tokens)  # the table's advice is what b's Lookup finds (through Redis)
    assert hit.hit_tokens == 4 * BLOCK
    b.release(hit)
    _store(b, tokens)  # and the other way round: a sees b's two new blocks
    _until(lambda: a.held_tokens(tokens), 6 * BLOCK, "a's table after b stored 6 blocks")
    salted = [token + 7_000 for token in prompt(3)]  # no prefix of the unsalted prompt above
    a.store(salted, random_kv(3, layout_of(), seed=3), cache_salt="user-1")
    _until(lambda: b.held_tokens(salted, "user-1"), 3 * BLOCK, "b's table under a salt")
    assert b.held_tokens(salted) == 0  # unsalted: other hashes
    figures = _remote(server_b)
    assert figures["presence_live"] == 1 and figures["presence_followed"] >= 4 + 2 + 3
    assert figures["presence_announced"] >= 2  # b's own writes


def test_a_service_started_later_reads_what_redis_already_holds(services):
    server_a, a = services()
    tokens = prompt(5)
    _store(a, tokens)
    server_a.backend.cache.remote_link.tier.wait_idle(5.0)  # the SETs are in Redis
    server_b, b = services()
    _until(lambda: b.held_tokens(tokens), 5 * BLOCK, "b's table, seeded from the key space")
    assert _remote(server_b)["presence_held"] >= 5


def test_blocks_leave_the_table_when_their_redis_ttl_ends(services):
    server_a, a = services(ttl_s=1.0)
    server_b, b = services(ttl_s=1.0)
    tokens = prompt(3)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    _store(a, tokens)
    _until(lambda: b.held_tokens(tokens), 3 * BLOCK, "b sees a's blocks")
    _until(lambda: b.held_tokens(tokens), 0, "b after their TTL ended")  # 1 s TTL, a sweep a second
    assert a.held_tokens(tokens) == 3 * BLOCK  # a's index still holds them: a Lookup there hits


def test_while_redis_is_away_engines_look_everything_up(services, private_redis):
    server_b, b = services()
    tokens = prompt(2)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    private_redis.kill()
    _until(lambda: b.held_tokens(tokens), None, "b after Redis died")  # the feed cannot vouch: unknown
    private_redis.start()
    _until(lambda: b.held_tokens(tokens), 0, "b after Redis came back")
    assert _remote(server_b)["presence_resyncs"] >= 1
    server_a, a = services()
    _store(a, tokens)
    _until(lambda: b.held_tokens(tokens), 2 * BLOCK, "b follows again")


def test_a_redis_that_stops_answering_reads_as_unknown_until_it_answers(services, private_redis):
    """No reset, no error: only PINGs that go unanswered (DEAD_AFTER_S) tell the feed it is deaf."""
    server_b, b = services()
    tokens = prompt(2)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    private_redis.pause(int((DEAD_AFTER_S + 2) * 1000))
    _until(lambda: b.held_tokens(tokens), None, "b while Redis answers nothing")
    _until(lambda: b.held_tokens(tokens), 0, "b once Redis answers again")


def test_a_cut_subscription_is_redone(services, private_redis):
    server_b, b = services()
    tokens = prompt(2)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    with private_redis.client() as admin:
        killed = admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert killed >= 1
    _until(lambda: _remote(server_b)["presence_resyncs"] >= 1, True, "the feed saw its subscription go")
    _until(lambda: b.held_tokens(tokens), 0, "b live again")


def test_anything_else_on_the_channel_is_counted_and_changes_nothing(services, private_redis):
    server_b, b = services()
    tokens = prompt(2)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    head = struct.Struct("<4sI")
    junk = [
        b"",
        b"not an announcement",
        head.pack(b"nope", 1000) + b"\1" * 8,  # another tag
        head.pack(TAG, 0) + b"\1" * 8,  # no TTL
        head.pack(TAG, 1000) + b"\1" * 7,  # not whole fingerprints
        head.pack(TAG, 1000) + b"\1" * 8 * 9000,  # longer than any announcement
    ]
    with private_redis.client() as admin:
        for message in junk:
            assert admin.publish("pfx:held", message) >= 1
    _until(lambda: server_b.backend.cache.remote_link.tier._feed.counters.malformed, len(junk), "junk counted")
    assert b.held_tokens(tokens) == 0 and _remote(server_b)["presence_live"] == 1


def test_a_table_too_small_for_what_redis_holds_reads_as_unknown_not_absent(services):
    """Past OVERFULL x its capacity, full rows would drop blocks (lost hits): it says None instead."""
    server_b, b = services(presence_blocks=4, ttl_s=2.0)  # 2 rows of 8 cells, capacity 4
    server_a, a = services(presence_blocks=4, ttl_s=2.0)
    tokens = prompt(16)
    _until(lambda: b.held_tokens(tokens), 0, "b live")
    _store(a, tokens)  # 16 blocks: 4x capacity
    _until(lambda: b.held_tokens(tokens), None, "b overfull")
    assert server_b.backend.cache.remote_link.tier._feed.counters.overfull == 1
    _until(lambda: b.held_tokens(tokens), 0, "b once their TTL emptied it")


def test_settings_that_cannot_be_followed_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="presence_blocks"):
        RedisOptions(url="redis://127.0.0.1:6379/0", presence_blocks=-1)
    with pytest.raises(ConfigError, match="redis_presence_blocks.*needs --redis-url"):
        options_from(build_parser().parse_args(["serve", "--redis-presence-blocks", "0"]))


def test_services_on_a_redis_cluster_see_each_others_blocks_on_every_node(redis_cluster):
    """The channel reaches every node's subscribers whichever node a PUBLISH goes to; a service
    started later reads the key space of every primary; close cuts every node's connections."""
    key_prefix = f"p{secrets.token_hex(4)}"  # the cluster is shared by the session's tests
    with _services(redis_cluster.url) as make:
        server_a, a = make(key_prefix=key_prefix, socket_timeout_s=0.5)
        server_b, b = make(key_prefix=key_prefix, socket_timeout_s=0.5)
        prompts = [prompt(4, 1000 * seed) for seed in range(1, 7)]  # 24 blocks: on every master
        for tokens in prompts:
            _until(lambda tokens=tokens: b.held_tokens(tokens), 0, "b live on the cluster")
        for seed, tokens in enumerate(prompts):
            _store(a, tokens, seed)
        for tokens in prompts:
            _until(lambda tokens=tokens: b.held_tokens(tokens), 4 * BLOCK, "b sees a's blocks")
        hit = b.lookup(prompts[0])
        assert hit.hit_tokens == 4 * BLOCK
        b.release(hit)
        assert server_a.backend.cache.remote_link.tier.wait_idle(10.0)
        per_node = []
        for node in redis_cluster.nodes:
            with node.client() as raw:
                per_node.append(sum(1 for _ in raw.scan_iter(match=f"{key_prefix}:*")))
        assert sum(per_node) == 24 and sum(count > 0 for count in per_node) >= 2, per_node
        server_c, c = make(key_prefix=key_prefix, socket_timeout_s=0.5)
        for tokens in prompts:
            _until(lambda tokens=tokens: c.held_tokens(tokens), 4 * BLOCK, "c, seeded from every primary")
        assert _remote(server_c)["presence_held"] >= 24
        feed = server_c.backend.cache.remote_link.tier._feed
        began = time.monotonic()
        assert feed.close(timeout_s=5.0) and time.monotonic() - began < 2.0


def test_no_remote_cells_with_presence_blocks_zero(services):
    server, client = services(presence_blocks=0)
    _store(client, prompt(2))
    assert client.held_tokens(prompt(2)) is None  # no table: every prompt is looked up
    assert server.backend.presence_of(client.attachment.namespace_id) is None


def test_an_older_services_segment_is_still_read():
    """A v1 segment (the index's cells only, no remote state word) reads as before."""
    segment = OwnedSegment("prefixcache-test-v1", 64 + 8 * 8, directory=SHM_DIR)
    try:
        segment.buf[:24] = struct.pack("<8sIIQ", MAGIC_V1, 8, 0, 1)
        view = PresenceView(segment.name, b"r" * 16, Hasher(), BLOCK)
        assert view.held_tokens(prompt(2)) == 0  # nothing held, and answered (not None)
    finally:
        with contextlib.suppress(Exception):
            segment.close()


class _RecordedHeld(RemoteHeld):
    """Remote cells that remember every time they were marked live."""

    def __init__(self) -> None:
        super().__init__(np.zeros((64, WAYS), dtype=np.uint64), np.zeros(1, dtype=np.uint32))
        self.marked_live = 0

    def set_live(self, live: bool) -> None:
        self.marked_live += live
        super().set_live(live)


class _ClosedWhileSeeding(RedisPresenceFeed):
    """A feed whose `close` lands as its key-space read ends (the window a SCAN's last page opens)."""

    def __init__(self, *args) -> None:
        self.seeded = threading.Event()  # (before the threads start)
        super().__init__(*args)

    def _seed(self, client, pubsub) -> None:
        super()._seed(client, pubsub)
        self.seeded.set()
        threading.Thread(target=self.close, daemon=True).start()
        assert self._stop.wait(5.0)


def test_a_feed_closed_while_it_reads_the_key_space_never_goes_live(private_redis, caplog):
    prefix = f"seed{secrets.token_hex(4)}"
    client = private_redis.client()
    for _ in range(5):
        client.psetex(f"{prefix}:ns:{secrets.token_hex(16)}", 60_000, b"v")
    held = _RecordedHeld()
    with caplog.at_level(logging.INFO, logger="prefixcache.tiers.redis_presence"):
        feed = _ClosedWhileSeeding(RedisOptions(url=private_redis.url, key_prefix=prefix), held, f"{prefix}:*")
        assert feed.seeded.wait(SETTLE_S)
        for thread in feed._threads:
            thread.join(SETTLE_S)
            assert not thread.is_alive()
    assert held.held() == 5  # it did read the key space
    assert held.marked_live == 0 and not feed.live
    assert not [r for r in caplog.records if " live: " in r.getMessage()]
