"""The RESP data path (prefixcache/tiers/resp.py and the core's prefixcache/_resp.c) against a real
redis-server: values of every size read whole into their own buffers, misses and foreign types
(RESP2 and RESP3), error replies read in step, a connection never reused after a fault, partial
sends resumed mid-buffer, the same over TLS; and, from a peer that answers what Redis never does, each protocol
fault named."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import redis

from prefixcache.native import core
from prefixcache.tiers.redis_options import RedisOptions, connect
from prefixcache.tiers.resp import RefreshRefused, RespPipeline
from tests.support.redis_server import RedisServer, make_tls_files

pytestmark = pytest.mark.redis


@pytest.fixture
def client(redis_server: RedisServer):
    options = RedisOptions(url=redis_server.url, socket_timeout_s=5)
    c = connect(options.url, options)
    c.flushdb()
    yield c
    c.close()


def test_set_then_getex_returns_every_value_whole_and_slides_the_ttl(client) -> None:
    rng = np.random.default_rng(3)
    # around the read buffer (64 KiB) and the join threshold (16 KiB), plus empty and 2 MiB values
    sizes = [0, 1, 100, (1 << 14), (1 << 14) + 1, (1 << 16) - 3, 1 << 16, (1 << 16) + 7, 2 << 20]
    values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    keys = [f"t:{i}" for i in range(len(values))]
    pipe = RespPipeline(client)
    pipe.set(keys, values, 60_000)
    got = pipe.getex(keys[::-1] + ["t:missing"], 120_000)
    assert [bytes(v) for v in got[:-1]] == values[::-1] and got[-1] is None
    assert all(isinstance(v, memoryview) for v in got[:-1])
    assert 60_000 < client.pttl(keys[0]) <= 120_000  # PEXPIRE ... GT lengthened it
    assert [bytes(v) for v in pipe.getex(keys[:1], 1000)] == values[:1]
    assert client.pttl(keys[0]) > 60_000  # ... and a shorter refresh leaves it
    assert [bytes(v) for v in pipe.getex(keys[:1], 1000, reset=True)] == values[:1]
    assert 0 < client.pttl(keys[0]) <= 1000  # GETEX PX sets it, shorter too
    assert not client.exists("t:missing")  # PEXPIRE never creates a key
    assert client.get(keys[-1]) == values[-1]  # what redis-py reads back is what was written
    for _ in range(3):  # the pooled connection stays in step across calls
        assert [bytes(v) for v in pipe.getex(keys[:3], 1000)] == values[:3]


def test_a_foreign_type_is_a_miss_and_an_error_reply_raises_on_a_connection_kept_in_step(client) -> None:
    client.rpush("t:list", b"x")
    client.set("t:ok", b"fine")
    pipe = RespPipeline(client)
    assert [None if v is None else bytes(v) for v in pipe.getex(["t:list", "t:ok"], 1000)] == [None, b"fine"]
    sock = client.connection_pool._available_connections[0]._sock
    with pytest.raises(redis.exceptions.ResponseError, match="invalid expire time"):
        pipe.set(["t:a", "t:ok", "t:b"], [b"1", b"v", b"2"], [1000, 0, 1000])  # PX 0 is refused
    assert client.mget("t:a", "t:ok", "t:b") == [b"1", b"fine", b"2"]  # the others were written
    # every reply was read: the same socket went back and serves the next pipeline in step
    assert [c._sock for c in client.connection_pool._available_connections] == [sock]
    assert [bytes(v) for v in pipe.getex(["t:ok", "t:a"], 1000)] == [b"fine", b"1"]
    with pytest.raises(redis.exceptions.ResponseError, match="invalid expire time"):
        pipe.getex(["t:ok"], -5, reset=True)  # an error reply other than WRONGTYPE raises
    assert [bytes(v) for v in pipe.getex(["t:ok"], 1000)] == [b"fine"]  # in step after it


def test_a_refused_refresh_raises_refresh_refused_after_reading_every_reply(redis_server: RedisServer) -> None:
    """The reads were answered; the TTL refresh was refused (here an ACL without PEXPIRE): a
    `RefreshRefused` naming Redis's error, on a connection left in step."""
    with redis_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "t-nopexpire", "on", ">pw", "~*", "+@all", "-pexpire")
        admin.set("t:r", b"v")
    c = redis.Redis.from_url(redis_server.url, username="t-nopexpire", password="pw")
    try:
        pipe = RespPipeline(c)
        with pytest.raises(RefreshRefused, match="NOPERM"):
            pipe.getex(["t:r", "t:none"], 1000)
        assert [None if v is None else bytes(v) for v in pipe.getex(["t:r", "t:none"], 1000, reset=True)] == [
            b"v",
            None,
        ]
    finally:
        c.close()
        with redis_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", "t-nopexpire")


def test_a_resp3_connection_reads_its_nulls_as_misses(redis_server: RedisServer) -> None:
    c = redis.Redis.from_url(redis_server.url, protocol=3)
    try:
        c.set("t3:k", b"v")
        assert [None if v is None else bytes(v) for v in RespPipeline(c).getex(["t3:k", "t3:none"], 1000)] == [
            b"v",
            None,
        ]
    finally:
        c.close()


def test_a_tls_connection_takes_the_same_path_through_its_socket_methods(tmp_path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    server = RedisServer(tmp_path / "tls-redis", tls=tls).start()
    options = RedisOptions(url=server.url, socket_timeout_s=5, tls_ca_file=str(tls.ca))
    c = connect(options.url, options)
    try:
        rng = np.random.default_rng(4)
        values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 100, (1 << 14) + 1, 70_000, 2 << 20)]
        keys = [f"tls:{i}" for i in range(len(values))]
        pipe = RespPipeline(c)
        pipe.set(keys, values, 60_000)
        c.rpush("tls:list", b"x")
        got = pipe.getex([*keys, "tls:list", "tls:none"], 60_000)
        assert [None if v is None else bytes(v) for v in got] == [*values, None, None]
        assert c.get(keys[-1]) == values[-1]
        with pytest.raises(redis.exceptions.ResponseError, match="invalid expire time"):
            pipe.set(["tls:a", "tls:b"], [b"1", b"2"], [1000, 0])
        assert [bytes(v) for v in pipe.getex(["tls:a"], 1000)] == [b"1"]  # in step after the error
        sock = c.connection_pool._available_connections[0]._sock
        assert type(sock) is not socket.socket  # an ssl.SSLSocket: driven through its methods
        with pytest.raises(ValueError, match="timeout_s: a socket object waits by its own timeout"):
            core.resp_getex(sock, [b"tls:a"], None, 1.0)
    finally:
        c.close()
        server.kill()


def test_a_stopped_server_raises_connection_errors(redis_server: RedisServer, tmp_path) -> None:
    server = RedisServer(tmp_path / "private").start()
    options = RedisOptions(url=server.url, socket_timeout_s=1, connect_timeout_s=0.5)
    c = connect(options.url, options)
    pipe = RespPipeline(c)
    pipe.set(["k"], [b"v" * 100_000], 10_000)
    server.kill()
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        pipe.getex(["k"], 1000)
    c.close()


def test_a_paused_server_times_out_and_the_connection_is_dropped(redis_server: RedisServer) -> None:
    options = RedisOptions(url=redis_server.url, socket_timeout_s=0.3)
    c = connect(options.url, options)
    pipe = RespPipeline(c)
    try:
        pipe.set(["t:p"], [b"x"], 10_000)  # connected before the pause
        with redis_server.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")
            with pytest.raises(redis.exceptions.TimeoutError):
                pipe.getex(["t:p"], 1000)
            assert [conn._sock for conn in c.connection_pool._available_connections] == [None]
            admin.execute_command("CLIENT", "UNPAUSE")
        assert [bytes(v) for v in pipe.getex(["t:p"], 1000)] == [b"x"]  # a fresh connection, in step
    finally:
        c.close()


def test_partial_sends_deliver_every_value_whole_and_in_order(client) -> None:
    """A socket that takes 4 KiB per sendmsg: 1,500 values (joined ones, 1 MiB ones sent from
    their buffers, over the 512-buffer limit of one sendmsg; every third one in parts, as a frame's
    header, payload view and MAC) resumed mid-buffer, and Redis stores each byte for byte."""
    rng = np.random.default_rng(5)
    values: list[bytes | memoryview | tuple[bytes | memoryview, ...]] = []
    whole: list[bytes] = []
    for i in range(1500):
        size = int(rng.integers(0, 40_000)) if i % 100 else 1 << 20
        value = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        whole.append(value)
        if i % 3 == 0:  # small and large parts, and an empty one
            cut = min(size, 100)
            values.append(
                (
                    value[:cut],
                    memoryview(value)[cut : size - 32 if size > 132 else size],
                    b"",
                    value[max(cut, size - 32) if size > 132 else size :],
                )
            )
        else:
            values.append(memoryview(value) if i % 2 else value)
    client.ping()
    sock = client.connection_pool._available_connections[0]._sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    keys = [f"t:part:{i}" for i in range(len(values))]
    RespPipeline(client).set(keys, values, 60_000)
    for start in range(0, len(keys), 100):
        assert client.mget(keys[start : start + 100]) == whole[start : start + 100]


class _Peer:
    """A server that answers what a test says: what the core does with a reply Redis never sends."""

    def __init__(self, reply: bytes, close: bool = False) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.settimeout(2)
        self.received = bytearray()
        self._thread = threading.Thread(target=self._serve, args=(reply, close))
        self._thread.start()

    def _serve(self, reply: bytes, close: bool) -> None:
        self.received += self.theirs.recv(1 << 16)
        self.theirs.sendall(reply)
        if close:
            self.theirs.close()

    def finish(self) -> None:
        self._thread.join(5)
        self.ours.close()
        self.theirs.close()


@pytest.mark.parametrize(
    ("reply", "close", "error", "match"),
    [
        (b":1\r\n", False, ValueError, "neither a bulk string nor an error"),
        (b"$3\r\nabc\r\n$1\r\nx\r\n", False, ValueError, "more reply bytes than commands"),
        (b"$5\r\nabcdefg\r\n", False, ValueError, "longer than its announced length"),
        (b"$x1\r\n", False, ValueError, "bad bulk length"),
        (b"$10\r\nabc", True, ConnectionError, "closed by server"),
        (b"", False, TimeoutError, "timed out"),
    ],
)
def test_replies_redis_never_sends_raise_and_name_the_fault(reply, close, error, match) -> None:
    peer = _Peer(reply, close)
    try:
        with pytest.raises(error, match=match):
            core.resp_getex(peer.ours.fileno(), [b"k"], 1000, 0.3, None, None, True)
    finally:
        peer.finish()
    assert bytes(peer.received) == b"*4\r\n$5\r\nGETEX\r\n$1\r\nk\r\n$2\r\nPX\r\n$4\r\n1000\r\n"


@pytest.mark.parametrize(
    ("reply", "values", "errors", "match"),
    [
        (b"$1\r\nv\r\n:1\r\n", [b"v"], [], None),
        (b"$-1\r\n:0\r\n", [None], [], None),
        (b"$1\r\nv\r\n-NOPERM no pexpire\r\n", [b"v"], [(1, b"NOPERM no pexpire")], None),
        (b"$1\r\nv\r\n+OK\r\n", None, None, "a PEXPIRE answered neither an integer nor an error"),
        (b"$1\r\nv\r\n:1\r\n:1\r\n", None, None, "more reply bytes than commands"),
    ],
)
def test_a_read_with_its_refresh_sends_get_and_pexpire_gt_and_reads_both_replies(reply, values, errors, match) -> None:
    """Each key: `GET key` + `PEXPIRE key ttl GT`; PEXPIRE's error comes back at the key's
    position + the number of keys, and anything but an integer or an error is a fault."""
    peer = _Peer(reply)
    try:
        if match is None:
            got, refused = core.resp_getex(peer.ours.fileno(), [b"k"], 1000, 0.3)
            assert [None if v is None else bytes(v) for v in got] == values and refused == errors
        else:
            with pytest.raises(ValueError, match=match):
                core.resp_getex(peer.ours.fileno(), [b"k"], 1000, 0.3)
    finally:
        peer.finish()
    assert bytes(peer.received) == (
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*4\r\n$7\r\nPEXPIRE\r\n$1\r\nk\r\n$4\r\n1000\r\n$2\r\nGT\r\n"
    )


def test_a_set_reply_other_than_ok_or_an_error_is_a_fault() -> None:
    peer = _Peer(b"$2\r\nOK\r\n")
    try:
        with pytest.raises(ValueError, match="neither \\+OK nor an error"):
            core.resp_set(peer.ours.fileno(), [b"k"], [b"v"], [5], 1.0)
    finally:
        peer.finish()
    assert bytes(peer.received) == b"*4\r\n$6\r\nPSETEX\r\n$1\r\nk\r\n$1\r\n5\r\n$1\r\nv\r\n"


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(TypeError, match=r"keys\[1\]: expected bytes"):
        core.resp_set(0, [b"a", "b"], [b"1", b"2"], [1, 1], None)
    with pytest.raises(ValueError, match="values, ttls_ms: expected 2 of each"):
        core.resp_set(0, [b"a", b"b"], [b"1"], [1, 1], None)
    with pytest.raises(TypeError, match=r"values\[0\]: expected a contiguous buffer or a tuple of them"):
        core.resp_set(0, [b"a"], [object()], [1], None)
    with pytest.raises(TypeError, match=r"values\[1\]\[1\]: expected a contiguous buffer"):
        core.resp_set(0, [b"a", b"b"], [b"1", (b"head", "not a buffer")], [1, 1], None)
    with pytest.raises(TypeError, match=r"ttls_ms\[0\]: expected an int"):
        core.resp_set(0, [b"a"], [b"1"], ["x"], None)
    with pytest.raises(ValueError, match="sock: expected an open socket's descriptor"):
        core.resp_getex(-1, [b"a"], None, None)
    with pytest.raises(ValueError, match="timeout_s: expected None or seconds"):
        core.resp_getex(0, [b"a"], None, -1.0)
    with pytest.raises(TypeError, match=r"keys\[0\]: expected bytes"):
        core.resp_getex(0, ["a"], None, None)


def test_a_value_longer_than_max_value_is_refused_from_its_length_line() -> None:
    """Issue 33: a reply announcing a terabyte was allocated (MemoryError). With max_value the
    length line alone is the fault, naming the reply's position; nothing is allocated."""
    peer = _Peer(b"$-1\r\n:0\r\n$1099511627776\r\n")  # a miss (and its PEXPIRE), then the terabyte
    try:
        with pytest.raises(ValueError, match="longer than the largest value expected") as caught:
            core.resp_getex(peer.ours.fileno(), [b"a", b"k"], 1000, 0.3, 4096, None)
        assert caught.value.args[1] == 1  # the second key's reply
    finally:
        peer.finish()
    peer = _Peer(b"$4\r\nabcd\r\n")  # up to max_value is read as before
    try:
        assert [bytes(v) for v in core.resp_getex(peer.ours.fileno(), [b"k"], None, 0.3, 4)[0]] == [b"abcd"]
    finally:
        peer.finish()


@pytest.mark.parametrize("call", ["getex", "set"])
def test_the_deadline_bounds_a_whole_exchange_with_a_peer_dripping_bytes(call) -> None:
    """Issue 33: one byte every 25 ms (under the 50 ms per-wait timeout) held an exchange for as
    long as the reply lasted. With deadline_s the exchange ends at it."""
    ours, theirs = socket.socketpair()
    ours.settimeout(0.05)
    reply = b"$3000\r\n" + b"x" * 3000 + b"\r\n" if call == "getex" else b"+" + b"O" * 3000 + b"\r\n"

    def drip() -> None:
        theirs.recv(1 << 16)
        for i in range(len(reply)):
            try:
                theirs.send(reply[i : i + 1])
            except OSError:
                return
            time.sleep(0.025)

    thread = threading.Thread(target=drip)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="deadline"):
            if call == "getex":
                core.resp_getex(ours.fileno(), [b"k"], 1000, 0.05, None, 0.2)
            else:
                core.resp_set(ours.fileno(), [b"k"], [b"v"], [1000], 0.05, 0.2)
        assert 0.19 < time.monotonic() - start < 0.35
    finally:
        ours.close()
        thread.join(5)
        theirs.close()


def test_bad_limits_name_the_argument() -> None:
    with pytest.raises(ValueError, match="deadline_s: expected None or seconds > 0"):
        core.resp_getex(0, [b"a"], None, None, None, 0.0)
    with pytest.raises(ValueError, match="max_value: expected None or bytes >= 0"):
        core.resp_getex(0, [b"a"], None, None, -1)
    with pytest.raises(ValueError, match="deadline_s: expected None or seconds > 0"):
        core.resp_set(0, [b"a"], [b"1"], [1], None, -2.0)
