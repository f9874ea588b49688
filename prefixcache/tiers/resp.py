"""Pipelined reads (GET with a TTL refresh) and PSETEX (SET with PX) of block frames over RESP, run by the compiled core (prefixcache/_resp.c).

Why not redis-py's pipeline for the data path: for a large bulk reply it copies the bytes three
times (socket reads into its chunk buffer, that into hiredis's growing buffer, that into a new
`bytes`) and builds a Python object per command and per reply, all while holding the GIL, which
the tier's one writer thread then has to win back from callers encoding frames after every
syscall. Here a pipeline is one call into the core (`_core.resp_set` / `resp_getex`): the
commands built and sent in as few `sendmsg` calls as the kernel takes (a large SET value straight
from the caller's frame), every reply read and parsed, each bulk reply read into a buffer of its
exact size (one copy, kernel to frame), with the GIL released throughout on a plain TCP or Unix
socket. A TLS socket is driven through its own `sendall`/`recv_into` (with the GIL: ssl needs it).

Connection set-up stays redis-py's (AUTH, SELECT, TLS, client name, timeouts): a call borrows a
connection from the standalone client's pool, uses its socket, and gives it back. Only standalone
clients (`redis.Redis`) take this path; the tier keeps redis-py for Redis Cluster.

Invariants:
- A connection goes back to the pool in use only after every reply of its pipeline was read
  whole; after a socket fault or an unexpected reply it is disconnected first, so no half-read
  reply can reach the next command.
- Faults surface as redis-py exceptions (ConnectionError, TimeoutError, ResponseError and its
  OOM/READONLY subclasses, InvalidResponse), so the tier's breaker and fail-open handling see
  what redis-py would raise; two are told apart: `ExchangeDeadline` (a TimeoutError: the whole
  exchange ran past `deadline_s`, however steadily bytes came) and `OversizedReply` (an
  InvalidResponse: a value longer than `max_value` announced, refused from its length line
  before a byte of it was allocated; it names the key's position).
- The caller checks every frame (`codec.decode_block`); this module never looks inside one.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import redis
import redis.exceptions

from ..native import core
from .base import Frame

_T = TypeVar("_T")


class ExchangeDeadline(redis.exceptions.TimeoutError):
    """The whole exchange ran past its deadline (bytes may have kept coming, too slowly)."""


class RefreshRefused(redis.exceptions.ResponseError):
    """Redis answered a key's TTL refresh (`PEXPIRE ... GT`) with an error; the reads were fine."""


class OversizedReply(redis.exceptions.InvalidResponse):
    """A reply announced a value longer than the caller can use; `position` is its key's index."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


class RespPipeline:
    """Read and SET pipelines over the connections of one standalone redis-py client. `deadline_s`
    (None: none) bounds each whole exchange, beyond the socket's timeout for each wait."""

    def __init__(self, client: redis.Redis, deadline_s: float | None = None) -> None:
        self._pool = client.connection_pool
        self._deadline_s = deadline_s

    def getex(
        self, keys: list[str], ttl_ms: int | None, max_value: int | None = None, reset: bool = False
    ) -> list[memoryview | None]:
        """Each key read, and its TTL refreshed to at least `ttl_ms`, in one round trip: `GET` +
        `PEXPIRE key ttl_ms GT` (`reset`: `GETEX key PX ttl_ms`, which also shortens a longer
        one; plain `GET` when `ttl_ms` is None). None for a missing key, or for a key holding
        another type (WRONGTYPE: a foreign value our next SET replaces). A value announced longer
        than `max_value` raises OversizedReply; a refused refresh RefreshRefused."""
        raw = [key.encode() for key in keys]
        deadline = self._deadline_s
        values, errors = self._exchange(
            lambda fd, timeout: core.resp_getex(fd, raw, ttl_ms, timeout, max_value, deadline, reset)
        )
        for position, text in errors:
            if position >= len(raw):
                raise RefreshRefused(text.decode("utf-8", "replace"))
            if not text.startswith(b"WRONGTYPE"):
                raise _error_reply(text)
        return [None if value is None else memoryview(value) for value in values]

    def set(self, keys: Sequence[str], values: Sequence[Frame], ttl_ms: int | list[int]) -> None:
        """`PSETEX keys[i] ttl_ms values[i]` (one TTL for all, or one per key) in one round trip, a
        value sent from its own buffers (one, or a tuple of parts that join into it);
        raises on any error reply (after reading every reply: the connection stays in use)."""
        raw = [key.encode() for key in keys]
        ttls = ttl_ms if isinstance(ttl_ms, list) else [ttl_ms] * len(keys)
        deadline = self._deadline_s
        error = self._exchange(lambda fd, timeout: core.resp_set(fd, raw, values, ttls, timeout, deadline))
        if error is not None:
            raise _error_reply(error)

    def stream(self, writer: core.RespWriter, max_batch: int, lane: int) -> bool:
        """Run `writer` (the tier's write queue) as `lane` on one of this client's connections until
        it returns (`RespWriter.run`: an interrupt, a stop, or on lane 0 an operation Python runs);
        False at once on a TLS connection, whose socket methods need the GIL. Raises ResponseError
        for an error reply and redis-py's exceptions for faults, the batch left in the lane's flight.
        The deadline bounds each batch's exchange."""
        deadline = self._deadline_s
        refused = self._exchange(
            lambda fd, timeout: writer.run(fd, timeout, max_batch, lane, deadline), plain_only=True
        )
        if refused is _NOT_PLAIN:
            return False
        if refused is not None:
            raise _error_reply(cast(bytes, refused))
        return True

    def _exchange(self, call: Callable[[int | ssl.SSLSocket, float | None], _T], plain_only: bool = False) -> _T:
        connection = self._pool.get_connection()
        healthy = False
        try:
            sock = connection._sock
            if sock is None:
                raise redis.exceptions.ConnectionError("connection is not open")
            plain = type(sock) is socket.socket
            if plain_only and not plain:
                healthy = True
                return cast(_T, _NOT_PLAIN)
            try:
                # a plain socket by its descriptor, under its timeout; a TLS one as itself (its own timeout)
                out = call(sock.fileno(), sock.gettimeout()) if plain else call(sock, None)
            except TimeoutError as exc:  # socket.timeout, or the core's deadline
                if exc.args and str(exc.args[0]).startswith("deadline"):
                    raise ExchangeDeadline(f"Exchange with {_address(connection)} ran past its deadline") from exc
                raise redis.exceptions.TimeoutError(f"Timeout reading from {_address(connection)}") from exc
            except OSError as exc:
                raise redis.exceptions.ConnectionError(
                    f"Error {exc.errno} on {_address(connection)}: {exc.strerror or exc}"
                ) from exc
            except ValueError as exc:  # args (text, position of the reply at fault or -1)
                text = str(exc.args[0]) if exc.args else str(exc)
                if len(exc.args) == 2 and isinstance(exc.args[1], int) and exc.args[1] >= 0:
                    raise OversizedReply(text, exc.args[1]) from exc
                raise redis.exceptions.InvalidResponse(text) from exc
            healthy = True
            return out
        finally:
            if not healthy:
                connection.disconnect()
            self._pool.release(connection)


_NOT_PLAIN = object()  # stream(): the connection is TLS


def _address(connection: object) -> str:
    """host:port of a TCP connection, the path of a Unix one (for messages)."""
    path = getattr(connection, "path", None)
    return str(path) if path else f"{getattr(connection, 'host', '?')}:{getattr(connection, 'port', '?')}"


# The classes redis-py raises for these codes (the tier classifies write refusals by them).
_ERROR_CLASSES = {b"OOM": redis.exceptions.OutOfMemoryError, b"READONLY": redis.exceptions.ReadOnlyError}


def _error_reply(text: bytes) -> redis.exceptions.ResponseError:
    """The exception redis-py raises for an error reply `text` (what follows its '-')."""
    code = text.split(b" ", 1)[0]
    return _ERROR_CLASSES.get(code, redis.exceptions.ResponseError)(text.decode("utf-8", "replace"))
