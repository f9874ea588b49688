"""Conversion between the cache service's KV blocks and a transformers cache.

Owns the two copies between blocks and the model's `DynamicCache`; the layout contract
itself is `prefixcache.config.KVLayout` (the model's layout is read off a forward pass in
`compat.probe_kv_layout`; its block size is the service's, set by the cache link).

Layout (fixed by the cache service; do not change):
- one block: `[layers, 2, kv_heads, block_size, head_dim]` in the model dtype; index 0 of
  dim 1 holds keys, index 1 values; block i covers prompt tokens
  `[i * block_size, (i + 1) * block_size)`;
- n blocks: `[n, layers, 2, kv_heads, block_size, head_dim]`.
- a transformers cache layer holds `[batch=1, kv_heads, seq, head_dim]` per layer for keys
  and values (rotary embeddings already applied, as the model stores them).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from prefixcache.config import KVLayout


def validate_blocks(blocks: torch.Tensor, layout: KVLayout, device: torch.device) -> int:
    """Check `blocks` against the layout (any block size); return the block size."""
    if blocks.dim() != 6:
        raise ValueError(
            f"prefix blocks must be 6-D [n, layers, 2, kv_heads, block_size, head_dim], got {tuple(blocks.shape)}"
        )
    n, layers, two, kv_heads, block_size, head_dim = blocks.shape
    if n < 1 or block_size < 1:
        raise ValueError(f"prefix blocks shape {tuple(blocks.shape)} holds no block")
    expected = dataclasses.replace(layout, block_size=block_size).block_shape
    if (layers, two, kv_heads, block_size, head_dim) != expected:
        raise ValueError(f"prefix blocks shape {tuple(blocks.shape)} does not match [n>=1, *{expected}]")
    if blocks.dtype != layout.dtype.torch:
        raise ValueError(f"prefix blocks dtype {blocks.dtype} does not match the model's {layout.dtype.value}")
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


def layer_states(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) tensors; a clear error for a layer that holds none (not
    filled yet, or not a KV layer)."""
    states = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise ValueError(f"cache layer {i} ({type(layer).__name__}) holds no KV tensors")
        states.append((layer.keys, layer.values))
    return states


def extract_blocks(cache: DynamicCache, first_block: int, n_blocks: int, block_size: int) -> torch.Tensor:
    """Contiguous copy `[n_blocks, layers, 2, kv_heads, block_size, head_dim]` of the cache's
    tokens `[first_block * block_size, (first_block + n_blocks) * block_size)`."""
    if first_block < 0 or n_blocks < 0 or block_size < 1:
        raise ValueError(f"bad block range: first_block={first_block} n_blocks={n_blocks} block_size={block_size}")
    start, end = first_block * block_size, (first_block + n_blocks) * block_size
    if end > cache_length(cache):
        raise ValueError(f"blocks cover tokens [{start}, {end}) but the cache holds {cache_length(cache)}")
    layers = layer_states(cache)
    first_keys = layers[0][0]
    _, kv_heads, _, head_dim = first_keys.shape
    out = torch.empty(
        (n_blocks, len(layers), 2, kv_heads, block_size, head_dim),
        dtype=first_keys.dtype,
        device=first_keys.device,
    )
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for kv, states in enumerate(layer):
                span = states[0, :, start:end].reshape(kv_heads, n_blocks, block_size, head_dim)
                out[:, i, kv].copy_(span.transpose(0, 1))
    return out
