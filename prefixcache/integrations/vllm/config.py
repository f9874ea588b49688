"""The connector's settings and the namespace it attaches under, read off vLLM's config.

`ConnectorSettings.parse` validates `kv_connector_extra_config`; every error is a
`ConfigError` naming the key as the user spells it. `namespace_of` derives what makes KV
incompatible: model name, revision, a weights digest, the KV layout (layers, KV heads,
head size, vLLM's block size, KV dtype), the KV scale settings of an fp8 cache (`kv_scale_of`)
and the tensor-parallel rank and size.

Invariants:
- The namespace block size is vLLM's block size (one vLLM block = one cache block), so a
  hit is always a whole number of vLLM blocks and a copy never splits a block.
- The cache stores blocks in its one canonical layout `[layers, 2, kv_heads, block_size,
  head_dim]`; vLLM's physical paged layout (CPU's LBHNC, CUDA's NHD/HND) is converted at
  copy time and is therefore *not* part of the namespace.
- An fp8 cache (`cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2) is stored byte for byte; its
  `kv_scale` names where vLLM's k/v scales come from, so differently scaled fp8 never shares.
  vLLM 0.32 has no runtime scale calculation: scales are 1.0 unless the checkpoint's
  quantization config supplies them (then they are weights, covered by the weights digest,
  which must therefore be on). The worker checks the claim against its layers' actual scales.
- The weights digest is a pure function of the checkpoint's bytes that it samples (see
  `weights_digest`): the same files on two machines give the same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...client.hit_policy import HIT_POLICIES
from ...config import DType, KVLayout, Namespace, validate_salt
from ...errors import ConfigError

SALT_SOURCES = ("request", "config", "none")
DIGEST_MODES = ("sampled", "full", "off")
LAYER_LOAD_MODES = ("auto", "on", "off")  # layers.py
_SAMPLE_BYTES = 1 << 20  # bytes hashed at the start, middle and end of each weight file
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_KNOWN_KEYS = {
    "cache",
    "auth_token",
    "auth_token_file",
    "timeout_s",
    "lookup_timeout_s",
    "lookup_grace_s",
    "hit_policy",
    "cache_salt",
    "cache_salt_source",
    "revision",
    "weights_digest",
    "same_host",
    "tls_root_cert_file",
    "prefill_tokens_per_s",
    "layer_loads",
    "presence_table",
}

# vLLM's cache_dtype -> the cache's element type name ("auto" means the model's dtype).
_VLLM_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class ConnectorSettings:
    cache: str  # host:port of the prefixcache service
    auth_token: str | None = None
    timeout_s: float = 2.0  # every RPC but Lookup (Fetch/Store streams grow with their size)
    lookup_timeout_s: float = 0.5  # the scheduler waits this long at most per request
    lookup_grace_s: float = 0.004  # ...and, while vLLM runs others, this long per step (0: never): see scheduler.py
    hit_policy: str = "auto"  # always: load every usable block; auto: only when faster than prefill
    cache_salt: str | None = None  # salt for every request without its own (cache_salt_source=config)
    cache_salt_source: str = "request"  # request: vLLM's per-request cache_salt (else `cache_salt`)
    revision: str = ""  # overrides vLLM's model revision in the namespace
    weights_digest: str = "sampled"
    same_host: bool = True  # map the service's shared memory when it is on this host
    tls_root_cert_file: str | None = None
    prefill_tokens_per_s: float = 0.0  # auto policy's prefill rate before the worker measured one
    layer_loads: str = "auto"  # in-step loads copied layer by layer behind the forward: auto (CUDA only), on, off
    presence_table: bool = True  # skip Lookups a same-host service's presence table shows cannot hit (presence.py)

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ConfigError(
                unknown[0], f"unknown kv_connector_extra_config key (known: {', '.join(sorted(_KNOWN_KEYS))})"
            )
        cache = extra.get("cache")
        if not isinstance(cache, str) or ":" not in cache:
            raise ConfigError("cache", f"must be the service address HOST:PORT, got {cache!r}")
        token = extra.get("auth_token")
        token_file = extra.get("auth_token_file")
        if token is not None and token_file is not None:
            raise ConfigError("auth_token_file", "give auth_token or auth_token_file, not both")
        if token_file is not None:
            try:
                token = Path(str(token_file)).read_text().strip()
            except OSError as error:
                raise ConfigError("auth_token_file", f"cannot read {token_file!r}: {error.strerror}") from None
            if not token:
                raise ConfigError("auth_token_file", f"{token_file!r} is empty")
        if token is not None and (not isinstance(token, str) or not token):
            raise ConfigError("auth_token", "must be a non-empty string")
        values: dict[str, Any] = {"cache": cache, "auth_token": token}
        zero_allowed = ("prefill_tokens_per_s", "lookup_grace_s")
        for key in ("timeout_s", "lookup_timeout_s", "lookup_grace_s", "prefill_tokens_per_s"):
            if key in extra:
                value = extra[key]
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not value >= 0
                    or value == float("inf")
                    or (value == 0 and key not in zero_allowed)
                ):
                    kind = "non-negative" if key in zero_allowed else "positive"
                    raise ConfigError(key, f"must be a {kind} number, got {value!r}")
                values[key] = float(value)
        for key, allowed in (
            ("hit_policy", HIT_POLICIES),
            ("cache_salt_source", SALT_SOURCES),
            ("weights_digest", DIGEST_MODES),
            ("layer_loads", LAYER_LOAD_MODES),
        ):
            if key in extra:
                if extra[key] not in allowed:
                    raise ConfigError(key, f"must be one of {', '.join(allowed)}, got {extra[key]!r}")
                values[key] = extra[key]
        for key in ("cache_salt", "revision", "tls_root_cert_file"):
            if key in extra:
                if not isinstance(extra[key], str) or (key != "revision" and not extra[key]):
                    raise ConfigError(key, f"must be a non-empty string, got {extra[key]!r}")
                values[key] = extra[key]
        for key in ("same_host", "presence_table"):
            if key in extra:
                if not isinstance(extra[key], bool):
                    raise ConfigError(key, f"must be true or false, got {extra[key]!r}")
                values[key] = extra[key]
        if "cache_salt" in values:
            validate_salt(values["cache_salt"])
        settings = cls(**values)
        if settings.cache_salt_source == "config" and settings.cache_salt is None:
            raise ConfigError("cache_salt", "cache_salt_source=config needs a cache_salt")
        return settings

    def salt_for(self, request_salt: str | None) -> str | None:
        """The cache salt one request's blocks live under (None: the namespace's unsalted space)."""
        if self.cache_salt_source == "none":
            return None
        if self.cache_salt_source == "request" and request_salt:
            return request_salt
        return self.cache_salt


UNIT_SCALES = "unit"  # kv_scale_of's source when vLLM quantizes with k_scale = v_scale = 1.0


def kv_scale_of(vllm_config: Any) -> str:
    """What besides the dtype makes two fp8 caches incompatible: the source of vLLM's k/v scales.

    "" for an unquantized cache. vLLM 0.32 quantizes K and V with per-layer `k_scale` /
    `v_scale`; without a quantized checkpoint they are 1.0 (`set_default_quant_scales`), with
    one they are loaded from it (`BaseKVCacheMethod`), named here by the quantization method
    and the checkpoint's `kv_cache_scheme`; their values are then part of the weights digest.
    """
    cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
    if cache_config.cache_dtype not in _VLLM_KV_DTYPES:
        return ""
    if getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        raise ConfigError(
            "kv_cache_dtype_skip_layers",
            "layers left unquantized in an fp8 cache mix two KV dtypes; the connector stores one dtype per namespace",
        )
    quantization = getattr(model_config, "quantization", None)
    if not quantization:
        source = UNIT_SCALES
    else:
        hf_quant = getattr(model_config.hf_config, "quantization_config", None) or {}
        scheme = hf_quant.get("kv_cache_scheme") if isinstance(hf_quant, dict) else None
        source = f"checkpoint:{quantization}:" + json.dumps(scheme, sort_keys=True, separators=(",", ":"))
    return f"scales={source}"[:512]  # the format itself is layout.dtype (fp8 = fp8_e4m3 share)


def check_layer_scales(kv_scale: str, scales: dict[str, tuple[float, float]]) -> None:
    """The worker's check that `kv_scale` tells the truth: unit scales must be 1.0 in every layer."""
    if not kv_scale.endswith(f"scales={UNIT_SCALES}"):
        return
    for name, (k_scale, v_scale) in scales.items():
        if k_scale != 1.0 or v_scale != 1.0:
            raise ConfigError(
                "kv_scale",
                f"layer {name} quantizes KV with k_scale={k_scale}, v_scale={v_scale}, "
                "not the 1.0 the namespace was derived with",
            )


def kv_dtype_of(cache_dtype: str, model_dtype: Any) -> DType:
    """The cache's element type for vLLM's `cache_dtype` (fp8 needs a DType that names it)."""
    name = _VLLM_KV_DTYPES.get(cache_dtype) if cache_dtype != "auto" else str(model_dtype).removeprefix("torch.")
    if name is None:
        raise ConfigError("cache_dtype", f"vLLM kv cache dtype {cache_dtype!r} has no prefixcache element type")
    return DType.parse(name, "cache_dtype")


def weights_digest(model: str, mode: str = "sampled") -> str:
    """sha256 naming a local checkpoint's weights; "" for mode off or a model that is not a directory.

    sampled: config.json, then for each weight file its name, size, and the first, middle and
    last MiB (safetensors files start with their tensor index, so that is hashed too); cheap
    on a 100 GB checkpoint and changes whenever a file is retrained or re-quantized, except a
    change confined to bytes it does not sample. full: every byte (slow on big models).
    """
    path = Path(model)
    if mode == "off" or not path.is_dir():
        return ""
    files = sorted(
        p for p in path.iterdir() if p.is_file() and (p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES)
    )
    digest = hashlib.sha256(mode.encode())
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with file.open("rb") as f:
            if mode == "full" or size <= 3 * _SAMPLE_BYTES:
                digest.update(hashlib.file_digest(f, "sha256").digest())
                continue
            for offset in (0, size // 2, size - _SAMPLE_BYTES):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def namespace_of(
    vllm_config: Any,
    settings: ConnectorSettings,
    layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    tp_rank: int,
    kind: str = "",
) -> Namespace:
    """`block_size`: the KV cache groups' (vLLM raises the configured one for hybrid models with
    state); `kind`: what besides the layout tells the blocks apart ("" for K/V, "mla" for MLA's
    latent rows stored as two halves, "state(...)" for state pages, groups.py)."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    layout = KVLayout(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=kv_dtype_of(cache_config.cache_dtype, model_config.dtype),
    )
    revision = settings.revision or (model_config.revision or "")
    digest = weights_digest(model_config.model, settings.weights_digest)
    kv_scale = kv_scale_of(vllm_config)
    if kv_scale and not kv_scale.endswith(f"scales={UNIT_SCALES}") and not digest:
        raise ConfigError(
            "weights_digest",
            "fp8 KV scales loaded from the checkpoint are weights: the namespace "
            "needs a weights digest (sampled or full) of a local checkpoint",
        )
    parts = [revision, f"weights={digest[:32]}" if digest else "weights=unknown", f"tp={tp_rank}/{tp_size}"]
    if kind:
        parts.append(f"kv={kind}")
    name = model_config.served_model_name if isinstance(model_config.served_model_name, str) else model_config.model
    return Namespace(
        model=os.path.basename(str(name).rstrip("/")) or str(name),
        revision="|".join(parts),
        layout=layout,
        kv_scale=kv_scale,
    )


def describe(settings: ConnectorSettings) -> str:
    shown = {k: v for k, v in settings.__dict__.items() if k != "auth_token"}
    shown["auth_token"] = "set" if settings.auth_token else None
    return json.dumps(shown, sort_keys=True)
