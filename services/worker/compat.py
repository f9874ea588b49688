"""Which models the worker can serve from the prefix cache, and their KV layout.

Owns the refusal of models whose KV is not plain per-layer keys/values, and the probe that
reads the actual KV layout off one real forward pass.

Invariant: a model accepted here keeps, for every layer, the full keys and values of every
past token as `[1, kv_heads, seq, head_dim]` with the same `kv_heads`/`head_dim` for keys and
values and for all layers. Only then is a block `[layers, 2, kv_heads, block_size, head_dim]`
the complete state of `block_size` tokens. Refused, with the reason named:
- sliding-window or chunked attention layers (the cache drops old tokens),
- linear / recurrent / hybrid layers (state is a running summary, not per-token KV),
- layers without their own KV (KV sharing, attention-free layers),
- latent (MLA) or otherwise asymmetric key/value heads, encoder-decoder models.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from prefixcache.config import MODEL_DTYPES, DType, KVLayout

from .kv_blocks import layer_states


class UnsupportedModelError(ValueError):
    """The model's KV cannot be stored as plain per-layer key/value blocks."""


def _head_dim(text: PreTrainedConfig) -> int:
    head_dim = getattr(text, "head_dim", None)
    return head_dim if head_dim else text.hidden_size // text.num_attention_heads


def _check_attention_shape(text: PreTrainedConfig) -> None:
    if not getattr(text, "num_attention_heads", None):
        raise UnsupportedModelError("the model has no attention heads (attention-free architecture)")
    if getattr(text, "kv_lora_rank", None) is not None:
        raise UnsupportedModelError("multi-head latent attention (kv_lora_rank) stores compressed KV")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError("chunked attention (attention_chunk_size) drops old tokens")
    v_head_dim = getattr(text, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != _head_dim(text):
        raise UnsupportedModelError(f"value head_dim {v_head_dim} differs from key head_dim {_head_dim(text)}")


def check_plain_kv(config: PreTrainedConfig) -> None:
    """Raise `UnsupportedModelError` naming why `config`'s KV is not plain per-layer K/V."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported")
    text = config.get_text_config(decoder=True)
    _check_attention_shape(text)
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise UnsupportedModelError(
            f"layer_types contains {other}: only 'full_attention' layers have plain per-token KV"
        )
    # transformers builds the cache from the same config: every layer must be a plain
    # DynamicLayer (a config with `sliding_window` but no layer_types gets sliding layers).
    cache = DynamicCache(config=config)
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        window = getattr(text, "sliding_window", None)
        detail = f" (sliding_window={window})" if window is not None else ""
        raise UnsupportedModelError(f"the model's cache would use {odd} layers{detail}, not plain full-attention KV")


def probe_kv_layout(model: PreTrainedModel) -> KVLayout:
    """Run one token through the model and read the KV layout off the filled cache."""
    text = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    try:
        states = layer_states(cache)
    except ValueError as error:
        raise UnsupportedModelError(str(error)) from None
    shapes = {(tuple(keys.shape), tuple(values.shape)) for keys, values in states}
    if len(cache.layers) != text.num_hidden_layers or len(shapes) != 1:
        raise UnsupportedModelError(
            f"cache has {len(cache.layers)} layers with shapes {sorted(shapes)}, expected "
            f"{text.num_hidden_layers} layers of one shape"
        )
    ((key_shape, value_shape),) = shapes
    if key_shape != value_shape or key_shape[0] != 1 or key_shape[2] != 1:
        raise UnsupportedModelError(f"unexpected KV shapes keys={key_shape} values={value_shape}")
    dtype = states[0][0].dtype
    if dtype != model.dtype:
        raise UnsupportedModelError(f"KV dtype {dtype} differs from the model dtype {model.dtype}")
    if dtype not in {model_dtype.torch for model_dtype in MODEL_DTYPES}:
        raise UnsupportedModelError(f"unsupported KV dtype {dtype}")
    # The block size is the cache service's; the cache link sets it (the default stands in).
    return KVLayout(len(cache.layers), key_shape[1], key_shape[3], dtype=DType.parse(str(dtype)))
