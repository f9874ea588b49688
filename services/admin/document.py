"""The stable JSON document of `prefixcache stats --json` (schema in docs/cli.md).

Owns the mapping from the service's `GetStats` answer to plain JSON values.
The table view and `top` read this same document, so what they show can never
disagree with what a script reads.

Invariants (what "stable" means, version `SCHEMA_VERSION`):
- Every key below is always present, ready or not; closed sets (eviction
  reasons, miss reasons) list every member, with 0 when nothing happened.
- Tiers are keyed by name in order device, host; only tiers the service has
  configured appear (the Redis tier is reported under "redis", not "tiers").
- A ratio whose denominator is 0 is null, never 0 (no lookups is not a 0 % hit rate).
- Adding keys keeps the version; renaming, removing or retyping one bumps it.
"""

from __future__ import annotations

from prefixcache.client import ServiceStats
from prefixcache.index import MissReason
from prefixcache.stats import EvictionReason, StatsSnapshot
from prefixcache.tiers.base import TierKind

SCHEMA_VERSION = 1
EVICTION_REASONS = tuple(reason.value for reason in EvictionReason)
MISS_REASONS = tuple(reason.value for reason in MissReason)
TIER_NAMES = tuple(kind.label for kind in TierKind)


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _empty_snapshot() -> StatsSnapshot:
    return StatsSnapshot(
        uptime_s=0.0,
        lookups=0,
        request_hits=0,
        request_misses=0,
        block_hits=0,
        block_misses=0,
        token_hits=0,
        tokens_looked_up=0,
        tokens_saved=0,
        blocks_committed=0,
        blocks_deduplicated=0,
        active_leases=0,
        tiers=(),
        spills={},
        spills_dropped=0,
        promotions={},
        evictions={},
        miss_reasons={},
        remote_up=None,
        remote={},
    )


def _tiers(s: StatsSnapshot) -> dict[str, dict]:
    ordered = sorted(s.tiers, key=lambda tier: tier.kind)
    return {
        tier.kind.label: {
            "blocks": tier.blocks,
            "bytes_used": tier.bytes_used,
            "capacity_bytes": tier.capacity_bytes,
            "utilization": ratio(tier.bytes_used, tier.capacity_bytes),
        }
        for tier in ordered
    }


def _evictions(s: StatsSnapshot) -> dict:
    by_tier = {
        tier: {reason: int(s.evictions.get(tier, {}).get(reason, 0)) for reason in EVICTION_REASONS}
        for tier in TIER_NAMES
        if tier in s.evictions
    }
    by_reason = {reason: sum(counts[reason] for counts in by_tier.values()) for reason in EVICTION_REASONS}
    return {"total": sum(by_reason.values()), "by_reason": by_reason, "by_tier": by_tier}


def _redis(s: StatsSnapshot) -> dict:
    if s.remote_up is None:
        return {"configured": False, "state": "absent", "up": None, "stats": {}}
    return {
        "configured": True,
        "state": "up" if s.remote_up else "down",
        "up": s.remote_up,
        "stats": {name: s.remote[name] for name in sorted(s.remote)},
    }


def stats_document(stats: ServiceStats, address: str) -> dict:
    """The `stats --json` document of one `GetStats` answer."""
    s = stats.snapshot if stats.snapshot is not None else _empty_snapshot()
    layout = stats.layout
    return {
        "schema_version": SCHEMA_VERSION,
        "address": address,
        "ready": stats.ready,
        "uptime_seconds": s.uptime_s,
        "layout": None
        if layout is None
        else {
            "layers": layout.layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": layout.dtype.value,
            "block_bytes": layout.block_bytes,
            "bytes_per_token": layout.bytes_per_token,
        },
        "requests": {
            "lookups": s.lookups,
            "hits": s.request_hits,
            "misses": s.request_misses,
            "hit_rate": ratio(s.request_hits, s.lookups),
        },
        "blocks": {
            "hits": s.block_hits,
            "misses": s.block_misses,
            "hit_rate": ratio(s.block_hits, s.block_hits + s.block_misses),
            "committed": s.blocks_committed,
            "deduplicated": s.blocks_deduplicated,
        },
        "tokens": {
            "looked_up": s.tokens_looked_up,
            "hits": s.token_hits,
            "saved": s.tokens_saved,
            "hit_rate": ratio(s.token_hits, s.tokens_looked_up),
        },
        "tiers": _tiers(s),
        "spills": {
            "by_tier": {tier: int(s.spills[tier]) for tier in TIER_NAMES if tier in s.spills},
            "dropped": s.spills_dropped,
        },
        "promotions": {tier: int(s.promotions[tier]) for tier in TIER_NAMES if tier in s.promotions},
        "evictions": _evictions(s),
        "miss_reasons": {reason: int(s.miss_reasons.get(reason, 0)) for reason in MISS_REASONS},
        "redis": _redis(s),
        "active_leases": s.active_leases,
    }
