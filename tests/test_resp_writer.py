"""The Redis tier's write queue (`RespWriter`, prefixcache/_resp.c) against a real redis-server:
lanes that each stream SETs on their own connection without the GIL, an operation Python runs
ordered after every SET queued before it and before every SET queued after it, a failed or stalled
exchange left in its lane's flight, the socket handed back as its owner set it, queued values copied
out of the caller's buffers, and every argument checked by name."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from prefixcache.errors import ConfigError
from prefixcache.native import core
from prefixcache.tiers.redis import RedisTier
from prefixcache.tiers.redis_options import RedisOptions
from tests.support.redis_server import RedisServer, make_tls_files

pytestmark = pytest.mark.redis

MiB = 1 << 20


def poll(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def connect(server: RedisServer, timeout_s: float | None = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(timeout_s)  # as redis-py leaves its sockets: non-blocking underneath
    return sock


class Lanes:
    """`writer.run` on `lanes` threads, each with its own connection; what each run ended with."""

    def __init__(self, writer: core.RespWriter, server: RedisServer, lanes: range, max_batch: int = 64) -> None:
        self.socks = {lane: connect(server) for lane in lanes}
        self.ended: dict[int, object] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(writer, lane, max_batch), daemon=True) for lane in lanes
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, writer: core.RespWriter, lane: int, max_batch: int) -> None:
        try:
            self.ended[lane] = writer.run(self.socks[lane].fileno(), 5.0, max_batch, lane)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            self.ended[lane] = exc

    def join(self, timeout_s: float = 10.0) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a lane did not return"
        for sock in self.socks.values():
            sock.close()


def settle(writer: core.RespWriter, count: int, timeout_s: float = 10.0) -> list[tuple[list, int, float, int]]:
    """Every done batch until `count` ops came back."""
    batches: list[tuple[list, int, float, int]] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(ops) for ops, *_ in batches) < count and time.monotonic() < deadline:
        writer.wait_done(0.1)
        batches += writer.completed()
    return batches


def test_lanes_write_every_set_once_with_its_ttl_and_report_each_batch(redis_server: RedisServer) -> None:
    rng = np.random.default_rng(1)
    sizes = [0, 1, 100, 1 << 14, (1 << 14) + 1, 64 << 10, (64 << 10) + 3, 2 * MiB] * 12
    values = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    writer = core.RespWriter(4)
    lanes = Lanes(writer, redis_server, range(4))
    for i, value in enumerate(values):  # a frame as parts: a small header and the payload in place
        writer.push(i, f"w:{i}".encode(), (b"hdr%d" % i, memoryview(value)), 60_000)
    batches = settle(writer, len(values))
    writer.stop(0)
    lanes.join()
    assert sorted(op for ops, *_ in batches for op in ops) == list(range(len(values)))  # each once
    assert sum(nbytes for _, nbytes, *_ in batches) == sum(len(b"hdr%d" % i) + n for i, n in enumerate(sizes))
    assert all(seconds > 0 for _, _, seconds, _ in batches)
    assert len(batches) > 1 and all(ops for ops, *_ in batches)
    # a batch holds at most 1 MiB of values beyond its first, so a 2 MiB value travels alone
    assert all(nbytes <= 3 * MiB for _, nbytes, *_ in batches)
    assert set(lanes.ended.values()) == {None}  # stopped, not failed
    client = redis_server.client()
    for i, value in enumerate(values):
        assert client.get(f"w:{i}") == b"hdr%d" % i + value.tobytes()
    assert 50_000 < client.pttl("w:0") <= 60_000
    assert len(writer) == 0 and writer.flight(-1) == []


@pytest.mark.parametrize("round_", range(5))
def test_an_op_python_runs_waits_for_the_sets_before_it_and_holds_the_lanes_until_finished(
    private_redis: RedisServer, round_: int
) -> None:
    writer = core.RespWriter(4)
    lanes = Lanes(writer, private_redis, range(1, 4))  # lane 0 is this test
    payload = np.full(MiB, round_, dtype=np.uint8)  # 1 MiB each: a batch of its own on each lane
    private_redis.pause(400)
    for i in range(3):
        writer.push(("set", i), f"o:{i}".encode(), memoryview(payload), 60_000)
    assert poll(lambda: len(writer.flight(-1)) == 3, 2)  # one on each of lanes 1-3, stalled
    writer.push(("python", 0), None, None, 0)
    writer.push(("set", 3), b"o:3", memoryview(payload), 60_000)
    assert writer.head() == 2
    started = time.monotonic()
    assert writer.pop(64) == [("python", 0)]  # only once every SET before it is over
    assert time.monotonic() - started > 0.1
    client = private_redis.client()
    assert client.exists("o:0", "o:1", "o:2") == 3
    time.sleep(0.05)
    assert writer.flight(-1) == [("python", 0)] and len(writer) == 1  # no lane takes o:3 meanwhile
    assert client.exists("o:3") == 0
    assert writer.finish(0) == [("python", 0)]
    batches = settle(writer, 4)
    assert sorted(op for ops, *_ in batches for op in ops) == [("set", i) for i in range(4)]
    assert client.exists("o:3") == 1
    writer.stop(0)
    lanes.join()


@pytest.mark.parametrize("round_", range(4))
def test_no_set_is_left_queued_with_every_lane_asleep(redis_server: RedisServer, round_: int) -> None:
    """A wake-up lost between a push and a lane going to sleep would strand a SET until the next
    push. Pushes of random sizes at random gaps, then none: every one must be written."""
    rng = np.random.default_rng(round_)
    sizes = rng.choice([0, 100, 64 << 10, 300 << 10, 1 << 20, (3 << 20) // 2], size=200)
    payload = np.zeros(max(sizes), dtype=np.uint8)
    writer = core.RespWriter(4)
    lanes = Lanes(writer, redis_server, range(4), max_batch=int(rng.integers(1, 17)))
    for i, size in enumerate(sizes):
        writer.push(i, f"x{round_}:{i}".encode(), memoryview(payload[:size]), 60_000)
        gap = rng.random()
        if gap < 0.3:
            time.sleep(gap / 1000)  # up to 0.3 ms: pushes land while lanes send, wake and sleep
    batches = settle(writer, len(sizes), timeout_s=20.0)
    assert sorted(op for ops, *_ in batches for op in ops) == list(range(len(sizes)))
    assert len(writer) == 0
    writer.stop(0)
    lanes.join()


def _name(sock: socket.socket, name: str) -> None:
    """CLIENT SETNAME on a lane's connection, so that CLIENT LIST tells the lanes apart."""
    sock.sendall(b"*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$%d\r\n%s\r\n" % (len(name), name.encode()))
    reply = b""
    while not reply.endswith(b"\r\n"):
        reply += sock.recv(16)
    assert reply == b"+OK\r\n"


@pytest.mark.parametrize("deadline_s", [None, 5.0])
def test_a_commits_few_sets_go_on_one_lane_the_others_sleep(private_redis: RedisServer, deadline_s) -> None:
    """A push wakes one lane, and only when no lane is about to look at the queue: eight 64 KiB
    SETs pushed while the lane woken by the first one is still sending it are all sent by that
    lane. Waking every lane on every push cost the service half its CPU per commit
    (docs/benchmarks.md). The first SET's reply is held back (CLIENT PAUSE) so that the pushes
    land while it is in flight however the pushing thread is scheduled: on a loaded machine a
    lane could otherwise drain the queue and sleep between two pushes, and the next push then
    rightly wakes whichever lane the condition variable picks."""
    writer = core.RespWriter(4)
    socks = {lane: connect(private_redis) for lane in range(4)}
    tag = f"one{deadline_s}-{os.getpid()}"
    extra = () if deadline_s is None else (deadline_s,)
    threads = [
        threading.Thread(target=writer.run, args=(sock.fileno(), 5.0, 64, lane, *extra), daemon=True)
        for lane, sock in socks.items()
    ]
    for thread in threads:
        thread.start()
    payload = np.zeros(64 << 10, dtype=np.uint8)
    if deadline_s is not None:  # a lane's first SET, alone, measures the link's pace
        writer.push(-1, f"{tag}:first".encode(), memoryview(payload), 60_000)
        assert [ops for ops, *_ in settle(writer, 1)] == [[-1]]
    time.sleep(0.5)  # every lane asleep on the queue (not reading its socket)
    for lane, sock in socks.items():
        _name(sock, f"{tag}-{lane}")
    # SET 0 then measures 0.1-0.2 s (Redis ends a pause on its 100 ms tick): half of 5 s still
    # fits the other seven in one batch.
    private_redis.pause(100)
    writer.push(0, f"{tag}:0".encode(), memoryview(payload), 60_000)
    time.sleep(0.02)  # its lane is waiting for the reply
    for i in range(1, 8):
        writer.push(i, f"{tag}:{i}".encode(), memoryview(payload), 60_000)
    batches = settle(writer, 8)
    assert sorted(op for ops, *_ in batches for op in ops) == list(range(8))
    clients = [c for c in private_redis.client().client_list() if c["name"].startswith(tag)]
    assert len(clients) == 4
    assert sorted(c["cmd"] for c in clients) == ["client|setname"] * 3 + ["psetex"]
    writer.stop(0)
    for thread in threads:
        thread.join(10)
    for sock in socks.values():
        sock.close()


@pytest.mark.parametrize("tls", [False, True], ids=["streamed", "tls-pipelined"])
def test_over_a_link_of_100ms_round_trips_a_burst_is_written_whole_at_its_pace(
    redis_server: RedisServer, tmp_path: Path, tls: bool
) -> None:
    """Sent one at a time, 64 SETs of 16 KiB over a link of 100 ms round trips take ~9 s, past a
    batch's 2 s deadline: the batch used to fail whole, every time, writing nothing and tripping
    the link's breaker (reads included). A lane now measures the link's pace on its first SET
    and takes no more SETs than half the deadline fits; the lanes share the burst. Over TLS,
    Python pipelines each batch (pop): 64 x 16 KiB at 400 kB/s took 2.6 s, and the same burst
    failed whole (120 of 120 SETs) until its batches were paced too."""
    from tests.slow_proxy import SlowProxy

    server, ca = redis_server, None
    if tls:
        files = make_tls_files(tmp_path / "tls")
        server, ca = RedisServer(tmp_path / "tls-redis", tls=files).start(), str(files.ca)
    frame = os.urandom(16 << 10)
    try:
        with SlowProxy(server.port, latency_s=0.05, bytes_per_s=400e3) as proxy:
            url = proxy.url.replace("redis://", "rediss://") if tls else proxy.url
            options = RedisOptions(url=url, key_prefix=f"pace{os.getpid()}", socket_timeout_s=1.0, tls_ca_file=ca)
            assert options.write_deadline_s == 2.0
            with RedisTier(options) as tier:
                hashes = [i.to_bytes(8, "big") for i in range(120)]
                for block_hash in hashes:
                    assert tier.submit("ns", block_hash, frame)
                assert tier.wait_idle(30)
                stats = tier.stats()
        assert stats.bytes_written == len(hashes) * len(frame)
        assert stats.writes_failed == 0 and stats.write_deadlines == 0
        assert stats.breaker_trips == 0 and stats.reads_up and stats.writes_up
        # a round trip and 16 KiB at 400 kB/s each; pipelined, the bytes alone
        assert (0.03 if tls else 0.1) <= stats.write_set_s < 1.0
        assert server.client().exists(*[tier.key("ns", h) for h in hashes]) == len(hashes)
    finally:
        if tls:
            server.kill()


def test_a_batch_python_runs_is_sized_by_the_deadline_at_the_measured_pace() -> None:
    writer = core.RespWriter(1)
    for i in range(10):
        writer.push(i, f"p:{i}".encode(), b"v", 1000)
    assert writer.pop(64, 2.0) == [0]  # no pace yet: one SET measures it
    writer.finish(0)
    writer.paced(0.5, 1, False)  # 0.5 s per SET: half of 2 s fits 2
    assert writer.set_seconds == 0.5 and writer.pop(64, 2.0) == [1, 2]
    writer.finish(0)
    writer.paced(0.1, 2, False)  # faster: a quarter of the way, to 0.3875 s per SET
    assert writer.set_seconds == pytest.approx(0.3875) and writer.pop(64, 2.0) == [3, 4]
    writer.finish(0)
    writer.paced(0.2, 2, True)  # past its deadline at 0.1 s per SET: faster, so not followed
    assert writer.set_seconds == pytest.approx(0.3875)
    writer.paced(2.0, 2, True)  # past its deadline at 1 s per SET: followed at once
    assert writer.pop(64, 2.0) == [5]
    writer.finish(0)
    assert writer.pop(3) == [6, 7, 8]  # no deadline: max_batch alone
    writer.finish(0)
    with pytest.raises(ValueError, match="deadline_s"):
        writer.pop(64, 0.0)
    with pytest.raises(ValueError, match="paced"):
        writer.paced(1.0, 0, False)


def test_lane_zero_returns_at_an_op_python_runs_and_the_others_wait(redis_server: RedisServer) -> None:
    writer = core.RespWriter(2)
    writer.push("first", b"z:1", b"v", 1000)
    writer.push("python", None, None, 0)
    writer.push("last", b"z:2", b"v", 1000)
    lanes = Lanes(writer, redis_server, range(2))
    assert poll(lambda: 0 in lanes.ended, 5) and lanes.ended[0] is None  # returned for Python
    assert writer.pop(64) == ["python"]
    assert 1 not in lanes.ended and writer.head() == 1  # lane 1 waits: "last" stays queued
    assert writer.finish(0) == ["python"]
    batches = settle(writer, 2)
    assert [op for ops, *_ in batches for op in ops] == ["first", "last"]
    writer.stop(0)
    lanes.join()


def _nonblocking(sock: socket.socket) -> bool:
    return bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)


def _receive_timeout(sock: socket.socket) -> tuple[int, int]:
    return struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))


def test_a_stalled_server_times_out_within_the_timeout_and_the_socket_is_handed_back_as_it_was(
    private_redis: RedisServer,
) -> None:
    writer = core.RespWriter(1)
    sock = connect(private_redis)
    assert _nonblocking(sock) and _receive_timeout(sock) == (0, 0)
    writer.push("stalled", b"p:1", b"x" * 1000, 1000)
    private_redis.pause(1500)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        writer.run(sock.fileno(), 0.2, 64, 0)
    assert 0.15 < time.monotonic() - started < 1.0
    assert _nonblocking(sock) and _receive_timeout(sock) == (0, 0)  # Python's socket works as before
    assert writer.flight(0) == ["stalled"] and writer.finish(0) == ["stalled"]
    sock.close()


def test_a_connection_closed_mid_batch_raises_and_leaves_the_batch_in_flight(private_redis: RedisServer) -> None:
    writer = core.RespWriter(1)
    sock = connect(private_redis)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    writer.push("big", b"c:1", np.zeros(8 * MiB, dtype=np.uint8), 1000)
    private_redis.pause(300)
    threading.Timer(0.1, lambda: sock.shutdown(socket.SHUT_RDWR)).start()
    with pytest.raises(OSError):  # ConnectionError (EPIPE, reset) or a closed socket's errno
        writer.run(sock.fileno(), 5.0, 64, 0)
    assert writer.flight(0) == ["big"]
    with pytest.raises(RuntimeError, match="lane 0 has a batch in flight"):
        writer.pop(64)
    with pytest.raises(RuntimeError, match="has a batch in flight"):
        writer.run(sock.fileno(), 5.0, 64, 0)
    assert writer.finish(0) == ["big"] and writer.flight(0) == []
    sock.close()


def test_own_queued_copies_borrowed_values_and_the_copies_are_what_is_sent(redis_server: RedisServer) -> None:
    slot = bytearray(b"a" * 70_000)
    writer = core.RespWriter(1)
    writer.push("parts", b"own:1", (b"head", memoryview(slot)), 60_000)
    writer.push("whole", b"own:2", bytes(slot), 60_000)  # a bytes object is the writer's already
    writer.push("python", None, None, 0)
    owned = writer.own_queued()
    assert [(op, value) for op, value in owned] == [("parts", b"head" + bytes(slot))]
    slot[:] = b"b" * len(slot)  # the caller reuses its buffer
    assert writer.head() == 1 and len(writer) == 3  # still queued, in order
    lanes = Lanes(writer, redis_server, range(1))
    assert poll(lambda: 0 in lanes.ended, 5)  # returned at the Python op
    assert redis_server.client().get("own:1") == b"head" + b"a" * 70_000
    assert writer.pop(64) == ["python"] and writer.finish(0) == ["python"]


def test_stop_returns_once_idle_or_past_its_deadline_and_drain_hands_back_the_rest(
    private_redis: RedisServer,
) -> None:
    writer = core.RespWriter(1)
    sock = connect(private_redis)
    writer.stop(5.0)
    assert writer.run(sock.fileno(), 5.0, 64, 0) is None  # nothing queued: returns at once
    writer = core.RespWriter(1)
    for i in range(3):
        writer.push(i, f"s:{i}".encode(), b"v" * MiB, 60_000)  # three batches of one
    private_redis.pause(300)
    writer.stop(0.05)
    assert writer.run(sock.fileno(), 5.0, 64, 0) is None  # the batch at the deadline finishes
    assert writer.drain() == [1, 2] and len(writer) == 0
    assert settle(writer, 1)[0][0] == [0]
    writer.shutdown()
    assert not writer.wait_done(1.0)  # shut down, nothing left to hand over
    sock.close()


def test_interrupt_returns_every_running_lane(redis_server: RedisServer) -> None:
    writer = core.RespWriter(3)
    lanes = Lanes(writer, redis_server, range(3))
    time.sleep(0.05)
    writer.interrupt()
    lanes.join(5)
    assert lanes.ended == {0: None, 1: None, 2: None}


def test_a_lane_sends_each_write_as_psetex_once_the_last_ones_reply_is_read() -> None:
    """One write in flight per connection, its value last: what lets Redis keep the bytes it read
    as the stored value instead of copying them out (set_build in prefixcache/_resp.c)."""
    writer = core.RespWriter(1)
    ours, server = socket.socketpair()  # the server's side answers as Redis would, when the test says
    server.settimeout(5)
    for i in range(3):
        writer.push(i, b"k%d" % i, (b"h", b"v" * 100), 1000)
    lane = threading.Thread(target=writer.run, args=(ours.fileno(), 5.0, 64, 0), daemon=True)
    lane.start()
    for i in range(3):
        expected = b"*4\r\n$6\r\nPSETEX\r\n$2\r\nk%d\r\n$4\r\n1000\r\n$101\r\nh%s\r\n" % (i, b"v" * 100)
        received = b""
        while len(received) < len(expected):
            received += server.recv(1 << 16)
        assert received == expected  # whole, and nothing of the next write
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.recv(1)  # nor until this one is answered
        server.settimeout(5)
        server.sendall(b"+OK\r\n")
    # one batch of three, taken at one wake-up, that took three round trips (the link meter's unit)
    assert [(sorted(ops), trips) for ops, _, _, trips in settle(writer, 3)] == [([0, 1, 2], 3)]
    writer.stop(0)
    lane.join(5)
    assert not lane.is_alive()
    ours.close()
    server.close()


def test_an_error_reply_comes_back_as_text_with_the_batch_left_in_flight(redis_server: RedisServer) -> None:
    writer = core.RespWriter(1)
    sock = connect(redis_server)
    writer.push("bad", b"e:1", b"v", 0)  # PX 0: Redis refuses it
    writer.push("good", b"e:2", b"v", 1000)
    refused = writer.run(sock.fileno(), 5.0, 64, 0)
    assert refused is not None and b"invalid expire time" in refused
    assert writer.finish(0) == ["bad", "good"]
    assert redis_server.client().get("e:2") == b"v"  # the rest of the batch was written, in step
    sock.close()


def test_every_argument_is_checked_by_name() -> None:
    for lanes in (0, 17):
        with pytest.raises(ValueError, match="lanes"):
            core.RespWriter(lanes)
    writer = core.RespWriter(2)
    with pytest.raises(TypeError, match="key"):
        writer.push("op", "text key", b"v", 1)
    with pytest.raises(TypeError, match="value"):
        writer.push("op", b"k", 42, 1)
    with pytest.raises(TypeError, match="ttl_ms"):
        writer.push("op", b"k", b"v", "soon")
    assert len(writer) == 0  # nothing half-queued
    with pytest.raises(ValueError, match="lane"):
        writer.run(0, 1.0, 64, 2)
    with pytest.raises(ValueError, match="max_batch"):
        writer.run(0, 1.0, 0, 0)
    with pytest.raises(ValueError, match="lane"):
        writer.finish(5)
    with pytest.raises(ValueError, match="max_batch"):
        writer.pop(0)


def test_write_lanes_is_checked_by_name(redis_server: RedisServer) -> None:
    for lanes in (0, 17, True):
        with pytest.raises(ConfigError, match="write_lanes"):
            RedisOptions(url=redis_server.url, write_lanes=lanes)
    with pytest.raises(ConfigError, match="write_lanes.*max_connections"):
        RedisOptions(url=redis_server.url, write_lanes=8, max_connections=4)


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_delete_queued_after_writes_runs_after_them_on_every_lane(redis_server: RedisServer, lanes: int) -> None:
    """The tier's order guarantee under lanes: 40 rounds of 24 writes (1 KiB to 1 MiB) and a delete
    of one of them queued last; the deleted key must never survive, the others must all be there."""
    options = RedisOptions(url=redis_server.url, key_prefix=f"order{lanes}", write_lanes=lanes, write_timeout_s=5)
    rng = np.random.default_rng(lanes)
    client = redis_server.client()
    with RedisTier(options) as tier:
        for round_ in range(40):
            hashes = [bytes([round_, i]) * 8 for i in range(24)]
            sizes = rng.integers(1 << 10, MiB, len(hashes))
            for block_hash, size in zip(hashes, sizes, strict=True):
                assert tier.submit("ns", block_hash, bytes(int(size)))
            victim = hashes[int(rng.integers(0, len(hashes)))]
            tier.delete("ns", victim)
            assert tier.wait_idle(10)
            assert client.exists(tier.key("ns", victim)) == 0, f"round {round_}: the delete ran before its write"
            assert client.exists(*[tier.key("ns", h) for h in hashes if h != victim]) == len(hashes) - 1
        stats = tier.stats()
        assert stats.writes_failed == 0 and stats.spills_dropped == 0 and stats.queue_bytes == 0
