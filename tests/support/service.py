"""Helpers of tests/test_service.py: servers on loopback, random KV, and the request tables.

`running_servers` makes real servers (and clients) that are all stopped at
the end; MATRIX lists malformed requests with the method, the status code and
field each must produce; FUZZ_METHODS gives one valid request per method for
the fuzzer to mutate.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixcache.client import CacheClient
from prefixcache.config import CacheConfig, DType, KVLayout
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.rpc import cache_pb2_grpc as pb_grpc
from prefixcache_services.cache_server.auth import Authenticator
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from prefixcache_services.cache_server.servicer import SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
DTYPES = tuple(dtype.value for dtype in DType)  # every format the cache stores, fp8 included
BLOCK = 16
CACHE_FIELDS = {
    "ttl_s",
    "lease_ttl_s",
    "max_prompt_tokens",
    "max_leases",
    "chunk_bytes",
    "min_block_bytes",
    "tenant_quotas",
}
CODE = grpc.StatusCode


def layout_of(dtype: str = "float16") -> KVLayout:
    # 3 layers x 20 head_dim: a block (3840 bytes in fp16) never divides a 4 KiB chunk evenly.
    return KVLayout(layers=3, kv_heads=1, head_dim=20, block_size=BLOCK, dtype=dtype)


def random_kv(blocks: int, layout: KVLayout, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and all) so that only a byte-exact copy compares equal."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (blocks, layout.block_bytes), dtype=torch.uint8, generator=generator)
    return bits.view(layout.dtype.torch).reshape(blocks, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def prompt(blocks: int, start: int = 1000, extra: int = 5) -> list[int]:
    return list(range(start, start + blocks * BLOCK + extra))


@contextlib.contextmanager
def running_servers() -> Iterator:
    """A factory of started servers (`make(**options)`, `make.client(server)`), all stopped on exit;
    `listen` names the address (default: any free port), e.g. a stopped server's, to restart it."""
    servers, clients = [], []

    def make_server(
        host_capacity: str | int = "4MiB",
        authenticator: Authenticator | None = None,
        listen: str = "127.0.0.1:0",
        **kwargs,
    ):
        cache_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key in CACHE_FIELDS}
        backend = BackendOptions(cache=CacheConfig(host_capacity=host_capacity, **cache_kwargs), block_size=BLOCK)
        options = ServerOptions(
            backend=backend, listen=listen, authenticator=authenticator or Authenticator.open(), **kwargs
        )
        server = build_server(options)
        servers.append(server)
        return server

    def make_client(server, **kwargs) -> CacheClient:
        client = CacheClient(server.address, timeout_s=10, **kwargs)
        clients.append(client)
        return client

    make_server.client = make_client
    try:
        yield make_server
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.shutdown(0)


def stub_for(server) -> pb_grpc.PrefixCacheStub:
    return pb_grpc.PrefixCacheStub(grpc.insecure_channel(server.address))


def rpc_code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str | None]:
    """(status code, `prefixcache-field` metadata) of a call that is expected to fail."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            for _ in result:
                pass
    except grpc.RpcError as error:
        field = dict(error.trailing_metadata() or ()).get("prefixcache-field")
        return error.code(), field
    return CODE.OK, None


def health_status(channel, service: str = SERVICE_NAME) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


# -- malformed requests: (code, field, call(stub, namespace id)) ----------------------------
def _layout_msg(**overrides) -> pb.KVLayout:
    fields = dict(layers=3, kv_heads=1, head_dim=20, block_size=BLOCK, dtype=pb.DTYPE_FLOAT16)
    fields.update(overrides)
    return pb.KVLayout(**fields)


def _store(stub, ns, *messages):
    return stub.Store(iter(messages))


def _reserve(stub, ns) -> int:
    return stub.Reserve(pb.ReserveRequest(namespace_id=ns, block_count=1)).reservation_id


def store_header(ns, **overrides) -> pb.StoreRequest:
    fields = dict(
        namespace_id=ns,
        tokens=prompt(2),
        block_count=2,
        dtype=pb.DTYPE_FLOAT16,
        block_shape=list(layout_of().block_shape),
    )
    fields.update(overrides)
    return pb.StoreRequest(header=pb.StoreHeader(**fields))


BLOCK_BYTES = layout_of().block_bytes
MATRIX = {
    "negative token": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "tokens",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, tokens=[1, -1])),
    ),
    "token >= 2^32": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "tokens",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, tokens=[2**32])),
    ),
    "too many tokens": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "tokens",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, tokens=[1] * 5000)),
    ),
    "unknown namespace": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id="0123456789abcdef")),
    ),
    "malformed namespace": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id="../x")),
    ),
    "empty salt": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "cache_salt",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, cache_salt="")),
    ),
    "long salt": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "cache_salt",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, cache_salt="s" * 129)),
    ),
    "unprintable salt": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "cache_salt",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, cache_salt="a\x00b")),
    ),
    "block size not a multiple": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "layout.block_size",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(block_size=24))),
    ),
    "block size too large": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "layout.block_size",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(block_size=65536 + BLOCK))),
    ),
    "lookup block size not a multiple": (
        "Lookup",
        CODE.INVALID_ARGUMENT,
        "block_size",
        lambda s, ns: s.Lookup(pb.LookupRequest(namespace_id=ns, tokens=[1] * 64, block_size=40)),
    ),
    "no dtype": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "layout.dtype",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(dtype=0))),
    ),
    "unknown dtype enum": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "layout.dtype",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(dtype=99))),
    ),
    "zero layers": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "layout.layers",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(layers=0))),
    ),
    "no model": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "model",
        lambda s, ns: s.Attach(pb.AttachRequest(layout=_layout_msg())),
    ),
    "no layout": ("Attach", CODE.INVALID_ARGUMENT, "layout", lambda s, ns: s.Attach(pb.AttachRequest(model="m"))),
    "salt on attach": (
        "Attach",
        CODE.INVALID_ARGUMENT,
        "cache_salt",
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(), cache_salt="\n")),
    ),
    "layout larger than a chunk": (  # another layout joins the tiers, but its block must fit a chunk
        "Attach",
        CODE.FAILED_PRECONDITION,
        None,
        lambda s, ns: s.Attach(pb.AttachRequest(model="m", layout=_layout_msg(layers=512, head_dim=512))),
    ),
    "fetch without lease": ("Fetch", CODE.INVALID_ARGUMENT, "lease_id", lambda s, ns: s.Fetch(pb.FetchRequest())),
    "fetch unknown lease": (
        "Fetch",
        CODE.NOT_FOUND,
        "lease_id",
        lambda s, ns: s.Fetch(pb.FetchRequest(lease_id=12345)),
    ),
    "fetch tiny chunks": (
        "Fetch",
        CODE.INVALID_ARGUMENT,
        "max_chunk_bytes",
        lambda s, ns: s.Fetch(pb.FetchRequest(lease_id=1, max_chunk_bytes=100)),
    ),
    "release unknown lease": (
        "Release",
        CODE.NOT_FOUND,
        "lease_id",
        lambda s, ns: s.Release(pb.ReleaseRequest(lease_id=2**64 - 1)),
    ),
    "reserve nothing": (
        "Reserve",
        CODE.INVALID_ARGUMENT,
        "block_count",
        lambda s, ns: s.Reserve(pb.ReserveRequest(namespace_id=ns)),
    ),
    "reserve too much": (
        "Reserve",
        CODE.RESOURCE_EXHAUSTED,
        "block_count",
        lambda s, ns: s.Reserve(pb.ReserveRequest(namespace_id=ns, block_count=2**32 - 1)),
    ),
    "commit no reservation": (
        "Commit",
        CODE.INVALID_ARGUMENT,
        "reservation_id",
        lambda s, ns: s.Commit(pb.CommitRequest(namespace_id=ns, tokens=prompt(1))),
    ),
    "commit unknown reservation": (
        "Commit",
        CODE.INVALID_ARGUMENT,
        "reservation_id",
        lambda s, ns: s.Commit(pb.CommitRequest(namespace_id=ns, tokens=prompt(1), reservation_id=7)),
    ),
    "commit past the prompt": (
        "Commit",
        CODE.INVALID_ARGUMENT,
        "start_block",
        lambda s, ns: s.Commit(
            pb.CommitRequest(namespace_id=ns, tokens=prompt(1), start_block=3, reservation_id=_reserve(s, ns))
        ),
    ),
    "store empty stream": ("Store", CODE.INVALID_ARGUMENT, "header", lambda s, ns: _store(s, ns)),
    "store data first": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header",
        lambda s, ns: _store(s, ns, pb.StoreRequest(data=b"x")),
    ),
    "store wrong dtype": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header.dtype",
        lambda s, ns: _store(s, ns, store_header(ns, dtype=pb.DTYPE_BFLOAT16)),
    ),
    "store wrong shape": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header.block_shape",
        lambda s, ns: _store(s, ns, store_header(ns, block_shape=[3, 2, 1, 16, 21])),
    ),
    "store too few bytes": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "data",
        lambda s, ns: _store(s, ns, store_header(ns), pb.StoreRequest(data=b"x" * BLOCK_BYTES)),
    ),
    "store too many bytes": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "data",
        lambda s, ns: _store(s, ns, store_header(ns), pb.StoreRequest(data=b"x" * (2 * BLOCK_BYTES + 1))),
    ),
    "store two headers": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header",
        lambda s, ns: _store(s, ns, store_header(ns), store_header(ns)),
    ),
    "store too large": (
        "Store",
        CODE.RESOURCE_EXHAUSTED,
        "header.block_count",
        lambda s, ns: _store(s, ns, store_header(ns, block_count=2**32 - 1)),
    ),
    "store bad salt": (  # issue 33: named as every other Store header field is
        "Store",
        CODE.INVALID_ARGUMENT,
        "header.cache_salt",
        lambda s, ns: _store(s, ns, store_header(ns, cache_salt="\n")),
    ),
    "store bad tokens": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header.tokens",
        lambda s, ns: _store(s, ns, store_header(ns, tokens=[-5])),
    ),
    "evict nothing": ("Evict", CODE.INVALID_ARGUMENT, "request", lambda s, ns: s.Evict(pb.EvictRequest())),
    "evict NaN age": (
        "Evict",
        CODE.INVALID_ARGUMENT,
        "older_than_seconds",
        lambda s, ns: s.Evict(pb.EvictRequest(older_than_seconds=math.nan)),
    ),
    "evict negative age": (
        "Evict",
        CODE.INVALID_ARGUMENT,
        "older_than_seconds",
        lambda s, ns: s.Evict(pb.EvictRequest(older_than_seconds=-1)),
    ),
    "evict prefix without namespace": (
        "Evict",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Evict(pb.EvictRequest(prefix=pb.TokenPrefix(tokens=[1]))),
    ),
    "evict bad prefix": (
        "Evict",
        CODE.INVALID_ARGUMENT,
        "prefix.tokens",
        lambda s, ns: s.Evict(pb.EvictRequest(namespace_id=ns, prefix=pb.TokenPrefix(tokens=[-1]))),
    ),
    "reserve unknown namespace": (
        "Reserve",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Reserve(pb.ReserveRequest(namespace_id="0123456789abcdef", block_count=1)),
    ),
    "reserve 10^9 blocks": (
        "Reserve",
        CODE.RESOURCE_EXHAUSTED,
        "block_count",
        lambda s, ns: s.Reserve(pb.ReserveRequest(namespace_id=ns, block_count=10**9)),
    ),
    "commit unknown namespace": (
        "Commit",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Commit(pb.CommitRequest(namespace_id="0123456789abcdef", tokens=prompt(1), reservation_id=1)),
    ),
    "store unknown namespace": (
        "Store",
        CODE.INVALID_ARGUMENT,
        "header.namespace_id",
        lambda s, ns: _store(s, ns, store_header("0123456789abcdef")),
    ),
    "inspect unknown namespace": (
        "Inspect",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Inspect(pb.InspectRequest(namespace_id="0123456789abcdef", tokens=prompt(1))),
    ),
    "evict unknown namespace": (
        "Evict",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Evict(pb.EvictRequest(namespace_id="0123456789abcdef")),
    ),
    "match unknown namespace": (
        "Match",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Match(pb.MatchRequest(namespace_id="0123456789abcdef", tokens=prompt(1))),
    ),
    "match bad tokens": (
        "Match",
        CODE.INVALID_ARGUMENT,
        "tokens",
        lambda s, ns: s.Match(pb.MatchRequest(namespace_id=ns, tokens=[-1])),
    ),
    "pin unknown namespace": (
        "Pin",
        CODE.INVALID_ARGUMENT,
        "namespace_id",
        lambda s, ns: s.Pin(pb.PinRequest(namespace_id="0123456789abcdef", prefix=pb.TokenPrefix(tokens=prompt(1)))),
    ),
    "pin negative ttl": (
        "Pin",
        CODE.INVALID_ARGUMENT,
        "ttl_seconds",
        lambda s, ns: s.Pin(pb.PinRequest(namespace_id=ns, prefix=pb.TokenPrefix(tokens=prompt(1)), ttl_seconds=-1)),
    ),
    "unpin no id": ("Unpin", CODE.INVALID_ARGUMENT, "pin_id", lambda s, ns: s.Unpin(pb.UnpinRequest())),
    "unpin unknown id": ("Unpin", CODE.INVALID_ARGUMENT, "pin_id", lambda s, ns: s.Unpin(pb.UnpinRequest(pin_id=7))),
    "inspect bad tokens": (
        "Inspect",
        CODE.INVALID_ARGUMENT,
        "tokens",
        lambda s, ns: s.Inspect(pb.InspectRequest(namespace_id=ns, tokens=[2**40])),
    ),
}


# -- fuzzing: one valid request per method ----------------------------------------------
FUZZ_METHODS = {
    "Attach": (
        "unary",
        pb.AttachRequest(model="m", revision="r", layout=_layout_msg(), cache_salt="s", same_host=True),
    ),
    "Lookup": ("unary", pb.LookupRequest(namespace_id="0" * 16, tokens=prompt(3), cache_salt="s", take_lease=True)),
    "Reserve": ("unary", pb.ReserveRequest(namespace_id="0" * 16, block_count=2)),
    "Commit": ("unary", pb.CommitRequest(namespace_id="0" * 16, tokens=prompt(2), reservation_id=9, start_block=1)),
    "Release": ("unary", pb.ReleaseRequest(lease_id=99)),
    "GetStats": ("unary", pb.GetStatsRequest()),
    "Inspect": ("unary", pb.InspectRequest(namespace_id="0" * 16, tokens=prompt(2))),
    "Match": ("unary", pb.MatchRequest(namespace_id="0" * 16, tokens=prompt(2), cache_salt="s")),
    "Evict": ("unary", pb.EvictRequest(namespace_id="0" * 16, older_than_seconds=5, prefix=pb.TokenPrefix(tokens=[1]))),
    "Flush": ("unary", pb.FlushRequest()),
    "ListNamespaces": ("unary", pb.ListNamespacesRequest()),
    "Pin": ("unary", pb.PinRequest(namespace_id="0" * 16, prefix=pb.TokenPrefix(tokens=prompt(2)), ttl_seconds=60)),
    "Unpin": ("unary", pb.UnpinRequest(pin_id=99)),
    "ListPins": ("unary", pb.ListPinsRequest()),
    "Fetch": ("stream_out", pb.FetchRequest(lease_id=5, max_chunk_bytes=8192)),
    "Store": ("stream_in", store_header("0" * 16)),
}


def fuzz_inputs(rng: random.Random, valid: bytes) -> list[bytes]:
    inputs = [rng.randbytes(rng.randrange(0, 64)) for _ in range(25)]
    inputs += [valid[:cut] for cut in range(0, len(valid), max(1, len(valid) // 12))]
    flipped = bytearray(valid)
    for _ in range(10):
        position = rng.randrange(len(flipped)) if flipped else 0
        if flipped:
            flipped[position] ^= 1 << rng.randrange(8)
        inputs.append(bytes(flipped))
    return inputs
