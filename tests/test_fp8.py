"""KV formats end to end: one dtype table, and fp8 blocks stored bit for bit in every tier.

Every format (fp8 included) round trips byte-exact through the frame codec (Hypothesis over
shapes), the host tier and a worker's mapping of it, the device pool code (on the CPU), Redis
frames and a real service's Store/Fetch streams; blocks hold every byte value, so float8 NaN
encodings (e4m3fn 0x7f/0xff, e5m2 0x7d-0x7f/0xfd-0xff) and -0 must survive as bits.
Namespaces that differ only in KV dtype or `kv_scale` never share a block, and a frame of one
format read under another namespace or format is a counted verification failure.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from prefixcache.cache import PrefixCache
from prefixcache.codec import decode_block, encode_block
from prefixcache.config import MODEL_DTYPES, CacheConfig, DType, KVLayout, Namespace
from prefixcache.errors import ConfigError, CorruptBlock, LayoutMismatch
from prefixcache.hashing import Hasher
from prefixcache.kinds import MissReason
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.host import HostTier, MappedSegment
from prefixcache.tiers.redis import RedisOptions, RedisTier
from prefixcache_services.admin.document import stats_document
from prefixcache_services.admin.namespaces_view import namespaces_document, namespaces_view
from prefixcache_services.admin.stats_view import overview_table
from tests.support.core import read_blocks
from tests.support.redis_server import RedisServer
from tests.support.service import BLOCK, CODE, prompt, rpc_code, running_servers, same_bytes, stub_for

pytestmark = [pytest.mark.redis, pytest.mark.process]

FP8 = (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2)
SMALL = dict(layers=2, kv_heads=2, head_dim=8, block_size=4)


def layout_of(dtype: DType, **shape) -> KVLayout:
    return KVLayout(**{**SMALL, **shape}, dtype=dtype)


def every_byte(blocks: int, layout: KVLayout, shift: int = 0) -> torch.Tensor:
    """Blocks cycling through all 256 byte values (each block shifted, so blocks differ)."""
    raw = (np.arange(layout.block_bytes)[None, :] + 7 * np.arange(blocks)[:, None] + shift) % 256
    return torch.from_numpy(raw.astype(np.uint8)).view(layout.dtype.torch).reshape(blocks, *layout.block_shape)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


# ---- the one table ------------------------------------------------------------------------------


def test_the_dtype_table_is_the_proto_enum_the_frame_code_and_torch():
    assert len({dtype.code for dtype in DType}) == len(DType)
    for dtype in DType:
        assert pb.DType.Name(dtype.code) == f"DTYPE_{dtype.name}"  # proto numbers are the codes
        assert DType.from_code(dtype.code) is dtype and DType.parse(str(dtype.torch)) is dtype
        assert dtype.torch.itemsize == dtype.itemsize and dtype.nbytes(10) == 10 * dtype.itemsize
    assert {value for value in pb.DType.values() if value} == {dtype.code for dtype in DType}
    assert (DType.FLOAT8_E4M3FN.torch, DType.FLOAT8_E5M2.torch) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert set(MODEL_DTYPES).isdisjoint(FP8)  # a model computes in these; fp8 is a KV format only
    with pytest.raises(ConfigError, match="dtype"):
        DType.from_code(0)


def test_an_fp8_block_is_half_a_bf16_block_of_the_same_layout():
    bf16, fp8 = layout_of(DType.BFLOAT16), layout_of(DType.FLOAT8_E4M3FN)
    assert bf16.block_shape == fp8.block_shape
    assert (bf16.bytes_per_token, fp8.bytes_per_token) == (2 * 2 * 2 * 8 * 2, 2 * 2 * 2 * 8)
    assert bf16.block_bytes == 2 * fp8.block_bytes == 2 * fp8.bytes_per_token * fp8.block_size


def test_the_core_config_and_codec_stay_torch_free():
    code = (
        "import sys, prefixcache.config, prefixcache.codec, prefixcache.hashing; "
        "from prefixcache.config import DType, KVLayout; KVLayout(1, 1, 1, 1, DType.FLOAT8_E5M2).block_bytes; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- codec ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(DType)),
    layers=st.integers(1, 4),
    kv_heads=st.integers(1, 4),
    head_dim=st.integers(1, 40),
    block_size=st.integers(1, 16),
    seed=st.integers(0, 2**32 - 1),
    other=st.sampled_from(list(DType)),
)
def test_frames_round_trip_every_format_and_shape_and_name_their_format(
    dtype, layers, kv_heads, head_dim, block_size, seed, other
):
    layout = KVLayout(layers, kv_heads, head_dim, block_size, dtype)
    payload = np.random.default_rng(seed).integers(0, 256, layout.block_bytes, dtype=np.uint8).tobytes()
    tokens = np.arange(block_size, dtype="<u4")
    frame = encode_block(layout, "0123456789abcdef", b"h" * 16, b"p" * 16, tokens, payload)
    assert decode_block(frame, layout, "0123456789abcdef", b"h" * 16, b"p" * 16, tokens).tobytes() == payload
    if other is not dtype:  # the same bytes never read as another format
        reread = KVLayout(layers, kv_heads, head_dim, block_size, other)
        with pytest.raises(CorruptBlock) as info:
            decode_block(frame, reread, "0123456789abcdef", b"h" * 16, b"p" * 16, tokens)
        if other.itemsize == dtype.itemsize:
            assert "dtype" in str(info.value)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_nan_and_negative_zero_patterns_survive_a_frame(dtype: DType):
    layout = layout_of(dtype)
    block = every_byte(1, layout)[0]
    frame = encode_block(
        layout, "0123456789abcdef", b"h" * 16, b"p" * 16, np.arange(4, dtype="<u4"), memoryview(raw(block))
    )
    assert frame[: -layout.block_bytes].count(bytes([dtype.code])) >= 1
    out = decode_block(frame, layout, "0123456789abcdef", b"h" * 16, b"p" * 16, np.arange(4, dtype="<u4"))
    decoded = torch.frombuffer(bytearray(out), dtype=dtype.torch).reshape(layout.block_shape)
    assert raw(decoded) == raw(block)
    assert torch.isnan(decoded.float()).any()  # the test really carries NaN encodings


# ---- slot tiers -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DType))
def test_host_tier_mapping_and_device_pool_keep_every_bit(dtype: DType):
    layout = layout_of(dtype)
    blocks = every_byte(4, layout)
    host = HostTier(layout, 8 * layout.block_bytes)
    device = DeviceTier(layout, 8 * layout.block_bytes, device="cpu")
    try:
        mapped = MappedSegment(host.segment_name, layout, host.num_slots)
        try:
            for tier in (host, device):
                assert tier.storage.dtype == dtype.torch
                tier.write_many([5, 1, 6], blocks[:3])
                tier.write(2, blocks[3])
                assert raw(tier.read([5, 1, 6, 2])) == raw(blocks)
                assert tier.read([5]).dtype == dtype.torch and raw(tier.view(2)) == raw(blocks[3])
            host.write_bytes(0, raw(blocks[2]))
            assert raw(mapped.pool.read([5, 1, 6, 2])) == raw(blocks)  # what a co-located worker sees
            assert raw(mapped.pool.view(0)) == raw(blocks[2])
            mapped.pool.write(7, blocks[0])  # and what it writes
            assert raw(host.view(7)) == raw(blocks[0])
        finally:
            mapped.close()
    finally:
        host.close()
        device.close()


def test_a_slot_refuses_another_format_instead_of_reinterpreting_its_bits():
    e4m3, e5m2 = layout_of(DType.FLOAT8_E4M3FN), layout_of(DType.FLOAT8_E5M2)
    device = DeviceTier(e4m3, 2 * e4m3.block_bytes, device="cpu")
    with pytest.raises(LayoutMismatch, match="dtype"):
        device.write(0, every_byte(1, e5m2)[0])
    with pytest.raises(LayoutMismatch, match="dtype"):
        device.write_many([0], every_byte(1, e5m2))


# ---- the cache over host and Redis ------------------------------------------------------------


@contextmanager
def redis_cache(url: str, prefix: str, layout: KVLayout, host_slots: int = 4) -> Iterator[PrefixCache]:
    options = RedisOptions(url=url, key_prefix=prefix, breaker_backoff_min_s=0.05, breaker_backoff_max_s=0.4)
    cache = PrefixCache(
        CacheConfig(host_capacity=host_slots * layout.block_bytes),
        layout,
        HostTier(layout, host_slots * layout.block_bytes),
        remote=RedisTier(options),
    )
    try:
        yield cache
    finally:
        cache.close()


def tokens_for(seed: int, blocks: int, block_size: int = SMALL["block_size"]) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * block_size)]


@pytest.mark.parametrize("dtype", list(DType))
def test_blocks_spilled_to_redis_come_back_bit_for_bit(redis_server: RedisServer, dtype: DType):
    layout = layout_of(dtype)
    with redis_cache(redis_server.url, f"f{secrets.token_hex(4)}", layout) as cache:
        ns = cache.attach(Namespace("m", "r", layout))
        a, b = tokens_for(1, 4), tokens_for(2, 4)
        kv_a, kv_b = every_byte(4, layout), every_byte(4, layout, shift=101)
        assert cache.store(ns, a, kv_a).stored == 4
        assert cache.store(ns, b, kv_b).stored == 4  # a's blocks leave the 4-slot host tier
        assert cache.remote_link.tier.wait_idle(5) and cache.stats().spills.get("host", 0) >= 3
        frames = cache.remote_link.tier.fetch(
            ns, cache.hasher.block_hashes(cache.hasher.root(Namespace("m", "r", layout)), np.asarray(a, dtype="<u4"), 4)
        )
        assert all(frame is not None and bytes(frame).endswith(raw(kv)) for frame, kv in zip(frames, kv_a))
        result = cache.lookup(ns, a)  # promoted back from Redis
        assert result.hit_tokens == 16 and result.miss_reason is None
        assert cache.stats().remote["hits"] >= 3
        assert same_bytes(read_blocks(cache, result.locations), kv_a)


@pytest.mark.parametrize(
    "reader_fields",
    [{"dtype": DType.FLOAT8_E5M2}, {"kv_scale": "k_scale=0.25"}],
    ids=["other fp8 format", "other kv_scale"],
)
def test_a_frame_read_under_another_format_or_scale_is_a_counted_verification_failure(
    redis_server: RedisServer, reader_fields: dict
):
    """Another cache's frame copied under this namespace's key: the header names its format and
    namespace, so it is refused (counted, deleted), never returned as this cache's KV."""
    prefix = f"f{secrets.token_hex(4)}"
    writer_layout = layout_of(DType.FLOAT8_E4M3FN)
    reader_layout = layout_of(reader_fields.get("dtype", DType.FLOAT8_E4M3FN))
    writer_ns = Namespace("m", "r", writer_layout, kv_scale="k_scale=0.5")
    reader_ns = Namespace("m", "r", reader_layout, kv_scale=reader_fields.get("kv_scale", "k_scale=0.5"))
    tokens = tokens_for(3, 3)
    with (
        redis_cache(redis_server.url, prefix, writer_layout) as writer,
        redis_cache(redis_server.url, prefix, reader_layout) as reader,
    ):
        w, r = writer.attach(writer_ns), reader.attach(reader_ns)
        assert w != r
        assert writer.store(w, tokens, every_byte(3, writer_layout)).stored == 3 and writer.remote_link.tier.wait_idle(
            5
        )
        assert reader.lookup(r, tokens).hit_tokens == 0  # different keys: nothing shared
        hasher = Hasher()
        array = np.asarray(tokens, dtype="<u4")
        writer_keys = [writer.remote_link.tier.key(w, h) for h in hasher.block_hashes(hasher.root(writer_ns), array, 4)]
        reader_keys = [reader.remote_link.tier.key(r, h) for h in hasher.block_hashes(hasher.root(reader_ns), array, 4)]
        with redis_server.client() as client:
            for source, target in zip(writer_keys, reader_keys):
                client.set(target, client.get(source), px=60_000)
            result = reader.lookup(r, tokens)
            assert (result.hit_tokens, result.miss_reason) == (0, MissReason.VERIFICATION_FAILED)
            stats = reader.stats()
            assert stats.remote["integrity_failures"] == 1
            assert stats.miss_reasons == {"not_cached": 1, "verification_failed": 1}  # the first look, then this
            assert reader.remote_link.tier.wait_idle(5)
            assert client.exists(reader_keys[0]) == 0 and client.exists(writer_keys[0]) == 1


def test_caches_differing_only_in_kv_dtype_or_scale_share_nothing_through_one_redis(redis_server: RedisServer):
    prefix, tokens = f"f{secrets.token_hex(4)}", tokens_for(4, 3)
    bf16, fp8 = layout_of(DType.BFLOAT16), layout_of(DType.FLOAT8_E4M3FN)
    with (
        redis_cache(redis_server.url, prefix, fp8) as writer,
        redis_cache(redis_server.url, prefix, bf16) as other,
        redis_cache(redis_server.url, prefix, fp8) as reader,
    ):
        scaled = Namespace("m", "r", fp8, kv_scale="k_scale=0.5,v_scale=0.5")
        ns = writer.attach(scaled)
        assert writer.store(ns, tokens, every_byte(3, fp8)).stored == 3 and writer.remote_link.tier.wait_idle(5)
        assert other.lookup(other.attach(Namespace("m", "r", bf16)), tokens).hit_tokens == 0
        for kv_scale in ("", "k_scale=0.5,v_scale=0.25"):
            assert reader.lookup(reader.attach(Namespace("m", "r", fp8, kv_scale=kv_scale)), tokens).hit_tokens == 0
        same = reader.lookup(reader.attach(scaled), tokens)  # the same settings do share
        assert same.hit_tokens == 12 and same_bytes(read_blocks(reader, same.locations), every_byte(3, fp8))
        assert (other.stats().remote["integrity_failures"], reader.stats().remote["integrity_failures"]) == (0, 0)


# ---- a real service ---------------------------------------------------------------------------


def test_a_service_never_shares_blocks_across_kv_dtype_or_scale():
    layout = KVLayout(layers=3, kv_heads=1, head_dim=20, block_size=BLOCK, dtype=DType.FLOAT8_E4M3FN)
    tokens = prompt(5)
    kv = every_byte(5, layout)
    with running_servers() as start:
        server = start()
        writer, stranger, twin = start.client(server), start.client(server), start.client(server)
        ns = writer.attach("m", layout, revision="r", same_host=False, kv_scale="k_scale=0.5").namespace_id
        assert writer.store(tokens, kv).stored == 5  # a Store stream
        other = stranger.attach("m", layout, revision="r", same_host=False, kv_scale="k_scale=0.25").namespace_id
        assert other != ns and stranger.lookup(tokens, take_lease=False).hit_tokens == 0
        assert twin.attach("m", layout, revision="r", same_host=False, kv_scale="k_scale=0.5").namespace_id == ns
        hit = twin.lookup(tokens)
        try:
            assert hit.hit_tokens == 5 * BLOCK and same_bytes(twin.read(hit), kv)  # a Fetch stream
        finally:
            twin.release(hit)
        request = pb.AttachRequest(
            model="m",
            revision="r",
            layout=pb.KVLayout(layers=3, kv_heads=1, head_dim=20, block_size=BLOCK, dtype=DType.BFLOAT16.code),
        )
        bf16 = stub_for(server).Attach(request)  # bf16 beside fp8: a layout of its own in the same tiers
        looked = stub_for(server).Lookup(pb.LookupRequest(namespace_id=bf16.namespace_id, tokens=tokens))
        assert bf16.namespace_id not in (ns, other) and looked.hit_tokens == 0
        header = pb.StoreHeader(
            namespace_id=ns,
            tokens=tokens,
            block_count=1,
            dtype=DType.FLOAT8_E5M2.code,
            block_shape=list(layout.block_shape),
        )
        assert rpc_code(stub_for(server).Store, iter([pb.StoreRequest(header=header)])) == (
            CODE.INVALID_ARGUMENT,
            "header.dtype",
        )
        listed = {entry.namespace_id: entry.kv_scale for entry in writer.namespaces()}
        assert listed == {ns: "k_scale=0.5", other: "k_scale=0.25", bf16.namespace_id: ""}
        doc = stats_document(writer.stats(), server.address)
        assert (doc["layout"]["dtype"], doc["layout"]["bytes_per_token"]) == ("float8_e4m3fn", 2 * 3 * 20)
        names = namespaces_document(server.address, writer.namespaces(), layout.block_bytes)
        assert {entry["kv_scale"] for entry in names["namespaces"]} == {"k_scale=0.5", "k_scale=0.25", ""}
        console = Console(width=240, record=True)
        console.print(overview_table(doc), namespaces_view(names))
        shown = console.export_text()
        assert "(float8_e4m3fn)" in shown and "120 B/token" in shown
        assert "kv scale" in shown and "k_scale=0.25" in shown
        long_scale = pb.AttachRequest(model="m", layout=request.layout, kv_scale="k" * 513)
        assert rpc_code(stub_for(server).Attach, long_scale) == (CODE.INVALID_ARGUMENT, "kv_scale")
