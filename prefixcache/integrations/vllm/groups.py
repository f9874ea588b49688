"""vLLM's KV cache groups seen as one canonical block layout with a block table per group.

vLLM's hybrid KV cache manager (HMA) gives each kind of attention layer a group with a block
table of its own: full attention, sliding window, chunked local attention (and Mamba state,
which this connector cannot restore). `KVGroups.of` reads `kv_cache_config.kv_cache_groups`
into what the connector needs: every attention layer in model order, the group of each, and
the one geometry (KV heads, head size, latent or K/V) all layers share, so a cache block is
`[layers, 2, kv_heads, block_size, head_dim]` whatever the groups are.

Why one layout for all groups: a cached block holds the KV of every layer for its tokens, so a
hit is a contiguous prefix the service verifies token by token, as for a plain model. Which
blocks each group needs at a hit point is vLLM's decision: it allocates the window's blocks of
a sliding-window group and puts its null block elsewhere, and the worker copies only into the
blocks vLLM allocated (paged.py). Sliding layers therefore move only their window on a hit;
they are stored for every block, so that any later block boundary can be a hit point.

Invariants: every group has vLLM's block size; all layers share one geometry; anything else
(Mamba/linear-attention state, cross or encoder-only attention, layers of different head
sizes) fails at start-up naming the model class, the group and what to do instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _kind(spec: Any) -> str | None:
    """The connector's name for a group's kind of attention; None for kinds it cannot restore."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    mla = isinstance(spec, MLAAttentionSpec) or type(spec).__name__ == "SlidingWindowMLASpec"
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window({spec.sliding_window}){' mla' if mla else ''}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked_local({spec.attention_chunk_size})"
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec) or type(spec).__name__ == "SinkFullAttentionSpec":
        window = getattr(spec, "sliding_window", None)  # HMA off: sliding layers as full ones
        return ("mla" if mla else "full") + (f" (window {window}, stored whole)" if window else "")
    return None


def _layer_index(name: str) -> int:
    found = _LAYER_INDEX.findall(f".{name}.")
    return int(found[-1]) if found else 0


@dataclass(frozen=True)
class KVGroups:
    layer_names: tuple[str, ...]  # every attention layer, in model order
    layer_groups: tuple[int, ...]  # the KV cache group of each layer
    kinds: tuple[str, ...]  # per group, e.g. "full", "sliding_window(64)", "mla"
    kv_heads: int
    head_size: int  # the canonical block's head_dim (MLA: half the latent row)
    latent: bool  # MLA: one latent row per token, no separate K and V

    @property
    def group_count(self) -> int:
        return len(self.kinds)

    def describe(self) -> str:
        groups = (f"{kind} x{self.layer_groups.count(group)}" for group, kind in enumerate(self.kinds))
        return ", ".join(groups) + (" (MLA latent)" if self.latent else "")

    @classmethod
    def of(cls, kv_cache_config: Any, block_size: int, model_class: str) -> KVGroups:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ConfigError("kv_cache_groups", f"{model_class}: vLLM built no KV cache group")
        per_layer: dict[str, tuple[int, Any]] = {}
        kinds = []
        for number, group in enumerate(groups):
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, spec)
            kind = _kind(next(iter(specs.values())))
            if kind is None:
                raise ConfigError(
                    "kv_cache_groups",
                    f"{model_class}: KV cache group {number} is {type(spec).__name__} "
                    f"({len(group.layer_names)} layers, e.g. {group.layer_names[0]}), state PrefixCacheConnector "
                    "cannot store or restore (it handles full, sliding-window, chunked-local and MLA attention); "
                    "serve this model without the connector (vLLM's own prefix caching still works)",
                )
            if spec.block_size != block_size:
                raise ConfigError(
                    "kv_cache_groups",
                    f"{model_class}: KV cache group {number} ({kind}) has {spec.block_size}-token blocks, vLLM's "
                    f"block size is {block_size}; the connector needs one block size for every group",
                )
            kinds.append(kind)
            for name, layer_spec in specs.items():
                per_layer[name] = (number, layer_spec)
        names = sorted(per_layer, key=_layer_index)
        geometries: dict[tuple[int, int, str, bool], str] = {}
        for name in names:
            spec = per_layer[name][1]
            latent = "mla" in (_kind(spec) or "")
            head_v = getattr(spec, "head_size_v", None) or spec.head_size
            if not latent and head_v != spec.head_size:
                raise ConfigError(
                    "head_size_v",
                    f"{model_class}: layer {name} has keys of {spec.head_size} and values of {head_v} elements "
                    "per head; the connector stores keys and values of one head size",
                )
            geometries.setdefault((spec.num_kv_heads, spec.head_size, str(spec.dtype), latent), name)
        if len(geometries) > 1:
            shown = "; ".join(
                f"{layer}: {heads} KV heads x {size} ({dtype}{', MLA' if latent else ''})"
                for (heads, size, dtype, latent), layer in geometries.items()
            )
            raise ConfigError(
                "kv_cache_groups",
                f"{model_class}: attention layers of different KV geometries ({shown}); the connector stores one "
                "block layout per model, so serve this model without it",
            )
        (kv_heads, head_size, _, latent) = next(iter(geometries))
        if latent and head_size % 2:
            raise ConfigError("head_size", f"{model_class}: an MLA latent row of {head_size} elements is odd")
        return cls(
            layer_names=tuple(names),
            layer_groups=tuple(per_layer[name][0] for name in names),
            kinds=tuple(kinds),
            kv_heads=kv_heads,
            head_size=head_size // 2 if latent else head_size,
            latent=latent,
        )
