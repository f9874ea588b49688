"""The gRPC cache service over a real loopback channel to a server started by each test.

Covers: byte-exact KV round trips through shared memory and through the
Fetch/Store streams (float16, bfloat16, float32, random bit patterns);
leases blocking eviction and expiring; the malformed-request matrix (each
case answers its status code and names its field, and the server keeps
serving); protobuf fuzzing through generic calls; health transitions while
draining; auth on and off, tenants; metrics; generated code freshness.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import msgspec
import pytest
import torch
import zmq
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import wire
from prefixcache.client import CacheClient, CacheUnavailable, Unauthenticated
from prefixcache.config import CacheConfig, KVLayout
from prefixcache.errors import InvalidArgument, ResourceExhausted, UnknownLease
from prefixcache.kinds import MissReason
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.rpc import cache_pb2_grpc as pb_grpc
from prefixcache_services.cache_server.auth import Authenticator, parse_credentials
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.command import quotas_from
from prefixcache_services.cache_server.kv_events import END_SEQ
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from prefixcache_services.cache_server.servicer import METHODS, REQUEST_TYPES, SERVICE_NAME
from tests.support.poll import poll
from tests.support.service import (
    BLOCK,
    BLOCK_BYTES,
    CODE,
    DTYPES,
    FUZZ_METHODS,
    MATRIX,
    ROOT,
    fuzz_inputs,
    health_status,
    layout_of,
    prompt,
    random_kv,
    rpc_code,
    running_servers,
    same_bytes,
    store_header,
    stub_for,
)

pytestmark = pytest.mark.process


@pytest.fixture
def start():
    """`start(**server options)` -> a running server; `start.client(server)` -> a client; all stopped after."""
    with running_servers() as make:
        yield make


# -- round trips ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("writer_local,reader_local", [(True, True), (False, False), (True, False), (False, True)])
def test_round_trip_is_byte_exact(start, dtype, writer_local, reader_local):
    server = start(max_chunk_bytes=4096, metrics_port=0)  # many chunks, blocks straddling them
    layout = layout_of(dtype)
    writer, reader = start.client(server), start.client(server)
    assert writer.attach("model", layout, same_host=writer_local).shared_memory is writer_local
    assert reader.attach("model", layout, same_host=reader_local).shared_memory is reader_local
    tokens, kv = prompt(7), random_kv(7, layout, seed=len(dtype))
    assert writer.store(tokens, kv).stored == 7
    hit = reader.lookup(tokens)
    assert (hit.hit_tokens, hit.blocks, hit.miss_reason) == (7 * BLOCK, 7, None)
    assert hit.mapped_blocks == (7 if reader_local else 0)
    assert hit.usable_blocks == min(7, (len(tokens) - 1) // BLOCK)  # the last token is computed
    try:
        assert same_bytes(reader.read(hit), kv)
        assert same_bytes(reader.read(hit, blocks=slice(2, 5)), kv[2:5])  # a range of the same Hit
        out = torch.empty_like(kv[:6])
        assert reader.read(hit, out=out, blocks=slice(0, 6)) is out and same_bytes(out, kv[:6])
        with pytest.raises(InvalidArgument, match="blocks"):
            reader.read(hit, blocks=slice(0, 7, 2))
    finally:
        assert reader.release(hit)
    fetches = server.metrics.registry.get_sample_value("prefixcache_rpcs_total", {"method": "Fetch", "code": "OK"})
    assert (fetches or 0) == (0 if reader_local else 3)  # shared memory moves no KV through gRPC


def test_fetch_chunks_are_bounded_and_contiguous(start):
    server = start(host_capacity="16MiB")
    layout = KVLayout(layers=4, kv_heads=8, head_dim=64, block_size=BLOCK, dtype="float16")  # 128 KiB blocks
    client = start.client(server)
    client.attach("model", layout)
    tokens, kv = prompt(40), random_kv(40, layout, seed=1)  # 5 MiB: more than one default chunk
    client.store(tokens, kv)
    hit = client.lookup(tokens)
    stub = stub_for(server)
    for limit, expected_max in ((0, 1 << 20), (300_000, 300_000), (4 << 20, server.options.max_chunk_bytes)):
        chunks = list(stub.Fetch(pb.FetchRequest(lease_id=hit.lease_id, max_chunk_bytes=limit)))
        assert max(len(c.data) for c in chunks) == expected_max
        assert max(c.ByteSize() for c in chunks) <= 4 << 20  # default clients accept every message
        assert [c.offset for c in chunks] == [sum(len(c.data) for c in chunks[:i]) for i in range(len(chunks))]
        assert {c.total_bytes for c in chunks} == {kv.numel() * 2} and {c.block_count for c in chunks} == {40}
        assert b"".join(c.data for c in chunks) == kv.view(torch.uint8).numpy().tobytes()


def test_partial_hit_and_salted_namespace(start):
    server = start()
    layout = layout_of()
    client = start.client(server)
    client.attach("model", layout)
    tokens, kv = prompt(6), random_kv(6, layout, seed=2)
    client.store(tokens[: 4 * BLOCK], kv[:4])
    hit = client.lookup(tokens, take_lease=False)
    assert (hit.hit_tokens, hit.lease_id, hit.miss_reason.value) == (4 * BLOCK, None, "not_cached")
    assert client.store(tokens, kv[4:], start_block=4).stored == 2  # extends the cached prefix
    salted = client.lookup(tokens, cache_salt="user-42", take_lease=False)
    assert salted.hit_tokens == 0 and salted.namespace_id != hit.namespace_id
    client.store(tokens, kv, cache_salt="user-42")
    assert client.lookup(tokens, cache_salt="user-42", take_lease=False).hit_tokens == 6 * BLOCK
    assert client.lookup(tokens[:10], take_lease=False).miss_reason.value == "shorter_than_block"


def test_device_tier_hits_stream_when_the_pool_is_not_mapped(start):
    """CI has no GPU: a CPU-backed device tier runs the same code; a worker without IPC gets the stream."""
    layout = layout_of("bfloat16")
    backend = BackendOptions(
        cache=CacheConfig(host_capacity=16 * layout.block_bytes, device_capacity=4 * layout.block_bytes),
        block_size=BLOCK,
        device="cpu",
    )
    server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0"))
    try:
        client = start.client(server)
        assert not client.attach("model", layout).device_ipc
        tokens, kv = prompt(8), random_kv(8, layout, seed=12)
        client.store(tokens, kv)
        hit = client.lookup(tokens)
        assert [int(t) for t in hit.locations.tiers] == [0] * 4 + [1] * 4  # root side promoted to the device
        assert same_bytes(client.read(hit), kv)
        client.release(hit)
    finally:
        server.shutdown(0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(start, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    server = start(tls_cert_file=str(cert), tls_key_file=str(key))
    secure = start.client(server, tls_root_cert_file=str(cert))
    secure.attach("model", layout_of())
    assert secure.stats().ready
    with pytest.raises(CacheUnavailable):
        start.client(server).stats()  # plaintext to a TLS port


def test_namespaces_per_tenant_are_bounded(start):
    backend = BackendOptions(cache=CacheConfig(host_capacity="1MiB"), block_size=BLOCK, max_namespaces_per_tenant=3)
    server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0"))
    try:
        client = start.client(server)
        client.attach("model", layout_of())
        assert client.inspect(prompt(1), cache_salt="never-used").hit_tokens == 0  # creates nothing
        assert client.evict(namespace_id=client.attachment.namespace_id, cache_salt="never-used") == 0
        kv = random_kv(1, layout_of(), seed=3)
        for salt in ("a", "b", "a"):  # the attached namespace and two salts holding blocks: the budget of 3
            client.store(prompt(1), kv, cache_salt=salt)
        with pytest.raises(ResourceExhausted, match="cache_salt"):
            client.lookup(prompt(1), cache_salt="c", take_lease=False)
        with pytest.raises(ResourceExhausted, match="model"):
            client.attach("another-model", layout_of())
        assert client.attach("model", layout_of()).namespace_id  # attaching again is idempotent
        # issue 33: once the salts hold nothing they are reclaimed, never a permanent lock-out
        client.evict(namespace_id=client.attachment.namespace_id, cache_salt="b")
        assert client.lookup(prompt(1), cache_salt="c", take_lease=False).hit_tokens == 0
        assert client.lookup(prompt(1), cache_salt="a", take_lease=False).hit_tokens == BLOCK  # kept: holds a block
        assert client.lookup(prompt(1), cache_salt="b", take_lease=False).hit_tokens == 0  # derived again
    finally:
        server.shutdown(0)


def test_salts_that_hold_nothing_never_lock_a_tenant_out(start):
    """Issue 33, finding 4: 1,024 distinct cache_salt values on Lookup exhausted a tenant's
    namespaces for good (new salts and a new model revision refused until restart, after a Flush
    and after the TTL). Salts holding no blocks, leases or reservations are reclaimed at the limit."""
    backend = BackendOptions(cache=CacheConfig(host_capacity="1MiB"), block_size=BLOCK, max_namespaces_per_tenant=8)
    server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0"))
    try:
        client = start.client(server)
        client.attach("model", layout_of())
        kv = random_kv(1, layout_of(), seed=4)
        for i in range(7):  # the budget, every salt holding a block
            client.store(prompt(1), kv, cache_salt=f"stored-{i}")
        with pytest.raises(ResourceExhausted, match="cache_salt"):
            client.lookup(prompt(1), cache_salt="one-more", take_lease=False)
        client.flush()
        for i in range(100):  # an end user sending a new salt with every request
            assert client.lookup(prompt(1), cache_salt=f"user-{i}", take_lease=False).hit_tokens == 0
        assert client.attach("model", layout_of(), revision="v2").namespace_id  # a new revision still attaches
        client.store(prompt(1), kv, cache_salt="kept")
        hit = client.lookup(prompt(1), cache_salt="kept")  # a block and a lease: never reclaimed
        for i in range(100):
            client.lookup(prompt(1), cache_salt=f"again-{i}", take_lease=False)
        assert client.lookup(prompt(1), cache_salt="kept", take_lease=False).namespace_id == hit.namespace_id
        client.release(hit)
        assert client.lookup(prompt(1), cache_salt="kept", take_lease=False).hit_tokens == BLOCK
    finally:
        server.shutdown(0)


def test_serve_flags_wire_the_redis_tier(start, private_redis):
    from prefixcache_services.cache_server.command import options_from
    from prefixcache_services.cli import build_parser

    layout = layout_of()
    args = build_parser().parse_args(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--block-size",
            str(BLOCK),
            "--host-capacity",
            str(8 * layout.block_bytes),
            "--redis-url",
            private_redis.url,
            "--redis-key-prefix",
            "pfxtest",
            "--redis-timeout-ms",
            "500",
        ]
    )
    server = build_server(options_from(args))
    try:
        client = start.client(server)
        client.attach("model", layout)
        first, kv = prompt(4, start=0), random_kv(4, layout, seed=13)
        client.store(first, kv)  # written through to Redis
        client.store(prompt(8, start=70_000), random_kv(8, layout, seed=14))  # pushes `first` out of host
        poll(lambda: client.stats().snapshot.remote.get("spills_queued", 0) >= 12, 10)
        assert server.backend.cache.remote_link.tier.wait_idle(10)
        assert client.stats().snapshot.remote_up is True
        assert client.inspect(first).hit_tokens == 0  # gone from the host tier...
        hit = client.lookup(first)  # ...and promoted back from Redis
        assert hit.hit_tokens == 4 * BLOCK and same_bytes(client.read(hit), kv)
        assert client.stats().snapshot.promotions == {"host": 4}
        client.release(hit)
    finally:
        server.shutdown(0)


# -- leases ----------------------------------------------------------------------
def test_lease_blocks_eviction_until_released(start):
    layout = layout_of()
    server = start(host_capacity=8 * layout.block_bytes)  # exactly 8 slots
    client = start.client(server)
    client.attach("model", layout)
    first, kv = prompt(8, start=0), random_kv(8, layout, seed=3)
    assert client.store(first, kv).stored == 8
    hit = client.lookup(first)
    second = prompt(4, start=50_000)
    assert client.store(second, random_kv(4, layout, seed=4)).stored == 0  # every slot is leased
    assert same_bytes(client.read(hit), kv)
    assert client.lookup(second, take_lease=False).hit_tokens == 0
    client.release(hit)
    assert client.store(second, random_kv(4, layout, seed=4)).stored == 4
    assert client.lookup(first, take_lease=False).hit_tokens == 4 * BLOCK  # leaf-first: the tail went


def test_a_lookup_releases_the_leases_it_carries_and_skips_those_already_gone(start):
    layout = layout_of()
    server = start(host_capacity=8 * layout.block_bytes)  # exactly 8 slots
    client = start.client(server)
    client.attach("model", layout)
    first, second = prompt(8, start=0), prompt(4, start=50_000)
    assert client.store(first, random_kv(8, layout, seed=3)).stored == 8
    held, gone = client.lookup(first), client.lookup(first)
    assert client.release(gone)
    assert client.stats().snapshot.active_leases == 1
    assert client.store(second, random_kv(4, layout, seed=4)).stored == 0  # every slot is leased
    stub = stub_for(server)
    ns_id = client.attachment.namespace_id
    reply = stub.Lookup(
        pb.LookupRequest(namespace_id=ns_id, tokens=second, release_lease_ids=[held.lease_id, gone.lease_id, 12345])
    )
    assert (reply.leases_released, reply.lease_id) == (1, 0)  # released first; the other two were unknown
    assert client.stats().snapshot.active_leases == 0
    assert client.release(held) is False  # already released
    assert client.store(second, random_kv(4, layout, seed=4)).stored == 4
    again = client.lookup(second)
    assert client.lookup(first, take_lease=False, release=[again]).hit_tokens == 4 * BLOCK  # the client's way
    assert client.stats().snapshot.active_leases == 0
    with pytest.raises(grpc.RpcError) as error:
        stub.Lookup(pb.LookupRequest(namespace_id=ns_id, tokens=second, release_lease_ids=[0]))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "release_lease_ids" in error.value.details()


def test_lease_expires_and_frees_its_blocks(start):
    layout = layout_of()
    server = start(host_capacity=8 * layout.block_bytes, lease_ttl_s=0.3, expire_interval_s=0.05)
    local, remote = start.client(server), start.client(server)
    local.attach("model", layout)
    remote.attach("model", layout, same_host=False)
    tokens = prompt(8, start=0)
    local.store(tokens, random_kv(8, layout, seed=5))
    local_hit, remote_hit = local.lookup(tokens), remote.lookup(tokens)
    assert local.stats().snapshot.active_leases == 2
    assert poll(lambda: local.stats().snapshot.active_leases == 0, 5)
    with pytest.raises(UnknownLease):
        local.read(local_hit)  # its local deadline passed: shared memory is not trusted
    with pytest.raises(UnknownLease):
        remote.read(remote_hit)  # the service says NOT_FOUND
    assert local.release(local_hit) is False
    assert local.store(prompt(4, start=90_000), random_kv(4, layout, seed=6)).stored == 4


@pytest.fixture
def attached(start):
    server = start(host_capacity=64 * BLOCK_BYTES, max_prompt_tokens=4096)
    client = start.client(server)
    client.attach("model", layout_of())
    client.store(prompt(2), random_kv(2, layout_of(), seed=7))
    return server, stub_for(server), client


def test_match_over_grpc_takes_no_lease_and_is_fast(start):
    server = start(host_capacity=600 * BLOCK_BYTES, max_prompt_tokens=8192)
    client = start.client(server)
    client.attach("model", layout_of())
    tokens = list(range(8192))  # 512 blocks of 16
    assert client.store(tokens[: 300 * BLOCK], random_kv(300, layout_of(), seed=3)).stored == 300
    report = client.match(tokens)
    assert (report.hit_tokens, report.blocks, report.remote_blocks) == (300 * BLOCK, {"host": 300}, 0)
    assert report.miss_reason is MissReason.NOT_CACHED and report.prompt_tokens == 8192
    salted = client.match(tokens, cache_salt="never-used")
    assert (salted.hit_tokens, salted.blocks) == (0, {})
    times = []
    for _ in range(100):
        begin = time.perf_counter()
        client.match(tokens)
        times.append(time.perf_counter() - begin)
    stats = client.stats().snapshot
    assert stats.active_leases == 0 and stats.lookups == 0  # Match neither leases nor counts
    p50 = sorted(times)[50]
    print(f"Match round trip over loopback gRPC, 8192 tokens: p50 {p50 * 1e3:.2f} ms")
    assert p50 < 5e-3, p50  # the service's part is ~50 us (tests/test_match.py); the rest is gRPC Python


def test_serve_publishes_kv_events_with_replay(start):
    """`serve --kv-events-endpoint/--kv-events-replay-endpoint`: a store shows up as BlockStored
    (read back through replay, which has no subscription race)."""
    server = start(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    client = start.client(server)
    client.attach("model", layout_of())
    assert client.store(prompt(3), random_kv(3, layout_of(), seed=5)).stored == 3
    assert poll(lambda: server.kv_events.published >= 1, 5)
    ctx = zmq.Context()
    try:
        replay = ctx.socket(zmq.DEALER)
        replay.connect(server.kv_events.replay_endpoint)
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        stored = []
        while True:
            assert replay.poll(5000)
            _empty, _topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            stored += [e for e in msgspec.msgpack.decode(payload)[1] if e["type"] == "BlockStored"]
        expected = [prompt(3)[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
        assert sorted(e["token_ids"] for e in stored) == expected
        assert {e["medium"] for e in stored} == {"CPU"} and stored[0]["parent_block_hash"] is None
    finally:
        ctx.destroy(linger=0)


def test_malformed_request_matrix(attached):
    server, stub, client = attached
    ns = client.attachment.namespace_id
    failures = []
    for name, (_method, code, field, call) in MATRIX.items():
        got = rpc_code(call, stub, ns)
        if got != (code, field):
            failures.append(f"{name}: got {got}, expected {(code, field)}")
        assert client.lookup(prompt(2), take_lease=False).hit_tokens == 2 * BLOCK  # still serving
    assert not failures, "\n".join(failures)


def _resolves(message_descriptor, path: str) -> bool:
    """Whether dotted `path` names a field of the message (through message-typed fields)."""
    descriptor = message_descriptor
    for part in path.split("."):
        if descriptor is None or part not in descriptor.fields_by_name:
            return False
        descriptor = descriptor.fields_by_name[part].message_type
    return True


def test_every_field_an_error_names_is_spelled_as_in_the_proto():
    """Issue 15.7: each INVALID_ARGUMENT / RESOURCE_EXHAUSTED case of the matrix (which the test
    above runs against a server: the trailer `prefixcache-field` must equal the expectation) names
    a field of that method's request message, or the whole `request`; every method is covered."""
    named = {(CODE.INVALID_ARGUMENT, True), (CODE.RESOURCE_EXHAUSTED, True)}
    wrong = [
        f"{name}: {method}.{field}"
        for name, (method, code, field, _call) in MATRIX.items()
        if (code, True) in named
        and not (field == "request" or (field and _resolves(REQUEST_TYPES[method].DESCRIPTOR, field)))
    ]
    assert not wrong, wrong
    with_errors = {method for method, code, _field, _call in MATRIX.values() if (code, True) in named}
    assert with_errors >= set(METHODS) - {"GetStats", "ListNamespaces", "Flush", "Release", "ListPins"}, with_errors


def test_client_raises_typed_errors(attached):
    _server, _stub, client = attached
    with pytest.raises(InvalidArgument) as caught:
        client.lookup([3, -3])
    assert caught.value.field == "tokens"
    with pytest.raises(InvalidArgument) as caught:
        client.store(prompt(1), random_kv(1, layout_of("bfloat16"), seed=0))
    assert caught.value.field == "kv"
    dead = CacheClient("127.0.0.1:1", timeout_s=2)
    with pytest.raises(CacheUnavailable):
        dead.stats()
    dead.close()


def test_oversized_message_is_resource_exhausted(start):
    server = start(max_receive_bytes=1 << 20, max_send_bytes=1 << 20, max_chunk_bytes=256 << 10)
    stub = stub_for(server)
    code, _ = rpc_code(stub.Lookup, pb.LookupRequest(namespace_id="0" * 16, tokens=[2**31] * 400_000))
    assert code is CODE.RESOURCE_EXHAUSTED
    assert rpc_code(stub.GetStats, pb.GetStatsRequest())[0] is CODE.OK


# -- fuzzing ---------------------------------------------------------------------------
def test_protobuf_fuzzing_never_yields_unknown(attached):
    server, _stub, client = attached
    channel = grpc.insecure_channel(server.address)
    rng = random.Random(20240611)
    seen: dict[grpc.StatusCode, int] = {}
    assert set(FUZZ_METHODS) == set(METHODS)  # every method of the service is fuzzed
    for method, (kind, valid) in FUZZ_METHODS.items():
        path = f"/{SERVICE_NAME}/{method}"
        for data in fuzz_inputs(rng, valid.SerializeToString()):
            if kind == "unary":
                code, _ = rpc_code(channel.unary_unary(path), data, timeout=10)
            elif kind == "stream_out":
                code, _ = rpc_code(channel.unary_stream(path), data, timeout=10)
            else:
                code, _ = rpc_code(channel.stream_unary(path), iter([data, rng.randbytes(7)]), timeout=10)
            seen[code] = seen.get(code, 0) + 1
            assert code not in (CODE.UNKNOWN, CODE.INTERNAL), f"{method} answered {code} to {data!r}"
    assert seen.get(CODE.INVALID_ARGUMENT, 0) > 100  # the fuzz did reach the validators
    client.store(prompt(2), random_kv(2, layout_of(), seed=7))  # the fuzz may have flushed
    assert client.lookup(prompt(2), take_lease=False).hit_tokens == 2 * BLOCK
    channel.close()


# -- health and drain -----------------------------------------------------------------
def test_health_transitions_while_draining_a_stream(start):
    server = start(host_capacity="32MiB", max_chunk_bytes=1 << 20)
    layout = KVLayout(layers=4, kv_heads=8, head_dim=64, block_size=BLOCK, dtype="bfloat16")
    client = start.client(server)
    client.attach("model", layout)
    tokens, kv = prompt(192), random_kv(192, layout, seed=8)  # 24 MiB: more than the stream's windows
    client.store(tokens, kv)
    hit = client.lookup(tokens)
    channel = grpc.insecure_channel(server.address)
    assert health_status(channel) == health_status(channel, "") == health_pb2.HealthCheckResponse.SERVING
    stream = pb_grpc.PrefixCacheStub(channel).Fetch(pb.FetchRequest(lease_id=hit.lease_id))
    received = [next(stream).data]
    drain = threading.Thread(target=server.shutdown, args=(20,))
    drain.start()
    assert poll(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
    assert server.tracker.in_flight == 1  # the Fetch is still being served
    with pytest.raises(CacheUnavailable):
        client.lookup(tokens)
    received += [chunk.data for chunk in stream]
    drain.join(10)
    assert not drain.is_alive()
    assert b"".join(received) == kv.view(torch.uint8).numpy().tobytes()
    with pytest.raises(grpc.RpcError):
        health_status(channel)
    channel.close()


def test_reflection_describes_the_service(start):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = start()
    channel = grpc.insecure_channel(server.address)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, files = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {service.name for service in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    described = descriptor_pb2.FileDescriptorProto.FromString(files.file_descriptor_response.file_descriptor_proto[0])
    assert described.name == "prefixcache/v1/cache.proto"
    assert "Lookup" in {method.name for method in described.service[0].method}
    channel.close()


# -- auth ---------------------------------------------------------------------------------
def test_auth_shared_token(start):
    token = "s3cret-token-0123456789"
    server = start(authenticator=Authenticator.shared_token(token))
    for bad in (None, "wrong-token-0123456789", token + "x"):
        client = start.client(server, auth_token=bad)
        with pytest.raises(Unauthenticated):
            client.attach("model", layout_of())
    stub = stub_for(server)
    assert rpc_code(stub.Fetch, pb.FetchRequest(lease_id=1))[0] is CODE.UNAUTHENTICATED
    assert rpc_code(stub.Store, iter([store_header("0" * 16)]))[0] is CODE.UNAUTHENTICATED
    channel = grpc.insecure_channel(server.address)
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    channel.close()
    good = start.client(server, auth_token=token)
    good.attach("model", layout_of())
    good.store(prompt(2), random_kv(2, layout_of(), seed=9))
    assert good.lookup(prompt(2), take_lease=False).hit_tokens == 2 * BLOCK
    assert good.flush() == 2  # the single shared token is the admin


def test_auth_off_accepts_anyone(start):
    server = start()
    for token in (None, "anything"):
        client = start.client(server, auth_token=token)
        client.attach("model", layout_of())
        assert client.stats().ready


def test_tenants_are_isolated_and_salts_only_subdivide(start):
    credentials = parse_credentials(
        "tok-acme-0123456789 acme\ntok-globex-0123456789 globex\ntok-ops-0123456789 ops admin\n"
    )
    server = start(authenticator=Authenticator(credentials))
    acme, globex, ops = (start.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex", "ops"))
    layout = layout_of()
    ids = [c.attach("model", layout, same_host=False).namespace_id for c in (acme, globex)]
    assert ids[0] != ids[1]
    tokens, kv = prompt(3), random_kv(3, layout, seed=10)
    acme.store(tokens, kv, cache_salt="team-a")
    acme_hit = acme.lookup(tokens, cache_salt="team-a")
    assert acme_hit.hit_tokens == 3 * BLOCK  # positive control
    assert globex.lookup(tokens, cache_salt="team-a", take_lease=False).hit_tokens == 0
    assert globex.lookup(tokens, take_lease=False).hit_tokens == 0
    with pytest.raises(InvalidArgument):  # another tenant's id is "unknown"
        globex.inspect(tokens, namespace_id=acme_hit.namespace_id)
    with pytest.raises(UnknownLease):
        globex.read(acme_hit)  # another tenant's lease is "unknown"
    assert globex.flush() == 0  # a tenant flushes only its own blocks
    assert same_bytes(acme.read(acme_hit), kv)
    acme.release(acme_hit)
    assert ops.flush() == 3  # the admin flushes everything
    assert acme.lookup(tokens, cache_salt="team-a", take_lease=False).hit_tokens == 0


def test_list_namespaces_is_scoped_to_the_tenant(start):
    from prefixcache.kinds import TierKind

    credentials = parse_credentials(
        "tok-acme-0123456789 acme\ntok-globex-0123456789 globex\ntok-ops-0123456789 ops admin\n"
    )
    server = start(authenticator=Authenticator(credentials))
    acme, globex, ops = (start.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex", "ops"))
    assert acme.namespaces() == []  # before any Attach
    layout = layout_of()
    acme_id = acme.attach("model-a", layout, revision="r1", same_host=False).namespace_id
    globex_id = globex.attach("model-g", layout, same_host=False).namespace_id
    acme.store(prompt(3), random_kv(3, layout, seed=21))
    acme.store(prompt(2, start=9000), random_kv(2, layout, seed=22), cache_salt="team-a")
    salted_id = acme.lookup(prompt(2, start=9000), cache_salt="team-a", take_lease=False).namespace_id

    mine = {n.namespace_id: n for n in acme.namespaces()}
    assert set(mine) == {acme_id, salted_id}  # globex's namespace is not listed
    assert (mine[acme_id].model, mine[acme_id].revision, mine[acme_id].salted) == ("model-a", "r1", False)
    assert mine[acme_id].blocks == {TierKind.HOST: 3} and mine[salted_id].blocks == {TierKind.HOST: 2}
    assert mine[salted_id].salted and "team-a" not in repr(mine[salted_id])
    assert all(n.tenant == "" for n in mine.values())  # only an admin is told tenants
    assert [(n.namespace_id, n.blocks) for n in globex.namespaces()] == [(globex_id, {})]

    everyone = ops.namespaces()
    assert {(n.namespace_id, n.tenant) for n in everyone} == {
        (acme_id, "acme"),
        (salted_id, "acme"),
        (globex_id, "globex"),
    }
    assert [n.tenant for n in everyone] == sorted(n.tenant for n in everyone)


def test_pins_survive_lru_over_grpc_and_a_tenant_pins_only_its_own(start):
    credentials = parse_credentials(
        "tok-acme-0123456789 acme\ntok-globex-0123456789 globex\ntok-ops-0123456789 ops admin\n"
    )
    layout = layout_of()
    server = start(authenticator=Authenticator(credentials), host_capacity=8 * layout.block_bytes)
    acme, globex, ops = (start.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex", "ops"))
    acme_id = acme.attach("model", layout, same_host=False).namespace_id
    globex.attach("model", layout, same_host=False)
    system, kv = prompt(4, start=0), random_kv(4, layout, seed=31)
    acme.store(system, kv)
    with pytest.raises(InvalidArgument) as caught:  # another tenant's namespace is "unknown"
        globex.pin(system, namespace_id=acme_id)
    assert caught.value.field == "namespace_id"
    pin = acme.pin(system + [5], ttl_s=3600)
    assert (pin.namespace_id, pin.pinned_tokens) == (acme_id, 4 * BLOCK) and 3590 < pin.expires_in_s <= 3600
    for seed in range(3):  # LRU pressure: 12 blocks through the 4 unpinned slots
        acme.store(prompt(4, start=10_000 * (seed + 1)), random_kv(4, layout, seed=seed))
    assert ops.flush() > 0
    hit = acme.lookup(system)
    assert hit.hit_tokens == 4 * BLOCK and same_bytes(acme.read(hit), kv)
    acme.release(hit)
    assert [p.pin_id for p in acme.pins()] == [p.pin_id for p in ops.pins()] == [pin.pin_id]
    assert globex.pins() == []
    with pytest.raises(InvalidArgument) as caught:
        globex.unpin(pin.pin_id)  # another tenant's pin is "unknown" and stays
    assert caught.value.field == "pin_id" and len(acme.pins()) == 1
    with pytest.raises(InvalidArgument) as caught:
        acme.pin(prompt(2, start=90_000))  # nothing holds it
    assert caught.value.field == "prefix.tokens"  # as PinRequest names it
    ops.unpin(pin.pin_id)  # the admin may end any pin
    assert acme.pins() == [] and ops.flush() == 4


def test_pin_priority_travels_and_a_tenants_pin_never_releases_anothers(start):
    credentials = parse_credentials("tok-acme-0123456789 acme\ntok-globex-0123456789 globex\n")
    layout = layout_of()
    server = start(authenticator=Authenticator(credentials), host_capacity=4 * layout.block_bytes)
    acme, globex = (start.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex"))
    acme_id = acme.attach("model", layout, same_host=False).namespace_id
    globex.attach("model", layout, same_host=False)
    low, high = prompt(2, start=0), prompt(2, start=50_000)
    globex.store(low, random_kv(2, layout, seed=1))
    acme.store(high, random_kv(2, layout, seed=2))
    theirs = globex.pin(low, priority=0)
    mine = acme.pin(high, priority=100)
    assert (theirs.priority, mine.priority) == (0, 100) and [p.priority for p in acme.pins()] == [100]
    # The host tier is pinned full; no Redis: acme's new prefix finds no room, and its priority
    # never reaches globex's pin (only a tenant's own lower pins give way).
    assert acme.store(prompt(2, start=90_000), random_kv(2, layout, seed=3)).rejected == 2
    assert [p.pin_id for p in globex.pins()] == [theirs.pin_id]
    for bad in (101, -1):
        request = pb.PinRequest(namespace_id=acme_id, priority=bad)
        request.prefix.tokens.extend(high)
        assert rpc_code(stub_for(server).Pin, request, metadata=[("authorization", "Bearer tok-acme-0123456789")]) == (
            CODE.INVALID_ARGUMENT,
            "priority",
        )
    with pytest.raises(InvalidArgument) as caught:
        acme.pin(high, priority=1000)  # refused before it is sent
    assert caught.value.field == "priority"


def test_retention_hints_are_bounded_by_the_tenants_policy(start):
    credentials = parse_credentials(
        "tok-acme-0123456789 acme\ntok-globex-0123456789 globex local retention=24h\ntok-ops-0123456789 ops admin\n"
    )
    authenticator = Authenticator(credentials)
    quotas = quotas_from(argparse.Namespace(tenant_quota="", max_retention="1h"), authenticator)
    server = start(authenticator=authenticator, tenant_quotas=quotas, ttl_s=60)
    acme, globex, ops = (start.client(server, auth_token=f"tok-{n}-0123456789") for n in ("acme", "globex", "ops"))
    layout = layout_of()
    acme.attach("model", layout, same_host=False)  # the Store stream
    assert globex.attach("model", layout, same_host=True).shared_memory  # Reserve + Commit
    within, beyond, theirs = prompt(2, start=0), prompt(2, start=10_000), prompt(2, start=20_000)
    kept = acme.store(within, random_kv(2, layout, seed=1), retention_s=1800)
    assert (kept.stored, kept.retention_s, kept.retention_clamped) == (2, 1800, False)
    cut = acme.store(beyond, random_kv(2, layout, seed=2), retention_s=86_400)  # "24h" for a 1h tenant
    assert (cut.stored, cut.retention_s, cut.retention_clamped) == (2, 3600, True)
    allowed = globex.store(theirs, random_kv(2, layout, seed=3), retention_s=86_400)  # its line: retention=24h
    assert (allowed.stored, allowed.retention_s, allowed.retention_clamped) == (2, 86_400, False)
    plain = acme.store(prompt(2, start=30_000), random_kv(2, layout, seed=4))
    assert (plain.retention_s, plain.retention_clamped) == (0, False)
    # The service keeps them that long (the block TTL is 60 s): inspect shows the time left.
    assert all(1790 < b.ttl_left_s <= 1800 for b in acme.inspect(within).blocks)
    assert all(3590 < b.ttl_left_s <= 3600 for b in acme.inspect(beyond).blocks)
    assert all(86_390 < b.ttl_left_s <= 86_400 for b in globex.inspect(theirs).blocks)
    assert tuple(c.stats().snapshot.retention_clamped for c in (ops, acme, globex)) == (
        1,
        1,
        0,
    )
    request = pb.CommitRequest(
        namespace_id=globex.attachment.namespace_id, tokens=theirs, reservation_id=1, retention_seconds=-1
    )
    metadata = [("authorization", "Bearer tok-globex-0123456789")]
    assert rpc_code(stub_for(server).Commit, request, metadata=metadata) == (CODE.INVALID_ARGUMENT, "retention_seconds")


def test_credentials_file_errors_name_the_line():
    with pytest.raises(InvalidArgument, match="line 2"):
        parse_credentials("good-token-0123 acme\nbad-line\n")
    with pytest.raises(InvalidArgument, match="twice"):
        parse_credentials("t1 acme\nt1 globex\n")
    assert parse_credentials("sha256:" + "ab" * 32 + " acme admin")  # digests instead of tokens


# -- inspect, evict, metrics --------------------------------------------------------------
def test_inspect_and_evict(start):
    server = start(ttl_s=60)
    client = start.client(server)
    client.attach("model", layout_of())
    tokens = prompt(4)
    client.store(tokens, random_kv(4, layout_of(), seed=11))
    report = client.inspect(tokens)
    assert [b.block for b in report.blocks] == [0, 1, 2, 3] and {b.tier for b in report.blocks} == {"host"}
    assert all(0 < b.ttl_left_s <= 60 and not b.leased for b in report.blocks)
    hit = client.lookup(tokens)
    assert all(b.leased for b in client.inspect(tokens).blocks)
    assert client.evict(prefix_tokens=tokens[: 2 * BLOCK]) == 0  # leased blocks stay
    client.release(hit)
    assert client.evict(prefix_tokens=tokens[: 2 * BLOCK]) == 3  # block 1 and its descendants
    assert client.lookup(tokens, take_lease=False).hit_tokens == BLOCK
    assert client.evict(older_than_s=0) == 1
    assert client.stats().snapshot.tiers[0].blocks == 0  # (the spare reservation's slots hold no block)


def test_metrics_bind_loopback_unless_told_whatever_listen_is(start):
    """Issue 33: the exporter bound the --listen host, so --listen 0.0.0.0 with --metrics-port
    exposed the unauthenticated figures on every interface."""
    backend = BackendOptions(cache=CacheConfig(host_capacity="1MiB"), block_size=BLOCK)
    server = build_server(ServerOptions(backend=backend, listen="0.0.0.0:0", metrics_port=0))
    try:
        assert server.metrics is not None and server.metrics._http.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown(0)
    wide = start(metrics_port=0, metrics_host="0.0.0.0")  # beyond loopback only when asked
    assert wide.metrics._http.server_address[0] == "0.0.0.0"


def test_metrics_endpoint(start):
    server = start(metrics_port=0)
    client = start.client(server)
    client.attach("model", layout_of())
    secret = [987_654_321] * (2 * BLOCK)
    client.lookup(secret, take_lease=False)
    client.lookup(secret, take_lease=False)

    def settled() -> str:
        # A unary call's pool slot is given back just after its reply reaches the client, so the
        # gauge reads 0 a moment after the second Lookup returns (1 was seen under load).
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        return text if 'prefixcache_unary_calls{state="running"} 0.0' in text else ""

    body = poll(settled, 5, "the running-calls gauge back to 0")
    assert "prefixcache_lookups_total 2.0" in body
    assert 'prefixcache_rpc_duration_seconds_count{method="Lookup"} 2.0' in body
    assert 'prefixcache_tier_capacity_bytes{tier="host"}' in body
    assert 'prefixcache_unary_calls{state="queued"} 0.0' in body
    assert "987654321" not in body


# -- the hand-written wire format of the bulk messages ----------------------------------
@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 2**64 - 1),
    total=st.integers(0, 2**64 - 1),
    count=st.integers(0, 2**32 - 1),
    parts=st.lists(st.binary(max_size=300), max_size=4),
)
def test_bulk_messages_match_protobuf(offset, total, count, parts):
    encoded = wire.encode_fetch_chunk(offset, parts, total, count)
    assert pb.FetchChunk.FromString(encoded) == pb.FetchChunk(
        offset=offset, data=b"".join(parts), total_bytes=total, block_count=count
    )
    reference = pb.FetchChunk(offset=offset, data=b"".join(parts), total_bytes=total, block_count=count)
    piece = wire.decode_fetch_chunk(reference.SerializeToString())
    assert (piece.offset, bytes(piece.data), piece.total_bytes, piece.block_count) == (
        offset,
        b"".join(parts),
        total,
        count,
    )
    data = wire.encode_store_data(parts)
    assert pb.StoreRequest.FromString(data) == pb.StoreRequest(data=b"".join(parts))
    assert bytes(wire.decode_store_request(pb.StoreRequest(data=b"".join(parts)).SerializeToString()).data) == b"".join(
        parts
    )
    header = pb.StoreHeader(namespace_id="0" * 16, tokens=[offset % 100], block_count=count)
    assert wire.decode_store_request(pb.StoreRequest(header=header).SerializeToString()).header == header


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=64))
def test_bulk_decoders_reject_junk_with_wire_error_only(raw):
    for decode in (wire.decode_fetch_chunk, wire.decode_store_request):
        try:
            decode(raw)
        except (wire.WireError, DecodeError):
            pass


# -- generated code ------------------------------------------------------------------------
def test_generated_code_is_fresh(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env, timeout=60)
    for name in ("cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py"):
        committed = (ROOT / "prefixcache" / "rpc" / name).read_bytes()
        assert (tmp_path / name).read_bytes() == committed, f"prefixcache/rpc/{name} is stale: run scripts/gen_proto.sh"
