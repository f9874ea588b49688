"""Messages <-> values: every request field is validated here, responses are built here.

Each check raises `InvalidArgument` naming the field as it is spelled in
cache.proto (`layout.head_dim`, `prefix.tokens`), so a client sees exactly
which input was wrong. Nothing here touches the cache.
"""

from __future__ import annotations

import math
import re

import numpy as np

from prefixcache import wire
from prefixcache.config import KVLayout, validate_salt
from prefixcache.errors import ConfigError, InvalidArgument
from prefixcache.hashing import MAX_TOKEN_ID
from prefixcache.results import BlockLocations, CommitResult, LookupResult, PrefixMatch
from prefixcache.rpc import cache_pb2 as pb

from .inspect import BlockReport

_NAMESPACE_ID = re.compile(r"^[0-9a-f]{16}$")
MIN_CHUNK_BYTES = 4096


# -- requests ------------------------------------------------------------------
def tokens(values, limit: int, field: str = "tokens") -> np.ndarray:
    """Token ids as int64 (no copy per element); each must be in [0, 2^32), at most `limit`."""
    array = np.array(values, dtype=np.int64)
    if len(array) > limit:
        raise InvalidArgument(field, f"{len(array)} tokens exceed the limit of {limit}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        raise InvalidArgument(field, "token ids must be integers in [0, 2^32)")
    return array


def salt(message, field: str = "cache_salt") -> str | None:
    """The salt when the field is present (present and empty is an error), else None."""
    if not message.HasField(field):
        return None
    value = getattr(message, field)
    try:
        validate_salt(value)
    except ConfigError:
        raise InvalidArgument(field, "must be 1 to 128 printable characters") from None
    return value


def namespace_id(value: str, field: str = "namespace_id") -> str:
    if not _NAMESPACE_ID.match(value):
        raise InvalidArgument(field, "must be the 16 hex digit id returned by Attach")
    return value


def optional_namespace_id(value: str) -> str | None:
    return namespace_id(value) if value else None


def positive_id(value: int, field: str) -> int:
    if value == 0:
        raise InvalidArgument(field, "is required (ids are never 0)")
    return value


def layout(message: pb.KVLayout, server_block_size: int) -> tuple[KVLayout, int]:
    """An Attach's layout: (the namespace's, in the service's blocks; the engine's block size).

    The engine's block size (0: the service's) must be a whole number of the service's blocks
    (`KVLayout.blocks_per`): the namespace stores each engine block as that many service blocks,
    so engines of other block sizes share its blocks (and its Redis keys) where prompts agree."""
    dtype = wire.dtype_of(message.dtype, "layout.dtype")
    try:
        stored = KVLayout(message.layers, message.kv_heads, message.head_dim, server_block_size, dtype)
        engine = stored.blocks_per(message.block_size, "block_size") * server_block_size
    except ConfigError as error:
        raise InvalidArgument(f"layout.{error.field}", str(error).split(": ", 1)[-1]) from None
    return stored, engine


def text(value: str, field: str, limit: int = 512, required: bool = True) -> str:
    if required and not value:
        raise InvalidArgument(field, "is required")
    if len(value) > limit or not value.isprintable():
        raise InvalidArgument(field, f"must be at most {limit} printable characters")
    return value


def chunk_bytes(value: int, default: int, maximum: int) -> int:
    """Fetch chunk size: 0 is the default; above the service's maximum it is clamped (it is a "max")."""
    if value == 0:
        return min(default, maximum)
    if value < MIN_CHUNK_BYTES:
        raise InvalidArgument("max_chunk_bytes", f"must be 0 (default) or at least {MIN_CHUNK_BYTES}")
    return min(value, maximum)


def older_than(message: pb.EvictRequest) -> float | None:
    if not message.HasField("older_than_seconds"):
        return None
    value = message.older_than_seconds
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument("older_than_seconds", "must be a finite number >= 0")
    return value


def recompute_cost(message: pb.LookupRequest) -> float | None:
    """The caller's prefill seconds per token (the Redis probe's budget), or None when absent."""
    if not message.HasField("recompute_seconds_per_token"):
        return None
    value = message.recompute_seconds_per_token
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument("recompute_seconds_per_token", "must be a finite number >= 0")
    return value


def store_header(header: pb.StoreHeader, expected: KVLayout) -> None:
    """The declared dtype and block shape must be the namespace's."""
    if header.dtype != expected.dtype.code:
        raise InvalidArgument("header.dtype", f"must be the namespace's {pb.DType.Name(expected.dtype.code)}")
    if tuple(header.block_shape) != expected.block_shape:
        raise InvalidArgument(
            "header.block_shape",
            f"{list(header.block_shape)} differs from the namespace's {list(expected.block_shape)}",
        )
    if header.block_count == 0:
        raise InvalidArgument("header.block_count", "must be at least 1")


# -- responses ------------------------------------------------------------------


def lookup_response(result: LookupResult, lease_ttl_s: float) -> pb.LookupResponse:
    response = pb.LookupResponse(
        namespace_id=result.namespace_id,
        prompt_tokens=result.prompt_tokens,
        hit_tokens=result.hit_tokens,
        miss_reason=wire.MISS_REASONS[result.miss_reason],
        lease_id=result.lease_id or 0,
        lease_ttl_seconds=lease_ttl_s,
        remote_blocks_declined=result.remote_blocks_declined,
    )
    locations = BlockLocations.of(result.locations)
    if len(locations):
        response.tiers.extend(wire.TIER_TABLE[locations.tiers].tolist())
        response.slots.extend(locations.slots.tolist())
    return response


def commit_response(result: CommitResult) -> pb.CommitResponse:
    return pb.CommitResponse(
        stored=result.stored,
        deduplicated=result.deduplicated,
        rejected=result.rejected,
        retention_seconds=result.retention_s,
        retention_clamped=result.retention_clamped,
    )


def inspect_response(ns_id: str, report: BlockReport) -> pb.InspectResponse:
    return pb.InspectResponse(
        namespace_id=ns_id,
        prompt_tokens=report.prompt_tokens,
        hit_tokens=report.hit_tokens,
        miss_reason=wire.MISS_REASONS[report.miss_reason],
        disk_blocks=report.disk_blocks,
        blocks=[
            pb.BlockInfo(
                block=b.block,
                tier=wire.TIERS[b.tier],
                slot=b.slot,
                ttl_left_seconds=b.ttl_left_s,
                last_access_age_seconds=b.last_access_age_s,
                leased=b.leased,
            )
            for b in report.blocks
        ],
    )


def match_response(result: PrefixMatch, block_bytes: int) -> pb.MatchResponse:
    return pb.MatchResponse(
        namespace_id=result.namespace_id,
        prompt_tokens=result.prompt_tokens,
        hit_tokens=result.hit_tokens,
        tiers=[
            pb.TierBlocks(tier=wire.TIERS[kind], blocks=n, bytes=n * block_bytes) for kind, n in result.blocks.items()
        ],
        remote_blocks=result.remote_blocks,
        miss_reason=wire.MISS_REASONS[result.miss_reason],
        disk_blocks=result.disk_blocks,
    )
