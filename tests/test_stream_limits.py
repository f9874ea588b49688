"""Streams whose peer stalls cannot deny service to other clients (issue 33, finding 5).

Against a real in-process server and real gRPC clients: Store streams that send a header and then
nothing, and a Fetch whose client never reads, are cancelled at the idle deadline, so the stream
threads go back to other clients; while every stream thread is held, health says NOT_SERVING;
Store buffering is bounded service-wide (a Store beyond it is refused at its header).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from prefixcache.config import CacheConfig, KVLayout
from prefixcache.errors import ResourceExhausted
from prefixcache.rpc import cache_pb2 as pb
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from tests.support.poll import poll
from tests.support.service import (
    BLOCK,
    health_status,
    layout_of,
    prompt,
    random_kv,
    running_servers,
    same_bytes,
    store_header,
    stub_for,
)

pytestmark = pytest.mark.process

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def clients():
    with running_servers() as make:
        yield make.client


def serve(host_capacity: int, **options) -> object:
    backend = BackendOptions(cache=CacheConfig(host_capacity=host_capacity), block_size=BLOCK)
    return build_server(ServerOptions(backend=backend, listen="127.0.0.1:0", **options))


def test_stalled_store_streams_are_cancelled_and_others_are_served(clients) -> None:
    """Before: 16 Store streams that sent a header and stalled held every stream thread (still
    open after 20 s), other clients' Store and Fetch hit their deadlines, and health said SERVING."""
    server = serve(4 << 20, stream_workers=4, stream_idle_timeout_s=0.5)
    release = threading.Event()
    try:
        client = clients(server)
        client.attach("model", layout_of())
        ns = client.attachment.namespace_id
        stub = stub_for(server)

        def stalled():
            yield store_header(ns, tokens=prompt(2, start=5000))
            release.wait(30)

        start = time.monotonic()
        attackers = [stub.Store.future(stalled(), timeout=30) for _ in range(8)]  # twice the stream threads
        channel = grpc.insecure_channel(server.address)
        assert poll(lambda: health_status(channel) == NOT_SERVING, 5), "health while every stream thread is held"
        tokens, kv = prompt(4), random_kv(4, layout_of(), seed=5)
        other = clients(server)
        other.attach("model", layout_of(), same_host=False)  # KV through the Store/Fetch streams
        assert other.store(tokens, kv, timeout_s=10).stored == 4
        hit = other.lookup(tokens)
        assert same_bytes(other.read(hit, timeout_s=10), kv)
        other.release(hit)
        served_s = time.monotonic() - start
        codes = [attacker.exception(10).code() for attacker in attackers]
        assert codes == [grpc.StatusCode.CANCELLED] * 8
        assert served_s < 5.0, served_s  # two rounds of 0.5 s idle deadlines, not never
        assert server.streams.cancelled["idle"] == 8
        assert poll(lambda: health_status(channel) == SERVING, 5)
        channel.close()
    finally:
        release.set()
        server.shutdown(0)


def test_a_fetch_whose_client_never_reads_is_cancelled(clients) -> None:
    """Before: 16 Fetch streams whose client never read blocked every other Fetch, also after
    their leases expired. One stream thread here: the stalled Fetch is cancelled at 0.5 s idle
    and the next client's Fetch runs."""
    layout = KVLayout(layers=8, kv_heads=8, head_dim=128, block_size=BLOCK, dtype="float16")  # 512 KiB blocks
    server = serve(32 << 20, stream_workers=1, stream_idle_timeout_s=0.5)
    try:
        client = clients(server)
        client.attach("model", layout, same_host=False)
        tokens, kv = prompt(32), random_kv(32, layout, seed=6)  # 16 MiB: beyond any flow-control window
        assert client.store(tokens, kv, timeout_s=30).stored == 32
        hit = client.lookup(tokens)
        stalled = stub_for(server).Fetch(pb.FetchRequest(lease_id=hit.lease_id), timeout=60)  # never read
        time.sleep(0.2)  # (the stalled Fetch takes the one stream thread first)
        start = time.monotonic()
        assert same_bytes(client.read(hit, timeout_s=10), kv)
        assert time.monotonic() - start < 5.0
        assert server.streams.cancelled["idle"] >= 1
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stalled:
                pass
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        client.release(hit)
    finally:
        server.shutdown(0)


def test_store_buffering_is_bounded_across_streams(clients) -> None:
    """Before: each Store stream could buffer up to the host capacity (16 GiB with 16 streams at
    the 1 GiB default). A Store that does not fit in --max-store-buffer beside the others is
    refused at its header, before a byte of it is buffered."""
    layout = layout_of()
    server = serve(4 << 20, max_store_buffer_bytes=3 * layout.block_bytes, stream_idle_timeout_s=5)
    release = threading.Event()
    try:
        client = clients(server)
        client.attach("model", layout, same_host=False)
        ns = client.attachment.namespace_id

        def holding():
            yield store_header(ns, tokens=prompt(2, start=9000))  # 2 blocks held while it stalls
            release.wait(30)

        held = stub_for(server).Store.future(holding(), timeout=30)
        assert poll(lambda: server.store_buffers.used == 2 * layout.block_bytes, 5)
        with pytest.raises(ResourceExhausted, match="header.block_count"):
            client.store(prompt(2), random_kv(2, layout, seed=7), timeout_s=10)
        assert client.store(prompt(1), random_kv(1, layout, seed=8), timeout_s=10).stored == 1  # fits beside it
        release.set()
        assert held.exception(10) is not None  # it sent no data: refused for its missing bytes
        assert poll(lambda: server.store_buffers.used == 0, 5)
    finally:
        release.set()
        server.shutdown(0)


def test_one_tenant_holds_at_most_its_share_of_the_stream_threads() -> None:
    """Finding 6: pools were service-wide, so one tenant's stalled streams took every stream
    thread from the others. With two tenants and 4 stream threads (share 0.5), acme's third
    stream is refused at once while globex still stores through the stream."""
    from prefixcache_services.cache_server.auth import Authenticator, parse_credentials

    credentials = parse_credentials("tok-acme-0123456789 acme\ntok-globex-0123456789 globex\n")
    backend = BackendOptions(cache=CacheConfig(host_capacity=4 << 20), block_size=BLOCK)
    server = build_server(
        ServerOptions(
            backend=backend,
            listen="127.0.0.1:0",
            authenticator=Authenticator(credentials),
            stream_workers=4,
            stream_idle_timeout_s=5,
        )
    )
    release = threading.Event()
    with running_servers() as make:
        try:
            acme, globex = (make.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex"))
            layout = layout_of()
            ns = acme.attach("model", layout, same_host=False).namespace_id
            globex.attach("model", layout, same_host=False)
            metadata = (("authorization", "Bearer tok-acme-0123456789"),)

            def stalled():
                yield store_header(ns, tokens=prompt(1, start=7000), block_count=1)
                release.wait(30)

            stub = stub_for(server)
            held = [stub.Store.future(stalled(), metadata=metadata, timeout=30) for _ in range(2)]
            assert poll(lambda: server.shares.held("streams", "acme") == 2, 5)
            with pytest.raises(ResourceExhausted, match="share of stream threads"):
                acme.store(prompt(2), random_kv(2, layout, seed=9), timeout_s=10)
            tokens, kv = prompt(2, start=100), random_kv(2, layout, seed=10)
            assert globex.store(tokens, kv, timeout_s=10).stored == 2  # the other tenant is served
            hit = globex.lookup(tokens)
            assert same_bytes(globex.read(hit, timeout_s=10), kv)
            globex.release(hit)
            release.set()
            for call in held:
                call.exception(10)
            assert poll(lambda: server.shares.held("streams", "acme") == 0, 5)  # counted out as they end
            assert acme.store(prompt(2), random_kv(2, layout, seed=9), timeout_s=10).stored == 2
        finally:
            release.set()
            server.shutdown(0)
