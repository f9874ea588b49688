"""Keyed frames (`--redis-hmac-key-file`): someone who can write Redis but lacks the key
cannot make the service serve KV it did not write.

Codec level: a keyed round trip is byte-exact; a flipped bit anywhere (header, payload, MAC),
a frame moved to another Redis key, and a reader of the other kind (keyed vs unkeyed) are each a
CorruptBlock. Service level: a real `prefixcache serve` with a real redis-server, where frames an
attacker plants (the right layout, but no key or another key) are counted misses while untampered
blocks come back byte-exact, and a frame MAC'd with the key file's key is served. The key never
shows in the options' repr/str or in the log.
"""

from __future__ import annotations

import logging
import secrets
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache.client import CacheClient
from prefixcache.codec import KEYED_VERSION, MAC_BYTES, VERSION, decode_block, encode_block
from prefixcache.config import DType, KVLayout
from prefixcache.errors import ConfigError, CorruptBlock
from prefixcache.kinds import MissReason
from prefixcache.tiers.redis_options import RedisOptions
from prefixcache_services.cache_server.command import remote_factory_from
from prefixcache_services.cli import build_parser
from tests.support.core import block_hashes
from tests.support.isolation import BLOCK, random_kv, same_bytes, serve
from tests.support.isolation import LAYOUT as SERVICE_LAYOUT
from tests.support.poll import poll
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.process]

NS = "0123456789abcdef"
HASH, PARENT = bytes(range(16)), bytes(range(16, 32))
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=DType.FLOAT16)
TOKENS = np.array([7, 8, 9, 2**32 - 1], dtype="<u4")
PAYLOAD = bytes(range(256)) * (LAYOUT.block_bytes // 256)
KEY, OTHER_KEY = secrets.token_bytes(32), secrets.token_bytes(32)
STORED_AT = f"pfx:{NS}:{HASH.hex()}"


def keyed(key: bytes = KEY, storage_key: str = STORED_AT) -> bytes:
    return encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD, mac_key=key, storage_key=storage_key)


def reason(frame: bytes, key: bytes | None = KEY, storage_key: str = STORED_AT) -> str:
    with pytest.raises(CorruptBlock) as info:
        decode_block(frame, LAYOUT, NS, HASH, PARENT, TOKENS, mac_key=key, storage_key=storage_key)
    return str(info.value)


def flipped(frame: bytes, at: int) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1 :]


# ---- codec ----------------------------------------------------------------------------------------


def test_keyed_round_trip_is_byte_exact_and_zero_copy() -> None:
    frame = keyed()
    assert struct.unpack_from("<H", frame, 4)[0] == KEYED_VERSION
    assert len(frame) == len(encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD)) + MAC_BYTES
    view = decode_block(frame, LAYOUT, NS, HASH, PARENT, TOKENS, mac_key=KEY, storage_key=STORED_AT)
    assert view.tobytes() == PAYLOAD and view.obj is frame


@pytest.mark.parametrize(
    "where",
    [
        "version",
        "header length",
        "namespace id",
        "tokens",
        "checksum",
        "first payload byte",
        "last payload byte",
        "mac",
    ],
)
def test_any_flipped_bit_is_rejected(where: str) -> None:
    frame = keyed()
    payload_start = len(frame) - MAC_BYTES - LAYOUT.block_bytes
    at = {
        "version": 4,
        "header length": 6,
        "namespace id": 13,
        "tokens": payload_start - 17,
        "checksum": payload_start - 1,
        "first payload byte": payload_start,
        "last payload byte": len(frame) - MAC_BYTES - 1,
        "mac": len(frame) - 1,
    }[where]
    assert reason(flipped(frame, at))  # a CorruptBlock (with a reason), whichever check catches it


def test_a_tampered_payload_with_a_recomputed_checksum_fails_the_mac() -> None:
    """What an attacker does: new KV, correct xxh3 checksum, the old MAC (the key is unknown)."""
    frame = keyed()
    forged_payload = bytes(LAYOUT.block_bytes)
    forged = encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, forged_payload, mac_key=OTHER_KEY, storage_key=STORED_AT)
    spliced = forged[:-MAC_BYTES] + frame[-MAC_BYTES:]
    assert "MAC mismatch" in reason(spliced)


def test_a_valid_frame_moved_to_another_redis_key_is_rejected() -> None:
    # Same namespace and block hash (the header matches), another key prefix: only the MAC can tell.
    assert "MAC mismatch" in reason(keyed(), storage_key=f"other:{NS}:{HASH.hex()}")


def test_a_frame_made_with_another_key_is_rejected() -> None:
    assert "MAC mismatch" in reason(keyed(key=OTHER_KEY))


def test_keyed_reader_rejects_unkeyed_frames_and_unkeyed_reader_rejects_keyed_ones() -> None:
    unkeyed = encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD)
    assert struct.unpack_from("<H", unkeyed, 4)[0] == VERSION
    assert "unkeyed frame" in reason(unkeyed)
    # An unkeyed frame with a MAC-sized tail appended is still the wrong kind, not a length puzzle.
    assert "unkeyed frame" in reason(unkeyed + keyed()[-MAC_BYTES:])
    assert "no MAC key" in reason(keyed(), key=None)
    # Relabelled as unkeyed, a keyed frame is 32 bytes too long for the unkeyed layout.
    relabelled = keyed()[:4] + struct.pack("<H", VERSION) + keyed()[6:]
    assert "bytes, expected" in reason(relabelled, key=None)


# ---- options and flags ------------------------------------------------------------------------------


def test_the_key_never_shows_in_the_options_repr_or_str() -> None:
    key = secrets.token_hex(32).encode()
    options = RedisOptions(url="redis://127.0.0.1:1", hmac_key=key)
    assert options.hmac_key == key
    for text in (repr(options), str(options)):
        assert "redis://127.0.0.1:1" in text  # the repr is a real one...
        assert key.decode() not in text and key.decode()[:16] not in text and "hmac_key" not in text


@pytest.mark.parametrize("key", [b"", b"x" * 31, "a" * 64])
def test_a_short_or_non_bytes_key_is_a_config_error_naming_the_field(key) -> None:
    with pytest.raises(ConfigError) as info:
        RedisOptions(url="redis://127.0.0.1:1", hmac_key=key)
    assert info.value.field == "hmac_key" and str(info.value).startswith("hmac_key: must be")


def test_the_key_file_flag_is_checked(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"  " + b"k" * 31 + b"\n\n")  # 31 bytes once whitespace is stripped
    parse = build_parser().parse_args
    with pytest.raises(ConfigError) as info:
        remote_factory_from(parse(["serve", "--redis-hmac-key-file", str(short)]))
    assert info.value.field == "redis_hmac_key_file" and "needs --redis-url" in str(info.value)
    with pytest.raises(ConfigError) as info:
        remote_factory_from(parse(["serve", "--redis-url", "redis://127.0.0.1:1", "--redis-hmac-key-file", str(short)]))
    assert info.value.field == "redis_hmac_key_file" and "got 31" in str(info.value)


# ---- a real service over a real Redis -------------------------------------------------------------


def _spilled(client: CacheClient, server, prompts: list[tuple[list[int], torch.Tensor]]) -> None:
    """Store `prompts` (written through to Redis), then push them out of the 8-slot host tier."""
    for tokens, kv in prompts:
        assert client.store(tokens, kv).stored == kv.shape[0]
    client.store(list(range(90_000, 90_000 + 8 * BLOCK + 1)), random_kv(8, seed=50))
    remote = server.backend.cache.remote_link.tier
    poll(lambda: remote.stats().spills_queued >= 16, 10)
    assert remote.wait_idle(10)
    assert all(client.inspect(tokens).hit_tokens == 0 for tokens, _ in prompts)  # only Redis has them now


def test_a_forged_frame_in_redis_is_not_served_and_a_keyed_one_is(
    private_redis: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = secrets.token_hex(32).encode()
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(b"\n " + key + b"\n")  # whitespace is not part of the key
    flags = (
        "--block-size",
        str(BLOCK),
        "--host-capacity",
        str(8 * SERVICE_LAYOUT.block_bytes),
        "--redis-url",
        private_redis.url,
        "--redis-key-prefix",
        "hm",
        "--redis-timeout-ms",
        "500",
        "--redis-hmac-key-file",
        str(key_file),
    )
    with serve(*flags) as server:
        client = CacheClient(server.address, timeout_s=20)
        try:
            ns = client.attach("m", SERVICE_LAYOUT).namespace_id
            cache = server.backend.cache
            a, b = list(range(1000, 1000 + 4 * BLOCK + 3)), list(range(50_000, 50_000 + 4 * BLOCK + 3))
            kv_a, kv_b = random_kv(4, seed=1), random_kv(4, seed=2)
            _spilled(client, server, [(a, kv_a), (b, kv_b)])
            hashes_a, hashes_b = block_hashes(cache, ns, a), block_hashes(cache, ns, b)
            root = cache.hasher.root(cache.namespace(ns))

            def frame(tokens, hashes, i, payload, **mac) -> bytes:
                parent = hashes[i - 1] if i else root
                block = np.asarray(tokens[i * BLOCK : (i + 1) * BLOCK], dtype="<u4")
                return encode_block(
                    SERVICE_LAYOUT,
                    ns,
                    hashes[i],
                    parent,
                    block,
                    payload.contiguous().view(torch.uint8).numpy().tobytes(),
                    **mac,
                )

            evil = random_kv(1, seed=666)[0]
            with private_redis.client() as raw:
                # An attacker who can write Redis: right layout and binding, but no key / a guessed key.
                raw.set(cache.remote_link.tier.key(ns, hashes_a[2]), frame(a, hashes_a, 2, evil), px=60_000)
                raw.set(
                    cache.remote_link.tier.key(ns, hashes_b[1]),
                    frame(
                        b,
                        hashes_b,
                        1,
                        evil,
                        mac_key=secrets.token_bytes(32),
                        storage_key=cache.remote_link.tier.key(ns, hashes_b[1]),
                    ),
                    px=60_000,
                )
                for tokens, kv, good in ((a, kv_a, 2), (b, kv_b, 1)):
                    failures = client.stats().snapshot.remote["integrity_failures"]
                    hit = client.lookup(tokens)
                    assert hit.hit_tokens == good * BLOCK and hit.miss_reason is MissReason.VERIFICATION_FAILED
                    assert same_bytes(client.read(hit), kv[:good])  # untampered blocks: promoted, byte-exact
                    client.release(hit)
                    assert client.stats().snapshot.remote["integrity_failures"] == failures + 1
                assert cache.remote_link.tier.wait_idle(10)  # the forged keys' UNLINKs have run
                assert raw.exists(cache.remote_link.tier.key(ns, hashes_a[2])) == 0
                # Positive control: a frame MAC'd with the file's (stripped) key is served.
                stored_at = cache.remote_link.tier.key(ns, hashes_a[2])
                raw.set(stored_at, frame(a, hashes_a, 2, kv_a[2], mac_key=key, storage_key=stored_at), px=60_000)
                hit = client.lookup(a)
                assert hit.hit_tokens == 4 * BLOCK and same_bytes(client.read(hit), kv_a)
                client.release(hit)
        finally:
            client.close()
    text = caplog.text
    assert "frames are authenticated" in text  # the log was captured,
    assert "unkeyed frame" in text and "MAC mismatch" in text  # both rejections with it...
    assert key.decode() not in text and key.decode()[:16] not in text  # ...and never holds the key
