"""The same-host control socket: a same-host client's Lookup, Reserve, Commit and Release go
there instead of gRPC, with the same answers, errors and limits; junk and stalled peers cost
only their own connection; a service without it, or a caller that may not use it, keeps gRPC.

Real services (in this process) and real sockets; the gRPC path is the reference."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading
import time

import pytest

from prefixcache import control_frames
from prefixcache.client import CacheClient, CacheUnavailable, Unauthenticated
from prefixcache.client.control_socket import ControlSocket
from prefixcache.config import CacheConfig
from prefixcache.errors import InvalidArgument, UnknownLease
from prefixcache.rpc import cache_pb2 as pb
from prefixcache_services.cache_server.auth import Authenticator, parse_credentials
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from tests.support.poll import poll
from tests.support.service import layout_of, prompt, random_kv, running_servers, same_bytes

pytestmark = pytest.mark.process


@pytest.fixture
def start():
    with running_servers() as make:
        yield make


def _rpcs(server, method: str) -> float:
    return server.metrics.registry.get_sample_value("prefixcache_rpcs_total", {"method": method, "code": "OK"}) or 0


def _stored(client, blocks: int) -> list[int]:
    """Attach `client` and store a prompt of `blocks` blocks; returns its tokens."""
    client.attach("model", layout_of())
    tokens = prompt(blocks)
    client.store(tokens, random_kv(blocks, layout_of(), seed=blocks))
    return tokens


def _raw(server) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(server.control.path)
    return conn


def test_a_same_host_client_calls_over_the_socket_with_the_answers_of_grpc(start):
    server = start(metrics_port=0)
    layout = layout_of("bfloat16")
    local, remote = start.client(server), start.client(server, control_socket=False)
    assert local.attach("model", layout).shared_memory and remote.attach("model", layout).shared_memory
    assert local._control is not None and remote._control is None
    tokens, kv = prompt(6), random_kv(6, layout, seed=3)
    assert local.store(tokens[: 4 * 16], kv[:4]).stored == 4  # Reserve + Commit over the socket
    assert server.control.connections == 1  # kept for the next call
    assert local.store(tokens, kv[4:], start_block=4).stored == 2  # the spare reservation: Commit only
    hits = [client.lookup(tokens) for client in (local, remote)]
    assert [(h.hit_tokens, h.blocks, h.mapped_blocks) for h in hits] == [(6 * 16, 6, 6)] * 2
    assert same_bytes(local.read(hits[0]), kv) and same_bytes(remote.read(hits[1]), kv)
    assert all(client.release(hit) for client, hit in zip((local, remote), hits, strict=True))
    assert not local.release(hits[0])  # released already: False, as over gRPC
    assert not remote.release(hits[1])
    # One handler, one count: the socket's calls are counted with gRPC's, per method.
    assert (_rpcs(server, "Lookup"), _rpcs(server, "Commit"), _rpcs(server, "Release")) == (2, 2, 2)
    assert server.control.connections == 1  # the calls above shared one connection


def test_errors_over_the_socket_are_grpcs_typed_errors_naming_the_field(start):
    server = start()
    client = start.client(server)
    client.attach("model", layout_of())
    with pytest.raises(InvalidArgument) as error:
        client.lookup([1, -5, 3] * 20)
    assert error.value.field == "tokens"
    with pytest.raises(InvalidArgument) as error:
        client._unary("Commit", pb.CommitRequest(namespace_id=client.attachment.namespace_id, tokens=[1]))
    assert error.value.field == "reservation_id"
    with pytest.raises(UnknownLease):
        client._unary("Release", pb.ReleaseRequest(lease_id=987654), lease_id=987654)
    # Bytes that are no request message: INVALID_ARGUMENT naming `request`, connection still usable.
    conn = _raw(server)
    control_frames.send(conn, control_frames.HELLO, b"")
    assert control_frames.receive(conn) == (0, b"")
    control_frames.send(conn, control_frames.METHODS.index("Lookup"), b"\xff\xff\xff")
    code, body = control_frames.receive(conn)
    assert code == 3 and body.startswith(b"request\n")  # INVALID_ARGUMENT
    control_frames.send(
        conn, control_frames.METHODS.index("Release"), pb.ReleaseRequest(lease_id=5).SerializeToString()
    )
    assert control_frames.receive(conn)[0] == 5  # NOT_FOUND: the same connection answers on
    conn.close()


def test_junk_and_stalled_peers_lose_only_their_own_connection(start):
    server = start()
    client = start.client(server)
    tokens = _stored(client, 3)
    stalled = _raw(server)
    stalled.sendall(control_frames.HEADER.pack(10, control_frames.HELLO)[:3])  # half a header, then nothing
    peers = []
    for frame in (
        control_frames.HEADER.pack(0, 7),  # no HELLO first
        control_frames.HEADER.pack(0, control_frames.HELLO) + control_frames.HEADER.pack(0, 42),  # no method 42
        control_frames.HEADER.pack(1 << 30, control_frames.HELLO),  # a body over the limit
    ):
        peer = _raw(server)
        peer.sendall(frame)
        peers.append(peer)
    for peer in peers:  # each is closed by the service (after a HELLO's answer, where it sent one)
        data = b""
        while chunk := peer.recv(64):
            data += chunk
        assert data in (b"", control_frames.HEADER.pack(0, 0))
        peer.close()
    for _ in range(20):  # the stalled peer holds its own thread only
        hit = client.lookup(tokens)
        assert hit.blocks == 3 and client.release(hit)
    assert server.control.connections == 2  # the client's and the stalled one
    stalled.close()
    poll(lambda: server.control.connections == 1, timeout_s=5)


def test_concurrent_callers_each_get_their_own_answer(start):
    """One connection per concurrent caller, one call at a time on each: no answer crosses over."""
    server = start(host_capacity="16MiB")
    layout = layout_of()
    client = start.client(server)
    client.attach("model", layout)
    prompts = [prompt(1 + i % 5, start=10_000 * (i + 1)) for i in range(8)]
    for i, tokens in enumerate(prompts):
        client.store(tokens, random_kv(1 + i % 5, layout, seed=i))
    failures: list[str] = []

    def caller(i: int) -> None:
        for round_ in range(60):
            tokens = prompts[(i + round_) % len(prompts)]
            hit = client.lookup(tokens)
            if hit.prompt_tokens != len(tokens) or hit.blocks != len(tokens) // 16:
                failures.append(f"caller {i}: {hit.prompt_tokens} tokens, {hit.blocks} blocks for {len(tokens)}")
            if not client.release(hit):
                failures.append(f"caller {i}: lease {hit.lease_id} not released")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert 1 <= server.control.connections <= 6
    assert server.backend.cache.leases.lease_count() == 0  # every lease went back


def test_beyond_the_connection_bound_a_client_calls_over_grpc(start):
    server = start(max_concurrent_rpcs=1, metrics_port=0)
    held = _raw(server)  # takes the one connection
    control_frames.send(held, control_frames.HELLO, b"")
    assert control_frames.receive(held)[0] == 0
    client = start.client(server)
    tokens = _stored(client, 2)
    hit = client.lookup(tokens)
    assert hit.blocks == 2 and client.release(hit)
    assert server.control.connections == 1  # the held one: the client's were closed at once
    held.close()
    poll(lambda: server.control.connections == 0, timeout_s=5)
    hit = client.lookup(tokens)  # the next call gets the socket again
    assert hit.blocks == 2 and server.control.connections == 1 and client.release(hit)


def test_tokens_and_credentials_hold_as_on_grpc(start):
    credentials = parse_credentials("tok-a-0123456789 tenant-a local\ntok-b-0123456789 tenant-b\n")
    server = start(authenticator=Authenticator(credentials))
    local = start.client(server, auth_token="tok-a-0123456789")
    assert local.attach("model", layout_of()).shared_memory and local._control is not None
    tokens = prompt(2)
    local.store(tokens, random_kv(2, layout_of(), seed=6))
    assert local.lookup(tokens).blocks == 2 and server.control.connections == 1
    # A credential not marked local maps no segment and is told no socket.
    other = start.client(server, auth_token="tok-b-0123456789")
    assert not other.attach("model", layout_of()).shared_memory and other._control is None
    # A bad token is refused at HELLO and its connection closed.
    conn = _raw(server)
    control_frames.send(conn, control_frames.HELLO, b"not-a-token")
    code, body = control_frames.receive(conn)
    assert code == 16 and b"invalid bearer token" in body  # UNAUTHENTICATED
    assert conn.recv(1) == b""
    conn.close()
    # A token that works nowhere is refused by gRPC's Attach, before any socket is told.
    with pytest.raises(Unauthenticated):
        start.client(server, auth_token="nope").attach("model", layout_of())


SYSTEM_PYTHON = "/usr/bin/python3"  # one that another user may run (a venv under /root is not)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs root and /usr/bin/python3"
)
def test_a_process_of_another_user_is_not_served(start):
    """The socket is the 0600 segment's boundary (SECURITY.md): its file mode refuses another
    user's connect, and the service checks each peer's user too (SO_PEERCRED)."""
    server = start()
    assert stat.S_IMODE(os.stat(server.control.path).st_mode) == 0o600
    peer = f"""
import socket, struct
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.settimeout(5)
try:
    conn.connect({server.control.path!r})
    conn.sendall(struct.pack("<IB", 0, {control_frames.HELLO}))
    print(repr(conn.recv(16) or "refused"))
except OSError:  # the connect (file mode), or the HELLO after the service closed it
    print(repr("refused"))
"""
    for user, answer in ((65534, "'refused'"), (0, repr(control_frames.HEADER.pack(0, control_frames.OK)))):
        result = subprocess.run([SYSTEM_PYTHON, "-c", peer], user=user, capture_output=True, text=True, timeout=30)
        assert result.stdout.strip() == answer, (user, result.stderr)


def test_a_service_without_the_socket_keeps_grpc(start):
    server = start(control_socket=False)
    client = start.client(server)
    tokens = _stored(client, 2)
    assert server.control is None and client._control is None
    hit = client.lookup(tokens)
    assert hit.blocks == 2 and client.release(hit)


def test_a_dead_services_socket_file_is_replaced_and_any_other_file_left_alone():
    """The socket sits beside the segment; a killed service leaves it behind. The next service
    on that segment name binds anew; a file that is no socket of this user stays, and the
    service serves over gRPC alone. A stopped service removes its own."""
    name = f"pfx-test-control-{os.getpid()}"
    path = control_frames.socket_path(name)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening, closed without unlink: what a kill leaves
    dead.close()
    backend = BackendOptions(cache=CacheConfig(host_capacity=1 << 22), block_size=16, shm_name=name)
    server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0"))
    try:
        assert server.control is not None and server.control.path == path
        with CacheClient(server.address) as client:
            tokens = _stored(client, 2)
            assert client._control is not None and client._control.path == path
            hit = client.lookup(tokens)
            assert hit.blocks == 2 and server.control.connections == 1 and client.release(hit)
    finally:
        server.shutdown(0)
    assert not os.path.exists(path)  # unlinked on the way out
    with open(path, "w") as squatter:
        squatter.write("not a socket")
    try:
        server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0"))
        try:
            assert server.control is None
            with CacheClient(server.address) as client:
                tokens = _stored(client, 2)
                assert client._control is None and client.lookup(tokens).blocks == 2
        finally:
            server.shutdown(0)
        with open(path) as left:
            assert left.read() == "not a socket"
    finally:
        os.unlink(path)


def test_an_unresponsive_service_costs_one_deadline_not_two(tmp_path):
    """A socket whose service takes connections but never answers (hung): CacheUnavailable at
    the call's deadline, not None (which would spend a second deadline on gRPC)."""
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(tmp_path / "hung.sock"))
    hung.listen(8)  # connections queue in the kernel; nobody accepts or answers
    control = ControlSocket(str(tmp_path / "hung.sock"), None, "127.0.0.1:1")
    try:
        started = time.monotonic()
        with pytest.raises(CacheUnavailable, match="DEADLINE_EXCEEDED"):
            control.call("Lookup", pb.LookupRequest(namespace_id="n", tokens=[1]), pb.LookupResponse, 0.3)
        assert 0.25 < time.monotonic() - started < 2.0
        hung.close()  # ...while a socket nobody listens on is only unreachable: gRPC's turn
        assert control.call("Release", pb.ReleaseRequest(lease_id=1), pb.ReleaseResponse, 0.3) is None
    finally:
        control.close()
        hung.close()


def test_a_drained_or_stopped_service_answers_unavailable_over_the_socket(start):
    server = start()
    client = start.client(server)
    tokens = _stored(client, 2)
    client.lookup(tokens, take_lease=False)
    server.backend.begin_drain()  # what shutdown does first
    with pytest.raises(CacheUnavailable):
        client.lookup(tokens)
    server.shutdown(0)
    started = time.monotonic()
    with pytest.raises(CacheUnavailable):  # the kept connection is closed; gRPC is gone too
        client.lookup(tokens, timeout_s=2)
    assert time.monotonic() - started < 2.5
