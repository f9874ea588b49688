"""A same-host client's end of the service's control socket (prefixcache/control_frames.py).

`CacheClient` sends Lookup, Reserve, Commit and Release here once its Attach announced the
socket (a same-host caller that mapped the host tier), and through gRPC otherwise. Connections
are kept for reuse, one per concurrent caller, each carrying one call at a time.

Failure semantics, as on gRPC:
- The socket cannot be reached, or refuses the connection (the service runs at its connection
  bound): `call` answers None and the caller goes through gRPC. A service that takes the
  connection but does not answer its HELLO within the call's deadline is unresponsive, not
  unreachable: `CacheUnavailable`, so that a deadline is never spent twice.
- A call that fails once sent (the connection broke, the deadline passed) raises
  `CacheUnavailable`: it may have run, so it is never retried here. Its connection is closed.
  One that a kept connection could not send (its service restarted: the socket refuses the
  write, so nothing was delivered) is sent once more on a new connection.
- A failure status raises the same typed error as gRPC's (`errors.error_from_status`).
A connection left unused for `IDLE_S` is closed rather than reused: the service ends idle
connections at a longer timeout, and a reused one must not be one it is closing.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
from google.protobuf.message import Message

from ..control_frames import HELLO, METHODS, OK, FrameError, receive, send
from .errors import CacheUnavailable, error_from_status

IDLE_S = 60.0  # the service closes connections idle for 300 s (control_socket.py)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_METHOD = {name: index for index, name in enumerate(METHODS)}


class ControlSocket:
    def __init__(self, path: str, auth_token: str | None, address: str) -> None:
        self.path = path
        self._token = (auth_token or "").encode()
        self._address = address  # the gRPC address, for errors
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, monotonic time it was put back)
        self._lock = threading.Lock()
        self._closed = False

    def call(
        self, method: str, request: Message, response_type: type[Message], timeout_s: float, lease_id: int | None = None
    ) -> Message | None:
        """The method's response; None when the socket cannot be had (call over gRPC instead)."""
        frame = request.SerializeToString()
        conn, reused = self._take(timeout_s)
        while conn is not None:
            try:
                conn.settimeout(timeout_s)
                send(conn, _METHOD[method], frame)
                break
            except OSError as error:
                conn.close()
                if not reused:
                    raise self._unavailable(method, error) from None
                # A kept connection whose service is gone (restarted: its socket refuses writes
                # with EPIPE, so nothing was delivered): once more on a fresh one.
                conn, reused = self._connect(timeout_s), False
        if conn is None:
            return None
        try:
            code, body = receive(conn)
        except (OSError, FrameError) as error:  # TimeoutError included
            conn.close()
            raise self._unavailable(method, error) from None
        self._put(conn)
        if code == OK:
            return response_type.FromString(body)
        field, _, details = body.decode("utf-8", "replace").partition("\n")
        raise error_from_status(
            _CODES.get(code, grpc.StatusCode.UNKNOWN), details, field or None, self._address, lease_id
        )

    def _unavailable(self, method: str, error: Exception) -> CacheUnavailable:
        what = "DEADLINE_EXCEEDED" if isinstance(error, TimeoutError) else "UNAVAILABLE"
        return CacheUnavailable(f"cache service {self._address}: {what}: control socket {method}: {error}")

    def _take(self, timeout_s: float) -> tuple[socket.socket | None, bool]:
        """(a connection, whether it was kept from an earlier call)."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if now - since < IDLE_S:
                    return conn, True
                conn.close()
            if self._closed:
                return None, False
        return self._connect(timeout_s), False

    def _connect(self, timeout_s: float) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(timeout_s)
            conn.connect(self.path)
            send(conn, HELLO, self._token)
            code, _ = receive(conn, limit=4096)
        except TimeoutError as error:
            conn.close()
            raise self._unavailable("HELLO", error) from None
        except (OSError, FrameError):
            conn.close()
            return None
        if code != OK:  # a token gRPC would refuse too: let gRPC say so
            conn.close()
            return None
        return conn

    def _put(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()
