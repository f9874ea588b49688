"""Synthetic KV for the cache-only load test: model-size presets and deterministic block bytes.

Owns: the `ModelPreset`s (KV geometry of a few well-known models) and `SyntheticKV`, which
makes the bytes of a prompt's blocks from its token ids alone, so a hit can be checked byte
for byte without a model.

Invariants of `SyntheticKV.blocks(tokens, start, count)`:
- deterministic: the same tokens give the same bytes, in any process;
- block i depends on ALL tokens of blocks 0..i (a streaming xxh3_64 over the prefix seeds
  it), like real KV under causal attention: two prompts share block i's bytes exactly when
  they share the prefix through block i;
- a block is a seeded random tile of `TILE_BYTES` bytes repeated; the tile length is prime so
  a block copied with any offset that is not a multiple of it, a block from another prefix,
  or a torn copy compares unequal.
The bytes are raw bit patterns in the preset's dtype (some are NaN as floats); only their
bytes matter, so compare with `equal_blocks`, never with float comparisons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
import xxhash

from prefixcache.config import DType, KVLayout

TILE_BYTES = 4093  # prime: see module invariants


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV geometry: what one cached token costs."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    note: str = ""

    def layout(self, block_size: int = 16) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, block_size, self.dtype)


PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {
        p.name: p
        for p in (
            ModelPreset("tiny", 4, 2, 32, note="the worker's built-in model: 1 KiB/token"),
            ModelPreset("qwen2.5-0.5b", 24, 2, 64, note="12 KiB/token"),
            ModelPreset("llama3-8b", 32, 8, 128, note="128 KiB/token, 2 MiB per 16-token block"),
            ModelPreset("llama3-70b", 80, 8, 128, note="320 KiB/token, 5 MiB per 16-token block"),
        )
    }
)


def preset(name: str) -> ModelPreset:
    """The preset called `name`; a ValueError lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r} (one of: {', '.join(PRESETS)})") from None


class SyntheticKV:
    """Deterministic block bytes for one layout (see module invariants). Stateless: thread-safe."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._dtype = layout.dtype.torch
        self._reps = -(-layout.block_bytes // TILE_BYTES)  # ceil

    def seeds(self, tokens: Sequence[int], count: int) -> list[int]:
        """Seeds of blocks 0..count-1: xxh3_64 of the token ids of the prefix through each."""
        size = self.layout.block_size
        ids = np.asarray(tokens[: count * size], dtype="<u4")
        if len(ids) < count * size:
            raise ValueError(f"{len(tokens)} tokens hold fewer than {count} full blocks of {size}")
        hasher = xxhash.xxh3_64()
        seeds = []
        for i in range(count):
            hasher.update(ids[i * size : (i + 1) * size].tobytes())
            seeds.append(hasher.intdigest())
        return seeds

    def _block(self, seed: int) -> np.ndarray:
        tile = np.random.default_rng(seed).integers(0, 256, TILE_BYTES, dtype=np.uint8)
        return np.tile(tile, self._reps)[: self.layout.block_bytes]

    def blocks(self, tokens: Sequence[int], start: int, count: int) -> torch.Tensor:
        """Blocks `start .. start+count-1` of `tokens`, `[count, *block_shape]` in the layout's dtype."""
        seeds = self.seeds(tokens, start + count)[start:]
        raw = np.empty((count, self.layout.block_bytes), dtype=np.uint8)
        for row, seed in enumerate(seeds):
            raw[row] = self._block(seed)
        return torch.from_numpy(raw).view(self._dtype).reshape(count, *self.layout.block_shape)


def equal_blocks(actual: torch.Tensor, expected: torch.Tensor) -> list[bool]:
    """Per block: are the bytes identical?"""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.contiguous().view(torch.uint8).reshape(len(actual), -1)
    b = expected.contiguous().view(torch.uint8).reshape(len(expected), -1)
    return (a == b).all(dim=1).tolist()
