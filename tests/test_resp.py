"""The RESP data path (prefixcache/tiers/resp.py) against a real redis-server: values of every size
read whole into their own buffers, misses and foreign types, error replies, a connection that
is never reused after a fault, and partial sends resumed mid-piece."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import redis

from prefixcache.tiers import resp
from prefixcache.tiers.redis_options import RedisOptions, connect
from prefixcache.tiers.resp import RespPipeline
from tests.support.redis_server import RedisServer

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
    pipe.set(list(zip(keys, values)), 60_000)
    got = pipe.getex(keys[::-1] + ["t:missing"], 120_000)
    assert [bytes(v) for v in got[:-1]] == values[::-1] and got[-1] is None
    assert all(isinstance(v, memoryview) for v in got[:-1])
    assert 60_000 < client.pttl(keys[0]) <= 120_000  # GETEX PX applied
    assert client.get(keys[-1]) == values[-1]  # what redis-py reads back is what was written
    for _ in range(3):  # the pooled connection stays in step across calls
        assert [bytes(v) for v in pipe.getex(keys[:3], 1000)] == values[:3]


def test_a_foreign_type_is_a_miss_and_an_error_reply_drops_the_connection(client) -> None:
    client.rpush("t:list", b"x")
    client.set("t:ok", b"fine")
    pipe = RespPipeline(client)
    assert [None if v is None else bytes(v) for v in pipe.getex(["t:list", "t:ok"], 1000)] == [None, b"fine"]
    with pytest.raises(redis.exceptions.ResponseError):
        pipe.set([("t:ok", b"v")], 0)  # PX 0 is an invalid expire time
    connections = client.connection_pool._available_connections
    assert [c._sock for c in connections] == [None]  # the faulted connection went back closed, not mid-reply
    assert [bytes(v) for v in pipe.getex(["t:ok"], 1000)] == [b"fine"]


def test_a_stopped_server_raises_connection_errors(redis_server: RedisServer, tmp_path) -> None:
    server = RedisServer(tmp_path / "private").start()
    options = RedisOptions(url=server.url, socket_timeout_s=1, connect_timeout_s=0.5)
    c = connect(options.url, options)
    pipe = RespPipeline(c)
    pipe.set([("k", b"v" * 100_000)], 10_000)
    server.kill()
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        pipe.getex(["k"], 1000)
    c.close()


def test_partial_sends_deliver_every_piece_whole_and_in_order() -> None:
    """A socket with a timeout sends only what its buffer takes per sendmsg: 8 MiB in 1,500 pieces
    through a 4 KiB buffer and a slow reader comes out byte for byte (resumed mid-piece, and over
    the 512-buffer limit of one sendmsg)."""
    rng = np.random.default_rng(5)
    pieces: list[bytes | memoryview] = []
    for i in range(1500):
        size = int(rng.integers(0, 11_000)) if i % 100 else 1 << 20
        piece = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        pieces.append(memoryview(piece) if i % 2 else piece)
    expected = b"".join(bytes(p) for p in pieces)
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sender.settimeout(10)  # as redis-py's sockets: non-blocking underneath, so sendmsg sends in parts
    received = bytearray()

    def read() -> None:
        while len(received) < len(expected):
            chunk = receiver.recv(3000)
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        resp._send(sender, pieces)
        reader.join(20)
    finally:
        sender.close()
        receiver.close()
    assert len(received) == len(expected) and bytes(received) == expected
