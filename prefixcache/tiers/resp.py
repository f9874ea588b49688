"""Pipelined GETEX and SET of block frames over RESP2, reading each value straight into its buffer.

Why not redis-py's pipeline for the data path: for a large bulk reply it copies the bytes three
times (socket reads into its chunk buffer, that into hiredis's growing buffer, that into a new
`bytes`), and builds a Python object per command and per reply on the way. Here a pipeline's
commands go out in one `sendall` (a large SET value is sent from the caller's frame, never joined
into a bigger buffer), and each bulk reply is read with `recv_into` straight into a buffer
allocated once at the reply's exact size (numpy, not zero-filled): one copy, kernel to frame.

Connection set-up stays redis-py's (AUTH, SELECT, TLS, client name, timeouts): a call borrows a
connection from the standalone client's pool, uses its socket, and gives it back. Only standalone
clients (`redis.Redis`) take this path; the tier keeps redis-py for Redis Cluster.

Invariants:
- A connection goes back to the pool only after every reply of its pipeline was read whole; on
  any fault or unexpected reply it is disconnected first, so no half-read reply can reach the
  next command.
- Faults surface as redis-py exceptions (ConnectionError, TimeoutError, ResponseError,
  InvalidResponse), so the tier's breaker and fail-open handling see what redis-py would raise.
- The caller checks every frame (`codec.decode_block`); this module never looks inside one.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import redis.exceptions

_CRLF = b"\r\n"
_READ_CHUNK = 1 << 16  # header reads; a bulk value bigger than what is buffered is read in place
_SMALL = 1 << 14  # values up to this size are joined into the command bytes
_MAX_IOV = 512  # buffers per sendmsg (Linux allows 1024)


class RespPipeline:
    """GETEX/SET pipelines over the connections of one standalone redis-py client."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool

    def getex(self, keys: list[str], ttl_ms: int | None) -> list[memoryview | None]:
        """`GETEX key PX ttl_ms` (plain `GET` when `ttl_ms` is None) for each key in one round trip;
        None for a missing key, or for a key holding another type (WRONGTYPE: a foreign value our
        next SET replaces)."""
        if ttl_ms is None:
            command = b"".join(
                b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in (key.encode() for key in keys)
            )
        else:
            px = b"%d" % ttl_ms
            tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px)
            command = b"".join(
                b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s%s" % (len(k), k, tail) for k in (key.encode() for key in keys)
            )
        return self._exchange([command], len(keys), _read_value)

    def set(self, entries: list[tuple[str, bytes | memoryview]], ttl_ms: int | list[int]) -> None:
        """`SET key value PX ttl_ms` for each entry in one round trip; raises on any error reply."""
        ttls = ttl_ms if isinstance(ttl_ms, list) else [ttl_ms] * len(entries)
        pieces: list[bytes | memoryview] = []
        small: list[bytes] = []
        for (key, value), ttl in zip(entries, ttls):
            raw, px = key.encode(), b"%d" % ttl
            small.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(raw), raw, len(value)))
            if len(value) <= _SMALL:
                small.append(bytes(value))
            else:
                pieces += [b"".join(small), value]
                small = []
            small.append(b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px))
        pieces.append(b"".join(small))
        self._exchange(pieces, len(entries), _read_ok)

    def _exchange(self, pieces: list[bytes | memoryview], replies: int, read: Callable[[_Reader], Any]) -> list[Any]:
        connection = self._pool.get_connection()
        healthy = False
        try:
            sock = connection._sock
            if sock is None:
                raise redis.exceptions.ConnectionError("connection is not open")
            try:
                _send(sock, pieces)
                reader = _Reader(sock)
                out = [read(reader) for _ in range(replies)]
            except TimeoutError as exc:  # socket.timeout
                raise redis.exceptions.TimeoutError(
                    f"Timeout reading from {connection.host}:{connection.port}"
                ) from exc
            except OSError as exc:
                raise redis.exceptions.ConnectionError(
                    f"Error {exc.errno} on {connection.host}:{connection.port}: {exc.strerror or exc}"
                ) from exc
            if reader.pending():
                raise redis.exceptions.InvalidResponse("more reply bytes than commands")
            healthy = True
            return out
        finally:
            if not healthy:
                connection.disconnect()
            self._pool.release(connection)


def _send(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """All of `pieces`, in order: gathered into as few `sendmsg` calls as the kernel allows (one
    syscall for a whole pipeline, no joined copy of the values); TLS sockets send piece by piece."""
    if not hasattr(sock, "sendmsg") or type(sock) is not socket.socket:
        for piece in pieces:
            sock.sendall(piece)
        return
    views = [memoryview(piece).cast("B") for piece in pieces]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _MAX_IOV])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


class _Reader:
    """Replies off one socket: lines through a small buffer, bulk values read in place."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    def pending(self) -> bool:
        return self._end > self._start

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            if self._start == 0:
                raise redis.exceptions.InvalidResponse("reply line longer than the read buffer")
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        count = self._sock.recv_into(self._view[self._end :])
        if not count:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        self._end += count

    def line(self) -> bytes:
        while True:
            found = self._buffer.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = bytes(self._view[self._start : found])
                self._start = found + 2
                return line
            self._fill()

    def bulk(self, size: int) -> memoryview:
        """The next `size` bytes and their CRLF, as a view of a buffer of their own."""
        out = np.empty(size, dtype=np.uint8).data.cast("B")
        have = min(size, self._end - self._start)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < size:
            count = self._sock.recv_into(out[have:])
            if not count:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            have += count
        if self.line():
            raise redis.exceptions.InvalidResponse("bulk reply longer than announced")
        return out


def _read_value(reader: _Reader) -> memoryview | None:
    line = reader.line()
    kind = line[:1]
    if kind == b"$":
        try:
            size = int(line[1:])
        except ValueError:
            raise redis.exceptions.InvalidResponse(f"bad bulk length in {line[:32]!r}") from None
        return None if size < 0 else reader.bulk(size)
    if kind == b"-":
        if line.startswith(b"-WRONGTYPE"):
            return None
        raise _error_reply(line)
    raise redis.exceptions.InvalidResponse(f"unexpected reply to GETEX: {line[:32]!r}")


# The classes redis-py raises for these codes (the tier classifies write refusals by them).
_ERROR_CLASSES = {b"OOM": redis.exceptions.OutOfMemoryError, b"READONLY": redis.exceptions.ReadOnlyError}


def _error_reply(line: bytes) -> redis.exceptions.ResponseError:
    code = line[1:].split(b" ", 1)[0]
    return _ERROR_CLASSES.get(code, redis.exceptions.ResponseError)(line[1:].decode("utf-8", "replace"))


def _read_ok(reader: _Reader) -> None:
    line = reader.line()
    if line == b"+OK":
        return
    if line[:1] == b"-":
        raise _error_reply(line)
    raise redis.exceptions.InvalidResponse(f"unexpected reply to SET: {line[:32]!r}")
