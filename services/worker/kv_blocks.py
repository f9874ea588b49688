"""The KV block layout contract, and conversion between blocks and a transformers cache.

Owns `KVLayout` and the two copies between the cache service's blocks and the model's
`DynamicCache`.

Layout (fixed by the cache service; do not change):
- one block: `[layers, 2, kv_heads, block_size, head_dim]` in the model dtype; index 0 of
  dim 1 holds keys, index 1 values; block i covers prompt tokens
  `[i * block_size, (i + 1) * block_size)`;
- n blocks: `[n, layers, 2, kv_heads, block_size, head_dim]`.
- a transformers cache layer holds `[batch=1, kv_heads, seq, head_dim]` per layer for keys
  and values (rotary embeddings already applied, as the model stores them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class KVLayout:
    """Shape and precision of a model's per-token KV."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(_DTYPE_NAMES.values())}")
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout {name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return next(t for t, name in _DTYPE_NAMES.items() if name == self.dtype)

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, block_size, self.head_dim)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return _DTYPE_NAMES[dtype]


def validate_blocks(blocks: torch.Tensor, layout: KVLayout, device: torch.device) -> int:
    """Check `blocks` against the layout; return the block size."""
    if blocks.dim() != 6:
        raise ValueError(f"prefix blocks must be 6-D [n, layers, 2, kv_heads, block_size, head_dim], got {tuple(blocks.shape)}")
    n, layers, two, kv_heads, block_size, head_dim = blocks.shape
    expected = layout.block_shape(block_size)
    if (layers, two, kv_heads, block_size, head_dim) != expected or n < 1 or block_size < 1:
        raise ValueError(f"prefix blocks shape {tuple(blocks.shape)} does not match [n>=1, *{expected}]")
    if blocks.dtype != layout.torch_dtype:
        raise ValueError(f"prefix blocks dtype {blocks.dtype} does not match the model's {layout.dtype}")
    if blocks.device != device:
        raise ValueError(f"prefix blocks are on {blocks.device}, the model on {device}")
    return block_size


def blocks_to_cache(blocks: torch.Tensor, config: PreTrainedConfig) -> DynamicCache:
    """A fresh cache holding the prefix KV in `blocks` ([n, layers, 2, kv_heads, bs, head_dim])."""
    n, layers, _, kv_heads, block_size, head_dim = blocks.shape
    cache = DynamicCache(config=config)
    for layer in range(layers):
        # [n, kv_heads, bs, d] -> [1, kv_heads, n * bs, d]; the update concatenates (copies).
        keys = blocks[:, layer, 0].transpose(0, 1).reshape(1, kv_heads, n * block_size, head_dim)
        values = blocks[:, layer, 1].transpose(0, 1).reshape(1, kv_heads, n * block_size, head_dim)
        cache.update(keys, values, layer_idx=layer)
    return cache


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def extract_blocks(
    cache: DynamicCache, first_block: int, n_blocks: int, block_size: int
) -> torch.Tensor:
    """Contiguous copy `[n_blocks, layers, 2, kv_heads, block_size, head_dim]` of the cache's
    tokens `[first_block * block_size, (first_block + n_blocks) * block_size)`."""
    if first_block < 0 or n_blocks < 0 or block_size < 1:
        raise ValueError(
            f"bad block range: first_block={first_block} n_blocks={n_blocks} block_size={block_size}"
        )
    start, end = first_block * block_size, (first_block + n_blocks) * block_size
    if end > cache_length(cache):
        raise ValueError(f"blocks cover tokens [{start}, {end}) but the cache holds {cache_length(cache)}")
    layers = cache.layers
    _, kv_heads, _, head_dim = layers[0].keys.shape
    out = torch.empty(
        (n_blocks, len(layers), 2, kv_heads, block_size, head_dim),
        dtype=layers[0].keys.dtype,
        device=layers[0].keys.device,
    )
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for kv, states in enumerate((layer.keys, layer.values)):
                span = states[0, :, start:end].reshape(kv_heads, n_blocks, block_size, head_dim)
                out[:, i, kv].copy_(span.transpose(0, 1))
    return out
