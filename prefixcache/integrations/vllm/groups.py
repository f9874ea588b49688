"""vLLM's KV cache groups seen as one canonical block layout with a block table per group.

vLLM's hybrid KV cache manager (HMA) gives each kind of layer a group with a block table of its
own: full attention, sliding window, chunked local attention, and Mamba / linear-attention
state. `KVGroups.of` reads `kv_cache_config.kv_cache_groups` into what the connector needs:
every attention layer in model order, the group of each, and the one geometry (KV heads, head
size, latent or K/V) all layers share, so a cache block is `[layers, 2, kv_heads, block_size,
head_dim]` whatever the groups are; and the state layers (Mamba, Gated DeltaNet) with theirs.

State layers (vLLM's `MambaSpec`) hold one recurrent state per request, not per token. With
prefix caching on, vLLM's "align" mode keeps the state at block boundaries, one page per
boundary, and pads that page to the attention layers' page size, so a state layer's page is
stored byte for byte in the slot of one attention layer of the canonical block: the state
namespace's block is `[state_layers, 2, kv_heads, block_size, head_dim]` of the same geometry,
holding the states at the end of that block (states.py keys it).

Why one layout for all groups: a cached block holds the KV of every layer for its tokens, so a
hit is a contiguous prefix the service verifies token by token, as for a plain model. Which
blocks each group needs at a hit point is vLLM's decision: it allocates the window's blocks of
a sliding-window group and puts its null block elsewhere, and the worker copies only into the
blocks vLLM allocated (paged.py). Sliding layers therefore move only their window on a hit;
they are stored for every block, so that any later block boundary can be a hit point.

Invariants: every group has one block size; all attention layers share one geometry; state
layers need align mode and pages the size of an attention layer's; anything else (cross or
encoder-only attention, layers of different head sizes, state without prefix caching) fails at
start-up naming the model class, the group and what to do instead.
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


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _state_kind(spec: Any) -> str:
    """A state group's kind and geometry: its backend, state shapes and dtypes (they name the namespace)."""
    shapes = "+".join("x".join(str(d) for d in shape) for shape in spec.shapes)
    dtypes = "+".join(str(dtype).removeprefix("torch.") for dtype in spec.dtypes)
    backend = str(getattr(spec.mamba_type, "value", spec.mamba_type)).rsplit(".", 1)[-1]  # e.g. GDNAttentionBackend
    return f"state-{backend}-{shapes}-{dtypes}"


def _check_state(spec: Any, number: int, layers: int, model_class: str) -> None:
    if spec.mamba_cache_mode != "align":
        raise ConfigError(
            "mamba_cache_mode",
            f"{model_class}: KV cache group {number} holds Mamba/linear-attention state ({layers} layers) in "
            f"mode {spec.mamba_cache_mode!r}; the connector restores state only where vLLM keeps it at block "
            "boundaries: turn vLLM's prefix caching on (enable_prefix_caching=True selects mamba_cache_mode='align')",
        )
    if spec.num_speculative_blocks:
        raise ConfigError(
            "num_speculative_blocks",
            f"{model_class}: KV cache group {number} keeps {spec.num_speculative_blocks} speculative state blocks "
            "(speculative decoding); the connector restores state without speculative decoding only",
        )


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
    block_size: int = 0  # tokens per block of every group
    page_bytes: int = 0  # one attention layer's block, in bytes
    state_names: tuple[str, ...] = ()  # state layers (Mamba, GDN), in model order
    state_groups: tuple[int, ...] = ()  # the KV cache group of each state layer
    state_kind: str = ""  # e.g. "state-GDNAttentionBackend-3x512+4x64x64-bfloat16+float32"

    @property
    def group_count(self) -> int:
        return len(self.kinds)

    @property
    def has_state(self) -> bool:
        return bool(self.state_names)

    def describe(self) -> str:
        counts = [self.layer_groups.count(g) + self.state_groups.count(g) for g in range(self.group_count)]
        groups = (f"{kind} x{count}" for kind, count in zip(self.kinds, counts, strict=True))
        return ", ".join(groups) + (" (MLA latent)" if self.latent else "")

    @classmethod
    def of(cls, kv_cache_config: Any, model_class: str) -> KVGroups:
        """`kv_cache_config`: vLLM's, whose groups' block size is the one the engine runs with (a
        hybrid model with state raises it above the configured one to fit a state page)."""
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ConfigError("kv_cache_groups", f"{model_class}: vLLM built no KV cache group")
        block_size = groups[0].kv_cache_spec.block_size
        per_layer: dict[str, tuple[int, Any]] = {}
        state_layers: dict[str, tuple[int, Any]] = {}
        kinds = []
        for number, group in enumerate(groups):
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, spec)
            first = next(iter(specs.values()))
            if spec.block_size != block_size:
                raise ConfigError(
                    "kv_cache_groups",
                    f"{model_class}: KV cache group {number} has {spec.block_size}-token blocks, group 0 has "
                    f"{block_size}; the connector needs one block size for every group",
                )
            if _is_state(first):
                _check_state(first, number, len(group.layer_names), model_class)
                kinds.append(_state_kind(first))
                state_layers.update((name, (number, layer_spec)) for name, layer_spec in specs.items())
                continue
            kind = _kind(first)
            if kind is None:
                raise ConfigError(
                    "kv_cache_groups",
                    f"{model_class}: KV cache group {number} is {type(spec).__name__} "
                    f"({len(group.layer_names)} layers, e.g. {group.layer_names[0]}), state PrefixCacheConnector "
                    "cannot store or restore (it handles full, sliding-window, chunked-local and MLA attention); "
                    "serve this model without the connector (vLLM's own prefix caching still works)",
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
        if not geometries:
            raise ConfigError("kv_cache_groups", f"{model_class}: no attention layer (state layers only)")
        (kv_heads, head_size, _, latent) = next(iter(geometries))
        if latent and head_size % 2:
            raise ConfigError("head_size", f"{model_class}: an MLA latent row of {head_size} elements is odd")
        page_bytes = per_layer[names[0]][1].page_size_bytes
        state_names = sorted(state_layers, key=_layer_index)
        state_kinds = {kinds[state_layers[name][0]] for name in state_names}
        for name in state_names:
            number, spec = state_layers[name]
            if spec.page_size_bytes != page_bytes:
                raise ConfigError(
                    "kv_cache_groups",
                    f"{model_class}: state layer {name} has {spec.page_size_bytes}-byte pages, the attention layers "
                    f"{page_bytes}; the connector stores a state page in an attention layer's slot",
                )
        if len(state_kinds) > 1:
            raise ConfigError(
                "kv_cache_groups", f"{model_class}: state layers of different kinds ({sorted(state_kinds)})"
            )
        return cls(
            layer_names=tuple(names),
            layer_groups=tuple(per_layer[name][0] for name in names),
            kinds=tuple(kinds),
            kv_heads=kv_heads,
            head_size=head_size // 2 if latent else head_size,
            latent=latent,
            block_size=block_size,
            page_bytes=page_bytes,
            state_names=tuple(state_names),
            state_groups=tuple(state_layers[name][0] for name in state_names),
            state_kind=next(iter(state_kinds), ""),
        )
