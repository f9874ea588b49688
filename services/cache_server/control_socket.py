"""The same-host control socket: Lookup, Reserve, Commit and Release without gRPC's machinery.

Frames are prefixcache/control_frames.py's. Each call runs the very handler gRPC would run
(`servicer.unary_handlers`: the request parser that turns junk into INVALID_ARGUMENT, the
status wrapper that maps typed errors, times the call and counts it in flight for the drain),
with `LocalCall` standing in for gRPC's context: the connection's bearer token as metadata, an
abort that answers the status, callbacks run when the call ends (tenant shares).

The socket is a file beside the segment (control_frames.socket_path), mode 0600 like the
segment: only processes of the service's Unix user (or root) can connect, the segment's
boundary (SECURITY.md); the service also checks each peer's user (SO_PEERCRED), which covers
the moment between bind and chmod. The service claims the segment first, so no live service
owns that name: a socket file left there by a killed predecessor is removed and bound anew; any
other file there (a regular file, another user's) is left alone and the service runs without
the socket. It unlinks its socket when it stops. One thread per connection, one call at a time
on each. Connections are bounded by
`max_connections` (beyond it a new one is closed at once, and the client uses gRPC), which also
bounds the calls held, as --max-concurrent-rpcs does on gRPC. A peer that sends nothing for
`idle_timeout_s` is disconnected (clients reconnect on their next call).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from prefixcache import control_frames
from prefixcache.control_frames import FrameError
from prefixcache.tiers.shm import remove_dead_socket

from .auth import Authenticator, Unauthenticated
from .servicer import UnaryHandler
from .status import FIELD_METADATA

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.5  # how soon the accept loop sees `close`
PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Aborted(Exception):
    """A handler's `context.abort`: the status the call answers."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalCall:
    """What the handlers ask of a gRPC ServicerContext, for one call on the control socket."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._callbacks: list[Callable[[], object]] = []
        self.field = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self._callbacks.append(callback)
        return True

    def set_trailing_metadata(self, metadata) -> None:
        self.field = next((str(value) for key, value in metadata if key == FIELD_METADATA), self.field)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def end(self) -> None:
        for callback in self._callbacks:
            callback()


def _same_user(conn: socket.socket) -> bool:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
    except OSError:  # the peer is already gone
        return False
    _pid, uid, _gid = PEER_CREDENTIALS.unpack(raw)
    return uid in (os.geteuid(), 0)


class ControlSocketServer:
    def __init__(
        self,
        path: str,
        handlers: dict[str, UnaryHandler],
        authenticator: Authenticator,
        max_connections: int,
        idle_timeout_s: float = 300.0,
        on_denied: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self._handlers = [handlers[method] for method in control_frames.METHODS]
        self._auth = authenticator
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._on_denied = on_denied
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        remove_dead_socket(Path(path))  # a killed predecessor's (the caller owns the segment)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            os.chmod(path, 0o600)
            self._inode = os.stat(path).st_ino  # what `close` unlinks: this socket, never a successor's
            self._listener.listen(64)
            self._listener.settimeout(ACCEPT_POLL_S)
        except OSError:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._accept, name="prefixcache-control", daemon=True)

    def start(self) -> ControlSocketServer:
        self._thread.start()
        return self

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= self._max_connections
                if self._closed.is_set() or full or not _same_user(conn):
                    why = "closing" if self._closed.is_set() else "at the bound" if full else "another user"
                    log.debug("control socket: connection refused (%s)", why)
                    conn.close()  # the client calls over gRPC instead
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="prefixcache-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._idle_timeout_s)
            metadata = self._hello(conn)
            if metadata is not None:
                while True:
                    method, body = control_frames.receive(conn)
                    self._call(conn, method, body, metadata)
        except (OSError, FrameError):
            pass  # the peer went away, idled out, or broke the framing: drop the connection
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> tuple[tuple[str, str], ...] | None:
        method, body = control_frames.receive(conn, limit=4096)
        if method != control_frames.HELLO:
            raise FrameError("the first frame must be HELLO")
        token = body.decode("utf-8", "replace")
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if self._auth.enabled:
            try:
                self._auth.authenticate(metadata)
            except Unauthenticated as error:
                if self._on_denied is not None:
                    self._on_denied("control-socket")
                control_frames.send(conn, grpc.StatusCode.UNAUTHENTICATED.value[0], f"\n{error}".encode())
                return None
        control_frames.send(conn, control_frames.OK, b"")
        return metadata

    def _call(self, conn: socket.socket, method: int, body: bytes, metadata: tuple[tuple[str, str], ...]) -> None:
        if method >= len(self._handlers):
            raise FrameError(f"no method {method}")
        handler, parse, serialize = self._handlers[method]
        call = LocalCall(metadata)
        try:
            reply = serialize(handler(parse(body), call))
        except Aborted as error:
            control_frames.send(conn, error.code.value[0], f"{call.field}\n{error.details}".encode())
            return
        finally:
            call.end()
        control_frames.send(conn, control_frames.OK, reply)

    def close(self) -> None:
        """Stop accepting and end every connection (a call in flight answers into a closed socket)."""
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept now
        except OSError:
            pass
        self._listener.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive():
            self._thread.join()
