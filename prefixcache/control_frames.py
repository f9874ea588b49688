"""Frames of the service's same-host control socket: its per-request calls without gRPC.

A same-host engine's per-request calls (Lookup, Reserve, Commit, Release) carry token ids and
slot numbers, never KV bytes (those move through the mapped host tier), and gRPC Python's
per-call machinery costs the service and the engine more CPU than the calls' own work
(docs/benchmarks.md, "The same-host control socket"). So the service also listens on a Unix
socket beside its shared-memory segment (`/dev/shm/SEGMENT.sock`: wherever an engine can map
the segment, a container sharing that /dev/shm included, it can reach the socket), and
announces it in `AttachResponse.control_socket` to callers that may map that segment. A
connection carries one call at a time, each a request frame answered by a response frame:

    request:  u32 body length | u8 method (an index into METHODS) | body: the request message
    response: u32 body length | u8 status | body: the response message (status 0, OK), or
              "field\\ndetails" in UTF-8 (any other status: a gRPC status code's value)

A connection's first frame is HELLO, whose body is the bearer token (empty with auth off); the
service answers it OK, or UNAUTHENTICATED and closes. Every call is then handled, authenticated
and answered exactly as on gRPC (the same handlers, errors and limits). Bodies are protobuf, so
the messages, fields and checks are cache.proto's. Little-endian, as every host that maps the
same segment is the same host.
"""

from __future__ import annotations

import socket
import struct

from .tiers.shm import SHM_DIR, control_socket_path

METHODS = ("Lookup", "Reserve", "Commit", "Release")  # index = the method byte
HELLO = 255
OK = 0
HEADER = struct.Struct("<IB")
MAX_BODY_BYTES = 16 << 20  # as gRPC's receive limit (a 1M-token Lookup is ~5 MiB of varints)


class FrameError(ConnectionError):
    """The peer closed the connection or sent a frame this end cannot take; the connection is done."""


def socket_path(segment: str) -> str:
    """The control socket beside the host tier's shared-memory segment `segment`."""
    return str(control_socket_path(SHM_DIR / segment))


def send(sock: socket.socket, code: int, body: bytes) -> None:
    sock.sendall(HEADER.pack(len(body), code) + body)


def receive(sock: socket.socket, limit: int = MAX_BODY_BYTES) -> tuple[int, bytes]:
    """(method or status, body) of the next frame; FrameError at a clean end or a body over `limit`."""
    size, code = HEADER.unpack(_exactly(sock, HEADER.size))
    if size > limit:
        raise FrameError(f"a frame of {size} bytes exceeds the limit of {limit}")
    return code, _exactly(sock, size)


def _exactly(sock: socket.socket, size: int) -> bytes:
    if size == 0:
        return b""
    data = sock.recv(size)  # usually the whole frame: no buffer to assemble
    if len(data) == size:
        return data
    buffer = bytearray(data)
    while len(buffer) < size:
        if not data:
            raise FrameError("the peer closed the connection")
        data = sock.recv(size - len(buffer))
        buffer += data
    return bytes(buffer)
