"""The block frame codec: byte-exact round trips, and every corruption is a CorruptBlock with a reason."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.codec import MAGIC, VERSION, decode_block, encode_block
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
