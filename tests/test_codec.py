"""The block frame codec: byte-exact round trips, and every corruption is a CorruptBlock with a reason."""

from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.codec import MAGIC, VERSION, decode_block, encode_block, frame_parts
from prefixcache.config import DType, KVLayout
from prefixcache.errors import CorruptBlock, InvalidArgument, LayoutMismatch

pytestmark = pytest.mark.unit

NS = "0123456789abcdef"
HASH = bytes(range(16))
PARENT = bytes(range(16, 32))
OTHER_HASH = bytes(range(100, 116))


def layout_of(dtype: DType) -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def payload_of(layout: KVLayout, seed: int = 0) -> bytes:
    """A block of random bit patterns (NaNs and all, in any format), as raw bytes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()


LAYOUT = layout_of(DType.FLOAT16)
TOKENS = np.array([7, 8, 9, 2**32 - 1], dtype="<u4")
PAYLOAD = payload_of(LAYOUT)
FRAME = encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD)


def decode(
    frame: bytes,
    layout: KVLayout = LAYOUT,
    ns: str = NS,
    block_hash: bytes = HASH,
    parent: bytes = PARENT,
    tokens: np.ndarray = TOKENS,
) -> memoryview:
    return decode_block(frame, layout, ns, block_hash, parent, tokens)


def corrupt_reason(frame: bytes, **expected) -> str:
    with pytest.raises(CorruptBlock) as info:
        decode(frame, **expected)
    return str(info.value)


@pytest.mark.parametrize("dtype", list(DType))
def test_round_trip_is_byte_exact_and_zero_copy(dtype: DType) -> None:
    layout = layout_of(dtype)
    payload = payload_of(layout, seed=3)
    frame = encode_block(layout, NS, HASH, PARENT, TOKENS, memoryview(payload))
    assert frame[:4] == MAGIC and struct.unpack_from("<H", frame, 4)[0] == VERSION
    view = decode_block(frame, layout, NS, HASH, PARENT, TOKENS)
    assert view.nbytes == layout.block_bytes
    assert view.tobytes() == payload
    assert view.obj is frame  # a slice of the frame, not a copy
    restored = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    assert torch.equal(restored, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


@pytest.mark.parametrize("mac_key", [None, bytes(range(32))])
def test_frame_parts_join_into_the_frame_and_leave_the_payload_where_it_lies(mac_key: bytes | None) -> None:
    """What the Redis tier sends from a host slot: the same frame, the payload not copied."""
    slot = bytearray(PAYLOAD)
    keyed = {"mac_key": mac_key, "storage_key": "pfx:ns:00"} if mac_key else {}
    parts = frame_parts(LAYOUT, NS, HASH, PARENT, TOKENS, memoryview(slot), **keyed)
    assert len(parts) == (3 if mac_key else 2)
    assert b"".join(parts) == encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD, **keyed)
    assert parts[1].obj is slot and parts[1].nbytes == LAYOUT.block_bytes  # a view of the slot itself
    slot[0] ^= 0xFF  # so the slot must not change until the frame is sent: a changed one no longer verifies
    with pytest.raises(CorruptBlock):
        decode_block(b"".join(parts), LAYOUT, NS, HASH, PARENT, TOKENS, **keyed)


def test_tokens_given_as_python_ints_encode_like_u32() -> None:
    assert encode_block(LAYOUT, NS, HASH, PARENT, [7, 8, 9, 2**32 - 1], PAYLOAD) == FRAME


def test_flipped_payload_byte_fails_the_checksum() -> None:
    frame = bytearray(FRAME)
    frame[-1] ^= 0x01
    assert "checksum" in corrupt_reason(bytes(frame))


@pytest.mark.parametrize("keep", [0, 3, 9, 40, len(FRAME) - 1])
def test_truncated_frame(keep: int) -> None:
    reason = corrupt_reason(FRAME[:keep])
    assert any(word in reason for word in ("short frame", "frame is", "header length"))


def test_trailing_bytes_are_rejected() -> None:
    assert "frame is" in corrupt_reason(FRAME + b"\x00")


@pytest.mark.parametrize(
    ("expected", "field"),
    [
        ({"block_hash": OTHER_HASH}, "block hash"),
        ({"parent": OTHER_HASH}, "parent hash"),
        ({"ns": "fedcba9876543210"}, "namespace id"),
        ({"tokens": np.array([7, 8, 9, 10], dtype="<u4")}, "tokens"),
        ({"layout": layout_of(DType.BFLOAT16)}, "dtype"),
    ],
)
def test_value_copied_under_another_key_fails_the_binding(expected: dict, field: str) -> None:
    """The frame is valid, but not for the key (and prefix) it was read under."""
    assert field in corrupt_reason(FRAME, **expected)


def test_other_shape_with_the_same_size_is_rejected() -> None:
    swapped = KVLayout(layers=2, kv_heads=8, head_dim=2, block_size=4, dtype=DType.FLOAT16)
    assert swapped.block_bytes == LAYOUT.block_bytes
    assert "shape" in corrupt_reason(FRAME, layout=swapped)


def test_bad_magic() -> None:
    assert "bad magic" in corrupt_reason(b"XXXX" + FRAME[4:])


def test_unknown_version() -> None:
    assert "unknown frame version 2" in corrupt_reason(FRAME[:4] + struct.pack("<H", 2) + FRAME[6:])


@pytest.mark.parametrize("header_len", [0, 1, 0xFFFFFFFF])
def test_absurd_header_length_is_never_trusted(header_len: int) -> None:
    frame = FRAME[:6] + struct.pack("<I", header_len) + FRAME[10:]
    assert "header length" in corrupt_reason(frame)


def test_tampered_payload_length_field() -> None:
    header_len = struct.unpack_from("<I", FRAME, 6)[0]
    offset = 10 + header_len - 16  # payload length u64, then checksum u64
    frame = FRAME[:offset] + struct.pack("<Q", 2**62) + FRAME[offset + 8 :]
    assert "payload length" in corrupt_reason(frame)


class _CreatesFile:
    """Unpickling this calls Path.touch(target): what an attacker's value would do."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def test_pickle_payload_is_rejected_and_never_executed(tmp_path: Path) -> None:
    armed = tmp_path / "armed"
    pickle.loads(pickle.dumps(_CreatesFile(armed)))
    assert armed.exists(), "the payload technique must actually work for this test to mean anything"

    target = tmp_path / "pwned"
    evil = pickle.dumps(_CreatesFile(target))
    assert "bad magic" in corrupt_reason(evil)
    assert "bad magic" in corrupt_reason(evil + bytes(len(FRAME)))
    assert not target.exists()


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(FRAME) - 1), mask=st.integers(1, 255))
def test_any_single_byte_change_is_detected(position: int, mask: int) -> None:
    frame = bytearray(FRAME)
    frame[position] ^= mask
    with pytest.raises(CorruptBlock):
        decode(bytes(frame))


def test_wrong_payload_size_is_a_layout_mismatch() -> None:
    with pytest.raises(LayoutMismatch, match="payload is"):
        encode_block(LAYOUT, NS, HASH, PARENT, TOKENS, PAYLOAD[:-2])


def test_wrong_token_count_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match="tokens"):
        encode_block(LAYOUT, NS, HASH, PARENT, TOKENS[:3], PAYLOAD)
    with pytest.raises(InvalidArgument, match="tokens"):
        encode_block(LAYOUT, NS, HASH, PARENT, [-1, 0, 0, 0], PAYLOAD)


def test_oversized_hash_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match="block_hash"):
        encode_block(LAYOUT, NS, bytes(256), PARENT, TOKENS, PAYLOAD)


# The stored format, pinned: frames as this encoder wrote them on 2026-12-01 (an unkeyed and a keyed
# 16-byte block in full, and the SHA-256 of two 64 KiB frames). A faster encoder must match them.
TINY = KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=2, dtype=DType.FLOAT16)
GOLDEN_TINY = (
    "5046584201005700000002006e73100101010101010101010101010101010110020202020202020202020202020202"
    "020201000000020000000100000002000000020000000200000001000000ffffffff1000000000000000db7017f6a6"
    "e35583000102030405060708090a0b0c0d0e0f"
)
GOLDEN_TINY_MAC = "375d42d07e099c3f7e41c1fe8c1dbf478efe7aaada5c3aaa7194ca84d0d6fa23"
BIG = KVLayout(layers=16, kv_heads=1, head_dim=64, block_size=16, dtype=DType.BFLOAT16)
GOLDEN_BIG_SHA256 = "c05546594340936b2a7119c0de73311c7d5b9e878700893ded1f3b81ad9b4afa"
GOLDEN_BIG_MAC_SHA256 = "6cb296a38fb520a3623c08f033f94b4fce8f3be0655fe1936360e8197670c5e7"


def test_frames_match_the_golden_vectors() -> None:
    tokens = np.array([1, 2**32 - 1], dtype="<u4")
    payload = bytes(range(TINY.block_bytes))
    assert encode_block(TINY, "ns", b"\x01" * 16, b"\x02" * 16, tokens, payload).hex() == GOLDEN_TINY
    keyed = encode_block(
        TINY, "ns", b"\x01" * 16, b"\x02" * 16, tokens, payload, mac_key=bytes(range(32)), storage_key="pfx:ns:01"
    )
    # the keyed frame: the same bytes but the version's keyed flag, then the MAC
    assert keyed.hex() == GOLDEN_TINY.replace("50465842010057", "50465842018057", 1) + GOLDEN_TINY_MAC
    big = (np.arange(BIG.block_bytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    tokens = np.arange(16, dtype="<u4")
    for source in (big.tobytes(), big, big.view(np.uint16), memoryview(big.tobytes())):
        frame = encode_block(BIG, "ns", b"\x03" * 16, b"\x04" * 16, tokens, source)
        assert hashlib.sha256(frame).hexdigest() == GOLDEN_BIG_SHA256
        keyed = encode_block(
            BIG, "ns", b"\x03" * 16, b"\x04" * 16, tokens, source, mac_key=bytes(range(32)), storage_key="k"
        )
        assert hashlib.sha256(keyed).hexdigest() == GOLDEN_BIG_MAC_SHA256
        got = decode_block(
            keyed, BIG, "ns", b"\x03" * 16, b"\x04" * 16, tokens, mac_key=bytes(range(32)), storage_key="k"
        )
        assert bytes(got) == big.tobytes()
