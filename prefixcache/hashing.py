"""Block hashes: chained digests of fixed-size token blocks.

`h_0 = H(encode(namespace))`, `h_i = H(h_{i-1} || tokens of block i as little-endian u32)`.
A block hash therefore names the namespace and the whole prefix up to and including
its block. Only full blocks are hashed; a trailing partial block never is.

Invariants:
- Deterministic across processes, hosts and runs (no use of Python's `hash`).
- The namespace encoding is typed and length-prefixed, so no two different
  namespaces encode alike (("org_1", "2345") differs from ("org_12345", "")).
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import NewType, cast

import numpy as np

from .config import HashAlgorithm, Namespace
from .errors import InvalidArgument
from .native import core

BlockHash = NewType("BlockHash", bytes)
Tokens = Sequence[int] | np.ndarray  # token ids as callers pass them (see `token_array`)
"""Digest naming a prefix (16 bytes for xxh3_128, 32 for sha256)."""

_NAMESPACE_MAGIC = b"prefixcache-ns\x01"
MAX_TOKEN_ID = 2**32 - 1
_U32 = np.dtype("<u4")
_ARRAY_U32 = "I" if array.array("I").itemsize == 4 else "L"  # the C type that is 32 bits here


def encode_namespace(namespace: Namespace) -> bytes:
    """Typed, length-prefixed encoding of every field that makes KV incompatible."""
    head, tail = salt_gap(namespace)
    return head + _text(namespace.cache_salt) + tail


def salt_gap(namespace: Namespace) -> tuple[bytes, bytes]:
    """`encode_namespace(namespace)` around its salt: a sibling salted `s` encodes as head +
    `_text(s)` + tail (`Hasher.salted_root`), so a reader given the two hashes salted prompts."""
    layout = namespace.layout
    head = _NAMESPACE_MAGIC + b"".join(
        _text(text) for text in (namespace.model, namespace.revision, layout.dtype.value, namespace.tenant)
    )
    tail = [
        b"i" + struct.pack("<Q", number)
        for number in (layout.layers, layout.kv_heads, layout.head_dim, layout.block_size)
    ]
    if namespace.kv_scale:
        # Appended only when set (its own tag), so namespaces without one keep their ids
        # and the Redis keys written before the field existed.
        raw = namespace.kv_scale.encode("utf-8")
        tail.append(b"q" + struct.pack("<I", len(raw)) + raw)
    return head, b"".join(tail)


def _text(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"s" + struct.pack("<I", len(raw)) + raw


def token_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a C-contiguous little-endian u32 array; raises InvalidArgument("tokens") for anything else.

    Accepted: a sequence of Python ints (converted through `array.array`,
    ~3x faster than numpy for lists) or a 1-d integer array/tensor. Floats,
    strings, bools arrays and ids outside [0, 2^32) are rejected, never truncated.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == _U32 and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument("tokens", f"expected a list of token ids, got {type(tokens).__name__}")
    if isinstance(tokens, (list, tuple)):
        try:
            return np.frombuffer(array.array(_ARRAY_U32, tokens), dtype=np.uint32).astype(_U32, copy=False)
        except OverflowError:
            raise InvalidArgument("tokens", "token ids must be integers in [0, 2^32)") from None
        except TypeError as error:  # a float, string or nested list among the ids
            raise InvalidArgument("tokens", f"token ids must be integers in [0, 2^32) ({error})") from None
    try:
        array_in = np.asarray(tokens)
    except (ValueError, TypeError) as error:
        raise InvalidArgument("tokens", f"cannot read token ids ({error})") from None
    if array_in.ndim != 1:
        raise InvalidArgument("tokens", f"expected a flat list of token ids, got shape {array_in.shape}")
    if array_in.size == 0:
        return np.empty(0, dtype=_U32)
    if array_in.dtype.kind not in "iu":
        raise InvalidArgument("tokens", f"token ids must be integers in [0, 2^32), got {array_in.dtype} values")
    if array_in.min() < 0 or array_in.max() > MAX_TOKEN_ID:
        raise InvalidArgument("tokens", "token ids must be integers in [0, 2^32)")
    return array_in.astype(_U32)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class Hasher:
    """Computes root and chained block hashes with one algorithm.

    xxh3_128 (the default) is the compiled core's (prefixcache/_core.c): one C call hashes a
    whole prompt. SHA-256, and a subclass that brings its own `digest` (tests force collisions
    with one), chain through `digest` block by block.
    """

    def __init__(self, algorithm: HashAlgorithm = HashAlgorithm.XXH3_128) -> None:
        self.algorithm = algorithm
        self._compiled = algorithm is HashAlgorithm.XXH3_128
        self._digest: Callable[[bytes], bytes] = core.xxh3_128 if self._compiled else _sha256

    def digest(self, data: bytes) -> BlockHash:
        return BlockHash(self._digest(data))

    @property
    def digest_size(self) -> int:
        """Bytes per block hash (the index sizes its hash table by it)."""
        return len(self.digest(b""))

    def root(self, namespace: Namespace) -> BlockHash:
        return self.digest(encode_namespace(namespace))

    def salted_root(self, gap: tuple[bytes, bytes], salt: str) -> BlockHash:
        """The root of the namespace salted `salt` whose encoding has `gap` (`salt_gap`)."""
        return self.digest(gap[0] + _text(salt) + gap[1])

    def block_hashes(self, root: BlockHash, tokens: np.ndarray, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of `tokens` (a C-contiguous u32 array from `token_array`)."""
        if type(self).digest is Hasher.digest:
            if self._compiled:
                return cast(list[BlockHash], core.xxh3_chain(root, tokens, block_size))
            digest: Callable[[bytes], bytes] = self._digest  # the raw function skips a frame per block
        else:
            digest = self.digest  # a subclass's own
        raw = tokens.tobytes()
        stride = block_size * 4
        hashes: list[bytes] = []
        parent: bytes = root
        for start in range(0, (len(tokens) // block_size) * stride, stride):
            parent = digest(parent + raw[start : start + stride])
            hashes.append(parent)
        return cast(list[BlockHash], hashes)  # one cast, not a NewType call per block


def namespace_id(root: BlockHash) -> str:
    """Short printable id of a namespace (first 16 hex digits of its root hash)."""
    return root.hex()[:16]
