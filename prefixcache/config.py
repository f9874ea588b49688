"""Frozen, validated configuration values.

Every dataclass here validates itself at construction and names the field in
its error, so a bad flag or file fails at start-up rather than on first use.
Sizes accept "512MiB"/"2GiB"/"1.5GB"/plain bytes, and Kubernetes' "2Gi"/"512Mi"; durations accept "300",
"300s", "10m", "1h", "250ms".
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch  # for annotations only: importing config must not load torch

MAX_BLOCK_SIZE = 65536  # tokens per block, a service's or an engine's

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,  # Kubernetes quantities
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "h": 3600.0, "d": 86400.0}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field_name: str = "size") -> int:
    """Bytes from an int or a string like "512MiB"; rejects negatives and junk."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _QUANTITY.match(str(value))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(field_name, f"cannot parse size {value!r} (try 512MiB, 2GiB, 2Gi, 1000000)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0 or not math.isfinite(number):
        raise ConfigError(field_name, f"size must be >= 0, got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def parse_duration(value: str | float, field_name: str = "duration") -> float:
    """Seconds from a number or a string like "10m", "250ms", "300s"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _QUANTITY.match(str(value))
        if not match or match.group(2).lower() not in _DURATION_UNITS:
            raise ConfigError(field_name, f"cannot parse duration {value!r} (try 300s, 10m, 250ms)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if seconds < 0 or not math.isfinite(seconds):
        raise ConfigError(field_name, f"duration must be >= 0, got {value!r}")
    return seconds


class DType(enum.Enum):
    """The named formats a block's KV bytes are in: the one dtype table of the project.

    The cache never converts or re-quantizes KV: a block is raw bytes of one named
    format, and the format (with the layout's shape) fixes how many bytes a block
    has. Each format has a stable `code` (the frame header's dtype byte and the
    proto `DType` enum number, which are the same numbers), a `torch` dtype for
    typed views, and `nbytes(elements)`, the bytes of that many elements.

    Room for packed sub-byte formats (NVFP4, MXFP4...), not yet added: such a
    format's `nbytes` counts its packed elements plus its per-group scales (so
    `KVLayout.block_bytes` stays right while `block_shape` describes elements, not
    bytes), it has no torch dtype, and tiers would hold its slots as uint8 rows of
    `block_bytes`. Slot copies, frames and streams already move bytes only (rows of
    words, never elements), so nothing below the layout changes for one.
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"  # vLLM --kv-cache-dtype fp8 / fp8_e4m3
    FLOAT8_E5M2 = "float8_e5m2"  # vLLM --kv-cache-dtype fp8_e5m2

    @property
    def code(self) -> int:
        """The frame header's dtype byte and the proto DType number (never reused)."""
        return _DTYPE_TABLE[self][0]

    @property
    def itemsize(self) -> int:
        """Bytes per element of an element-addressable format."""
        return _DTYPE_TABLE[self][1]

    def nbytes(self, elements: int) -> int:
        """Bytes that `elements` KV elements take in this format (a block's size)."""
        return elements * self.itemsize

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype of typed views (torch is imported here, so the core stays light)."""
        import torch  # here, not at the top: torch-free tools (CLI, codec) import config

        dtype: torch.dtype = getattr(torch, self.value)
        return dtype

    @classmethod
    def from_code(cls, code: int, field_name: str = "dtype") -> DType:
        try:
            return _DTYPE_OF_CODE[code]
        except KeyError:
            raise ConfigError(field_name, f"unknown dtype code {code}") from None

    @classmethod
    def parse(cls, value: str | DType, field_name: str = "dtype") -> DType:
        if isinstance(value, DType):
            return value
        try:
            return cls(str(value).removeprefix("torch."))
        except ValueError:
            names = ", ".join(d.value for d in cls)
            raise ConfigError(field_name, f"unsupported dtype {value!r} (one of {names})") from None


# DType -> (code, bytes per element). Codes are fixed on the wire and in stored frames:
# append new formats, never renumber.
_DTYPE_TABLE = {
    DType.FLOAT32: (1, 4),
    DType.FLOAT16: (2, 2),
    DType.BFLOAT16: (3, 2),
    DType.FLOAT8_E4M3FN: (4, 1),
    DType.FLOAT8_E5M2: (5, 1),
}
_DTYPE_OF_CODE = {code: dtype for dtype, (code, _) in _DTYPE_TABLE.items()}
MODEL_DTYPES = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16)  # what a model computes in (the worker's --dtype)


class HashAlgorithm(enum.Enum):
    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"

    @classmethod
    def parse(cls, value: str | HashAlgorithm) -> HashAlgorithm:
        if isinstance(value, HashAlgorithm):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError("hash_algorithm", f"unknown {value!r} (xxh3_128 or sha256)") from None


def _positive_int(name: str, value: int, upper: int = 1 << 20) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= upper:
        raise ConfigError(name, f"must be an integer in [1, {upper}], got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one block's KV: `[layers, 2, kv_heads, block_size, head_dim]`.

    Index 0 of the second axis holds keys, 1 values. Every tier stores blocks
    in exactly this layout, so moving a block between tiers is a flat copy.
    """

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: DType = DType.FLOAT16

    def __post_init__(self) -> None:
        _positive_int("layers", self.layers, 4096)
        _positive_int("kv_heads", self.kv_heads, 4096)
        _positive_int("head_dim", self.head_dim, 65536)
        _positive_int("block_size", self.block_size, MAX_BLOCK_SIZE)
        object.__setattr__(self, "dtype", DType.parse(self.dtype))

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.dtype.nbytes(2 * self.layers * self.kv_heads * self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, from the format (a packed format's own `nbytes`, scales included)."""
        return self.dtype.nbytes(2 * self.layers * self.kv_heads * self.head_dim * self.block_size)

    def blocks_per(self, engine_block_size: int, field: str = "block_size") -> int:
        """How many of these blocks make one engine block of `engine_block_size` tokens (0: one).

        An engine block must be a whole number of them: it is stored as that many blocks, so
        engines of different block sizes share every block where their prompts agree."""
        size = engine_block_size or self.block_size
        if not 0 < size <= MAX_BLOCK_SIZE or size % self.block_size:
            raise ConfigError(
                field,
                f"{size} is not a multiple of this service's block size {self.block_size} up to "
                f"{MAX_BLOCK_SIZE} (an engine block is stored as whole service blocks: give the "
                "service a --block-size that divides every engine's)",
            )
        return size // self.block_size

    def with_block_size(self, block_size: int) -> KVLayout:
        return replace(self, block_size=block_size)


QUOTA_TIERS = ("device", "host")  # slot tiers that take a per-tenant byte quota
QUOTA_KEYS = (*QUOTA_TIERS, "retention")  # what a quota spec may name
_UNLIMITED = ("unlimited", "none")


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's byte budget in each slot tier (None means no limit in that tier), and the
    longest retention hint its stores may give (`retention`, seconds; 0: hints never keep blocks
    past the service's TTLs; longer hints are cut to it)."""

    host: int | None = None
    device: int | None = None
    retention: float = 0.0

    def __post_init__(self) -> None:
        for name in QUOTA_TIERS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_size(value, f"tenant_quota.{name}"))
        object.__setattr__(self, "retention", parse_duration(self.retention, "tenant_quota.retention"))

    @property
    def limited(self) -> bool:
        return self.host is not None or self.device is not None

    def updated(self, spec: str, field_name: str = "tenant_quota") -> TenantQuota:
        """This quota with the tiers named in `spec` replaced: "host=256MiB,device=1GiB";
        a tier given as "unlimited" (or "none") has no limit. "retention=24h" sets the longest
        retention hint honoured."""
        values: dict[str, int | float | None] = {name: getattr(self, name) for name in QUOTA_KEYS}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            tier, sep, size = item.partition("=")
            tier = tier.strip().lower()
            if not sep or tier not in QUOTA_KEYS:
                raise ConfigError(
                    field_name,
                    f"expected TIER=SIZE with TIER one of {', '.join(QUOTA_TIERS)}, or retention=DURATION, got {item!r}",
                )
            size = size.strip()
            if tier == "retention":
                values[tier] = parse_duration(size, f"{field_name}.retention")
            else:
                values[tier] = None if size.lower() in _UNLIMITED else parse_size(size, f"{field_name}.{tier}")
        return TenantQuota(**values)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, spec: str, field_name: str = "tenant_quota") -> TenantQuota:
        return cls().updated(spec, field_name)


@dataclass(frozen=True)
class TenantQuotas:
    """Quotas of every tenant: `default` unless `overrides` names the tenant."""

    default: TenantQuota = TenantQuota()
    overrides: tuple[tuple[str, TenantQuota], ...] = ()

    def __post_init__(self) -> None:
        tenants = [tenant for tenant, _ in self.overrides]
        if len(set(tenants)) != len(tenants):
            raise ConfigError("tenant_quotas", "a tenant has two quota overrides")

    def of(self, tenant: str) -> TenantQuota:
        for name, quota in self.overrides:
            if name == tenant:
                return quota
        return self.default

    @property
    def limited(self) -> bool:
        return self.default.limited or any(quota.limited for _, quota in self.overrides)


@dataclass(frozen=True)
class CacheConfig:
    """Budgets and policies of one cache instance (all capacities in bytes)."""

    host_capacity: int = 1 << 30
    device_capacity: int = 0
    ttl_s: float = 300.0
    lease_ttl_s: float = 30.0
    hash_algorithm: HashAlgorithm = HashAlgorithm.XXH3_128
    promote_on_hit: bool = True
    max_prompt_tokens: int = 1 << 20
    max_leases: int = 4096
    tenant_quotas: TenantQuotas = TenantQuotas()  # per-tenant byte budgets per slot tier (quota.py)
    # The slot tiers' arenas (tiers/arena.py): chunk size (None: 64 MiB, at most a quarter of the
    # budget, in whole blocks of the first layout) and the smallest block that gets a whole chunk
    # (None, or more than the first layout's block: that block; smaller blocks fill chunks partly).
    chunk_bytes: int | None = None
    min_block_bytes: int | None = None
    # Map every page of the host tier's segment at start (tiers/shm.py): start-up pays the tmpfs's
    # first-touch cost of each page instead of the first commits into it.
    host_prefault: bool = False

    def __post_init__(self) -> None:
        for name in ("host_capacity", "device_capacity"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        for name in ("chunk_bytes", "min_block_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse_size(getattr(self, name), name))
                if getattr(self, name) < 1:
                    raise ConfigError(name, "must be > 0")
        if not isinstance(self.host_prefault, bool):
            raise ConfigError("host_prefault", f"must be true or false, got {self.host_prefault!r}")
        if self.chunk_bytes is not None and self.chunk_bytes % 16:
            raise ConfigError("chunk_bytes", f"must be a multiple of 16 bytes, got {self.chunk_bytes}")
        object.__setattr__(self, "ttl_s", parse_duration(self.ttl_s, "ttl_s"))
        object.__setattr__(self, "lease_ttl_s", parse_duration(self.lease_ttl_s, "lease_ttl_s"))
        object.__setattr__(self, "hash_algorithm", HashAlgorithm.parse(self.hash_algorithm))
        if self.ttl_s <= 0:
            raise ConfigError("ttl_s", "must be > 0")
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s", "must be > 0")
        _positive_int("max_prompt_tokens", self.max_prompt_tokens, 1 << 24)
        _positive_int("max_leases", self.max_leases, 1 << 20)
        if not isinstance(self.tenant_quotas, TenantQuotas):
            raise ConfigError("tenant_quotas", f"must be TenantQuotas, got {type(self.tenant_quotas).__name__}")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV incompatible. Different namespaces never share a block.

    `tenant` is set by the service from the authenticated credential; `cache_salt`
    is chosen by the client and only subdivides inside its tenant. `kv_scale`
    names the engine's KV quantization settings beyond `layout.dtype` (the k/v
    scales of an fp8 cache, or a digest of per-layer ones): the same model and
    dtype quantized with other scales holds other bytes, so it never shares.
    """

    model: str
    revision: str
    layout: KVLayout
    tenant: str = ""
    cache_salt: str = ""
    kv_scale: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "revision", "tenant", "cache_salt", "kv_scale"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, f"must be a string, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.layout, KVLayout):
            raise ConfigError("layout", f"must be a KVLayout, got {type(self.layout).__name__}")
        if not self.model or len(self.model) > 512:
            raise ConfigError("model", "must be a non-empty string of at most 512 characters")
        if len(self.revision) > 512:
            raise ConfigError("revision", "must be at most 512 characters")
        if len(self.kv_scale) > 512 or not self.kv_scale.isprintable():
            raise ConfigError("kv_scale", "must be at most 512 printable characters")
        validate_salt(self.cache_salt, allow_empty=True)
        if len(self.tenant) > 128:
            raise ConfigError("tenant", "must be at most 128 characters")


def validate_salt(salt: str, allow_empty: bool = False) -> None:
    """A salt is 1..128 printable characters (empty means "no salt" where allowed)."""
    if salt == "" and allow_empty:
        return
    if not salt or len(salt) > 128 or not salt.isprintable():
        raise ConfigError("cache_salt", "must be 1 to 128 printable characters")
