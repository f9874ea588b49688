"""Block hashing: pinned golden vectors across processes, namespace encoding, full blocks only,
and token validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from prefixcache.config import HashAlgorithm, KVLayout, Namespace
from prefixcache.errors import InvalidArgument
from prefixcache.hashing import MAX_TOKEN_ID, Hasher, encode_namespace, namespace_id, token_array

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
NAMESPACE = Namespace("meta-llama/Llama-3.1-8B", "0e9e39f", LAYOUT, tenant="acme", cache_salt="s1")
TOKENS = [(i * 2654435761) % 2**32 for i in range(53)]  # 3 full blocks + 5 tokens that are never hashed
TOKENS[17] = 2**32 - 1
TOKENS[3] = 0

# The typed, length-prefixed namespace encoding; changing it changes every key in every Redis.
GOLDEN_NAMESPACE_ENCODING = (
    "70726566697863616368652d6e730173170000006d6574612d6c6c616d612f4c6c616d612d332e312d3842"
    "730700000030653965333966730800000062666c6f61743136730400000061636d6573020000007331"
    "692000000000000000690800000000000000698000000000000000691000000000000000"
)
GOLDEN = {
    "xxh3_128": {
        "root": "f3461c42755752a1abe921008bf43b63",
        "blocks": [
            "0d9af62751c0bbc8b2b40ff3121bba3a",
            "666548d9d2860b5d91f30727a337a8d2",
            "c1d0111c5b6984ec19440655e8d67db1",
        ],
    },
    "sha256": {
        "root": "03fd619edc91769598476cd8d9e4be669450db67d0ddfefcdf153426fbbcd47c",
        "blocks": [
            "4987d05278d3267522ca9798fb88a2eae88eabe95abee2ff92422ea2d5b3e758",
            "716d8abbf0d8c009a85f1b5e43a0e4d8cae02757f1aa6a2f8111ff0b5f9363e6",
            "3d1469003eda6a380fa5d3836eeafb3672a1564f792a3a84ef0866006ceb8da4",
        ],
    },
}

_CHILD = """
import json
from prefixcache.config import HashAlgorithm, KVLayout, Namespace
from prefixcache.hashing import Hasher, token_array
layout = KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
namespace = Namespace("meta-llama/Llama-3.1-8B", "0e9e39f", layout, tenant="acme", cache_salt="s1")
tokens = json.loads(%r)
out = {}
for algorithm in HashAlgorithm:
    hasher = Hasher(algorithm)
    root = hasher.root(namespace)
    out[algorithm.value] = {"root": root.hex(),
                            "blocks": [h.hex() for h in hasher.block_hashes(root, token_array(tokens), 16)]}
print(json.dumps(out))
"""


def hashes_of(algorithm: HashAlgorithm, namespace: Namespace = NAMESPACE, tokens=TOKENS) -> list[str]:
    hasher = Hasher(algorithm)
    root = hasher.root(namespace)
    return [root.hex()] + [h.hex() for h in hasher.block_hashes(root, token_array(tokens), 16)]


def test_namespace_encoding_is_pinned() -> None:
    assert encode_namespace(NAMESPACE).hex() == GOLDEN_NAMESPACE_ENCODING


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_golden_vectors_in_this_process(algorithm: HashAlgorithm) -> None:
    golden = GOLDEN[algorithm.value]
    assert hashes_of(algorithm) == [golden["root"], *golden["blocks"]]


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_golden_vectors_follow_the_documented_chain(algorithm: HashAlgorithm) -> None:
    """h_0 = H(namespace), h_i = H(h_{i-1} || block as little-endian u32), recomputed by hand."""
    digest = (
        xxhash.xxh3_128_digest if algorithm is HashAlgorithm.XXH3_128 else (lambda data: hashlib.sha256(data).digest())
    )
    chain = [digest(encode_namespace(NAMESPACE))]
    for i in range(len(TOKENS) // 16):
        chain.append(digest(chain[-1] + struct.pack("<16I", *TOKENS[16 * i : 16 * (i + 1)])))
    golden = GOLDEN[algorithm.value]
    assert [h.hex() for h in chain] == [golden["root"], *golden["blocks"]]


@pytest.mark.parametrize("seed", ["0", "1", "random"])
def test_golden_vectors_across_processes_and_hash_seeds(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD % json.dumps(TOKENS)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == GOLDEN


@pytest.mark.parametrize(
    "first, second",
    [
        (("org_1", "2345"), ("org_12345", "")),
        (("a", "bc"), ("ab", "c")),
        (("ab", ""), ("a", "b")),
    ],
)
def test_adjacent_fields_never_encode_alike(first: tuple[str, str], second: tuple[str, str]) -> None:
    """Concatenating two fields the same way must not give the same namespace."""
    as_model = [Namespace(model, revision, LAYOUT) for model, revision in (first, second)]
    as_tenant = [Namespace("m", "", LAYOUT, tenant=tenant, cache_salt=salt) for tenant, salt in (first, second)]
    for a, b in (as_model, as_tenant):
        assert encode_namespace(a) != encode_namespace(b)
        assert Hasher().root(a) != Hasher().root(b)
    assert len({encode_namespace(ns) for ns in as_model + as_tenant}) == 4
    as_salt = [Namespace("m", "", LAYOUT, cache_salt=salt, kv_scale=scale) for salt, scale in (first, second)]
    assert encode_namespace(as_salt[0]) != encode_namespace(as_salt[1])


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "other"},
        {"tenant": "t2"},
        {"cache_salt": "s2"},
        {"layout": dataclasses.replace(LAYOUT, dtype="float16")},
        {"layout": dataclasses.replace(LAYOUT, dtype="float8_e4m3fn")},
        {"layout": dataclasses.replace(LAYOUT, dtype="float8_e5m2")},
        {"kv_scale": "k_scale=0.5,v_scale=0.5"},
        {"layout": dataclasses.replace(LAYOUT, layers=31)},
        {"layout": dataclasses.replace(LAYOUT, kv_heads=4)},
        {"layout": dataclasses.replace(LAYOUT, head_dim=64)},
        {"layout": dataclasses.replace(LAYOUT, block_size=32)},
    ],
)
def test_every_namespace_field_changes_the_root(change: dict) -> None:
    other = dataclasses.replace(NAMESPACE, **change)
    assert Hasher().root(other) != Hasher().root(NAMESPACE)
    assert namespace_id(Hasher().root(other)) != namespace_id(Hasher().root(NAMESPACE))


def test_only_full_blocks_are_hashed_and_chains_share_prefixes() -> None:
    hasher = Hasher()
    root = hasher.root(NAMESPACE)
    full = hasher.block_hashes(root, token_array(TOKENS), 16)
    assert len(full) == 3
    assert hasher.block_hashes(root, token_array(TOKENS[:47]), 16) == full[:2]
    assert hasher.block_hashes(root, token_array(TOKENS[:15]), 16) == []
    assert hasher.block_hashes(root, token_array([]), 16) == []
    tail_changed = TOKENS[:48] + [1, 2, 3, 4, 5]
    assert hasher.block_hashes(root, token_array(tail_changed), 16) == full
    early_changed = [TOKENS[0] ^ 1] + TOKENS[1:]
    assert all(a != b for a, b in zip(hasher.block_hashes(root, token_array(early_changed), 16), full))


def test_digest_sizes() -> None:
    assert Hasher(HashAlgorithm.XXH3_128).digest_size == 16
    assert Hasher(HashAlgorithm.SHA256).digest_size == 32


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [0, MAX_TOKEN_ID + 1],
        [2**64],
        [1.5],
        [1.0],
        ["7"],
        [[1, 2]],
        "1234",
        b"\x01\x02",
        np.array([1.5, 2.0]),
        np.array([-3, 4]),
        np.array([2**32], dtype=np.int64),
        np.array([True, False]),
        np.zeros((2, 2), dtype=np.int64),
        torch.tensor([0.5]),
        [None],
    ],
)
def test_bad_tokens_raise_invalid_argument_naming_tokens(tokens) -> None:
    with pytest.raises(InvalidArgument) as caught:
        token_array(tokens)
    assert caught.value.field == "tokens"
    assert str(caught.value).startswith("tokens:")


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, MAX_TOKEN_ID],
        (5, 6),
        np.array([0, MAX_TOKEN_ID], dtype=np.int64),
        np.array([3, 4], dtype=np.uint32),
        np.array([3, 4], dtype=">u4"),
        torch.tensor([9, 10]),
        [np.int64(7), np.uint32(8)],
    ],
)
def test_good_tokens_become_little_endian_u32(tokens) -> None:
    array = token_array(tokens)
    assert array.dtype == np.dtype("<u4") and array.ndim == 1
    assert array.tolist() == [int(t) for t in tokens]


def test_empty_tokens_are_an_empty_array() -> None:
    for empty in ([], (), np.array([], dtype=np.float64), torch.tensor([])):
        assert token_array(empty).shape == (0,)
