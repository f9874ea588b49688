"""A hostile or broken Redis never denies service (issue 33).

Each test reproduces a finding against a real service, tier or socket: a fake Redis written here
(`HostileRedis`, on loopback) for what a real redis-server cannot do on demand (announce a
terabyte, drip one byte every 25 ms), and a real redis-server for oversized values planted under
the key prefix. What must hold: nothing Redis announces is allocated beyond the frame size the
namespace implies; no exchange outlives its whole deadline, however steadily bytes come; each
such fault is counted and seen by the breaker; local hits are served throughout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixcache.codec import frame_size
from prefixcache.config import CacheConfig
from prefixcache.tiers.redis import RedisOptions, RedisTier
from prefixcache_services.cache_server.auth import Authenticator
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from tests.support.poll import poll
from tests.support.redis_server import RedisServer
from tests.support.service import BLOCK, layout_of, prompt, random_kv, same_bytes

pytestmark = [pytest.mark.process, pytest.mark.redis]

TERABYTE = 1 << 40
DRIP_S = 0.025  # under the 50 ms per-read timeout: each read returns in time, the reply never ends


class HostileRedis:
    """Speaks enough RESP to pass for Redis (CLIENT SETNAME, PING, PSETEX, UNLINK, PEXPIRE answered
    as Redis would), and answers every GET/GETEX as `mode` says: "huge" announces a terabyte, "drip"
    sends a reply one byte every DRIP_S; `mode` "drip-writes" drips the PSETEX replies instead."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}"
        self.commands: list[bytes] = []
        self._conns: list[socket.socket] = []
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stopping.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                name = command[0].upper()
                self.commands.append(name)
                if name in (b"GET", b"GETEX"):
                    self._answer_read(conn)
                elif name == b"SUBSCRIBE" and self.mode == "drip":  # a confirmation that never ends
                    _drip(conn, b"*3\r\n$3000\r\n" + b"x" * 3000 + b"\r\n", self._stopping)
                elif name == b"PSETEX" and self.mode == "drip-writes":
                    _drip(conn, b"+" + b"O" * 1000 + b"\r\n", self._stopping)  # 25 s for one reply
                elif name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif name in (b"UNLINK", b"PEXPIRE"):
                    conn.sendall(b":1\r\n")
                else:
                    conn.sendall(b"+OK\r\n")
        except OSError:
            return
        finally:
            conn.close()

    def _answer_read(self, conn: socket.socket) -> None:
        if self.mode == "huge":
            conn.sendall(b"$%d\r\n" % TERABYTE)
        elif self.mode == "drip":
            _drip(conn, b"$3000\r\n" + b"x" * 3000 + b"\r\n", self._stopping)  # within a frame; 75 s
        else:
            conn.sendall(b"$-1\r\n")

    def count(self, name: bytes) -> int:
        return sum(1 for command in self.commands if command == name)

    def close(self) -> None:
        self._stopping.set()
        for sock in (self.listener, *self._conns):  # wakes accept() and readline()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for thread in self._threads:
            thread.join(5)


def _read_command(reader) -> list[bytes] | None:
    line = reader.readline()
    if not line.startswith(b"*"):
        return None
    parts = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts


def _drip(conn: socket.socket, reply: bytes, stopping: threading.Event) -> None:
    """One byte every DRIP_S until the client hangs up (or the test ends)."""
    for i in range(len(reply)):
        if stopping.is_set():
            return
        conn.sendall(reply[i : i + 1])
        time.sleep(DRIP_S)


@pytest.fixture
def hostile():
    servers: list[HostileRedis] = []

    def make(mode: str) -> HostileRedis:
        servers.append(HostileRedis(mode))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def serve_over(url: str, **redis_options):
    """An in-process service (real gRPC) whose Redis tier is at `url`: 16 host slots."""
    layout = layout_of()
    options = RedisOptions(url=url, breaker_backoff_min_s=5, breaker_backoff_max_s=5, **redis_options)
    backend = BackendOptions(
        cache=CacheConfig(host_capacity=16 * layout.block_bytes),
        block_size=BLOCK,
        remote_factory=lambda _layout: RedisTier(options),
    )
    return build_server(ServerOptions(backend=backend, listen="127.0.0.1:0", authenticator=Authenticator.open()))


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_a_reply_announcing_a_terabyte_is_refused_and_local_hits_are_served(hostile) -> None:
    """Finding 1: a GETEX answered `$1099511627776` made every Lookup that reached Redis answer
    INTERNAL (MemoryError), local hits included, and the breaker never tripped. Now each is a
    fault for the breaker, refused from the length line; this peer answers the deletes that
    follow (a working link for the breaker), so the tier stays up and each Lookup pays the
    round trip alone. Without them, three in a row take it down (the next test's writes)."""
    redis_peer = hostile("huge")
    server = serve_over(redis_peer.url)
    from prefixcache.client import CacheClient

    client = CacheClient(server.address, timeout_s=10)
    try:
        layout = layout_of()
        client.attach("model", layout)
        tokens, kv = prompt(8), random_kv(4, layout, seed=1)
        client.store(tokens[: 4 * BLOCK], kv)  # the first 4 blocks are local; 4..7 are asked of Redis
        rss = rss_bytes()
        seconds = []
        for _ in range(5):
            start = time.monotonic()
            hit = client.lookup(tokens)
            seconds.append(time.monotonic() - start)
            assert hit.hit_tokens == 4 * BLOCK and same_bytes(client.read(hit), kv)
            client.release(hit)
        remote = client.stats().snapshot.remote
        # each Lookup that reached Redis was one refused reply; on a loaded machine three may
        # come before the deletes' successes and trip the breaker (the rest then skip Redis)
        refused = remote["oversized_replies"]
        assert refused + remote["reads_skipped"] / 4 == 5 and refused >= 3, remote
        assert remote["integrity_failures"] == refused and remote["read_errors"] == refused
        assert remote["hits"] == 0 and remote["bytes_read"] == 0
        assert poll(lambda: redis_peer.count(b"UNLINK") >= 1, 5)  # refused keys are deleted
        assert max(seconds) < 1.0, seconds
        assert rss_bytes() - rss < 64 << 20  # nothing sized from the announced length
    finally:
        client.close()
        server.shutdown(0)


def test_a_dripping_redis_cannot_hold_lookups_past_the_read_deadline(hostile) -> None:
    """Finding 3: a Redis sending one byte every 25 ms held each Lookup that reached it (one still
    waiting at 45 s), and stats showed nothing. Now each read round trip ends at read_deadline_s
    (4 x the 50 ms timeout), counted, and the breaker sees it; 16 Lookups at once all answer."""
    redis_peer = hostile("drip")
    server = serve_over(redis_peer.url)
    from prefixcache.client import CacheClient

    client = CacheClient(server.address, timeout_s=10)
    try:
        layout = layout_of()
        client.attach("model", layout)
        tokens, kv = prompt(8), random_kv(4, layout, seed=2)
        client.store(tokens[: 4 * BLOCK], kv)

        def lookup(_: int) -> tuple[int, float]:
            start = time.monotonic()
            hit = client.lookup(tokens, take_lease=False)
            return hit.hit_tokens, time.monotonic() - start

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lookup, range(16)))
        assert all(hit == 4 * BLOCK for hit, _ in answers)
        held = max(seconds for _, seconds in answers)
        assert held < 2.0, answers  # 0.2 s a round trip, a few queued behind the tier's handler threads
        remote = client.stats().snapshot.remote
        assert remote["read_deadlines"] >= 3 and remote["read_errors"] >= 3
        assert remote["reads_up"] == 0  # the breaker saw them
    finally:
        client.close()
        server.shutdown(0)


def test_a_dripping_redis_cannot_hold_the_presence_feed_past_shutdown(hostile) -> None:
    """The presence feed's subscription is read through redis-py, whose waits have only per-read
    timeouts: a confirmation dripped a byte at a time would hold its thread for 75 s. Shutdown
    cuts its connections, so the feed stops with the service and never writes the table after."""
    redis_peer = hostile("drip")
    server = serve_over(redis_peer.url)
    from prefixcache.client import CacheClient

    client = CacheClient(server.address, timeout_s=10)
    try:
        client.attach("model", layout_of())  # builds the cache: its feed subscribes
        assert poll(lambda: redis_peer.count(b"SUBSCRIBE") >= 1, 5)
        time.sleep(0.5)  # inside the dripped reply
        assert client.held_tokens(prompt(2)) is None  # never live: engines look everything up
    finally:
        client.close()
        start = time.monotonic()
        server.shutdown(0)
    feeds = lambda: [t.name for t in threading.enumerate() if t.name.startswith("prefixcache-presence")]  # noqa: E731
    assert poll(lambda: not feeds(), 3), feeds()
    assert time.monotonic() - start < 5


def test_a_redis_whose_writes_drip_fails_each_batch_at_the_write_deadline(hostile) -> None:
    """Finding 7 (a stalled write showed only as growing queue_bytes): a PSETEX reply dripped
    byte by byte ends at write_deadline_s, counted, and the link breaker goes down."""
    redis_peer = hostile("drip-writes")
    tier = RedisTier(
        RedisOptions(url=redis_peer.url, write_timeout_s=0.1, breaker_backoff_min_s=5, breaker_backoff_max_s=5)
    )
    try:
        start = time.monotonic()
        for i in range(3):
            assert tier.submit("ns", bytes([i]) * 16, b"frame")
            assert poll(lambda i=i: tier.stats().write_deadlines > i, 5), tier.stats()
        assert time.monotonic() - start < 3.0  # 3 batches of 0.4 s at most, not the drip's 25 s each

        def failed_and_down() -> bool:  # a batch's deadline is counted before its failure is
            stats = tier.stats()
            return stats.writes_failed >= 3 and not stats.writes_up and not stats.up

        assert poll(failed_and_down, 5), tier.stats()
    finally:
        tier.close(0.5)


def test_oversized_values_under_the_prefix_are_never_read(redis_server: RedisServer) -> None:
    """Finding 2: 32 MiB values under the key prefix (frames of 16.5 KiB) were read whole, 256 MiB
    for two Lookups. Now the reply's length line is compared with the frame size first: nothing of
    the value is allocated or read, the key is deleted, and the fault is counted."""
    layout = layout_of()
    most = frame_size(layout, "ns", 16, 16, keyed=False)
    tier = RedisTier(
        RedisOptions(
            url=redis_server.url,
            key_prefix="hostile",
            socket_timeout_s=2,
            breaker_backoff_min_s=5,
            breaker_backoff_max_s=5,
        )
    )
    hashes = [bytes([i]) * 16 for i in range(4)]
    try:
        with redis_server.client() as admin:
            for block_hash in hashes:
                admin.set(tier.key("ns", block_hash), b"\0" * (32 << 20))
            tracemalloc.start()
            try:
                got = tier.fetch("ns", hashes, frame_bytes=layout.block_bytes, max_frame_bytes=most)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert got == [None] * 4
            assert peak < 1 << 20, peak  # was 32 MiB per value
            stats = tier.stats()
            assert (stats.oversized_replies, stats.integrity_failures, stats.read_errors) == (1, 1, 1)
            assert stats.bytes_read == 0 and stats.hits == 0
            assert tier.wait_idle(5)
            assert admin.exists(tier.key("ns", hashes[0])) == 0  # the refused key is gone
            # a value of the right size is still a hit
            admin.set(tier.key("ns", hashes[0]), b"\1" * most)
            assert [None if f is None else len(f) for f in tier.fetch("ns", hashes[:1], max_frame_bytes=most)] == [most]
    finally:
        tier.close()
