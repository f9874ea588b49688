"""Counters owned by one cache and the frozen snapshot they produce.

Counters only grow; rates are computed by readers from two snapshots. Label
sets are closed enums (tier, eviction reason, miss reason), never token ids,
prompts or salts.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from .index import MissReason
from .tiers.base import TierKind


class EvictionReason(enum.Enum):
    LRU = "lru"  # chosen by LRU order to make room in a full tier
    TTL = "ttl"  # its sliding time-to-live ran out
    CAPACITY = "capacity"  # dropped because the tenant's quota in that tier was full
    MANUAL = "manual"  # an Evict or Flush call


@dataclass
class Counters:
    """Mutable counters; only the owning cache writes them."""

    lookups: int = 0
    request_hits: int = 0
    request_misses: int = 0
    block_hits: int = 0
    block_misses: int = 0
    token_hits: int = 0
    tokens_looked_up: int = 0
    blocks_committed: int = 0
    blocks_deduplicated: int = 0
    spills: Counter[TierKind] = field(default_factory=Counter)  # TierKind -> blocks moved down
    spills_dropped: int = 0
    promotions: Counter[TierKind] = field(default_factory=Counter)  # TierKind (destination) -> blocks
    evictions: Counter[tuple[TierKind, EvictionReason]] = field(
        default_factory=Counter
    )  # (TierKind, EvictionReason) -> blocks
    miss_reasons: Counter[MissReason] = field(default_factory=Counter)  # MissReason -> requests
    remote_integrity_failures: int = 0


@dataclass(frozen=True)
class TierSnapshot:
    kind: TierKind
    blocks: int
    bytes_used: int
    capacity_bytes: int


@dataclass(frozen=True)
class StatsSnapshot:
    """Everything `GetStats` reports, at one instant."""

    uptime_s: float
    lookups: int
    request_hits: int
    request_misses: int
    block_hits: int
    block_misses: int
    token_hits: int
    tokens_looked_up: int
    tokens_saved: int
    blocks_committed: int
    blocks_deduplicated: int
    active_leases: int
    tiers: tuple[TierSnapshot, ...]
    spills: dict[str, int]
    spills_dropped: int
    promotions: dict[str, int]
    evictions: dict[str, dict[str, int]]  # tier -> reason -> blocks
    miss_reasons: dict[str, int]
    remote_up: bool | None  # None when no remote tier is configured
    remote: dict[str, float] = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens_looked_up if self.tokens_looked_up else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.request_hits / self.lookups if self.lookups else 0.0

    @property
    def block_hit_rate(self) -> float:
        total = self.block_hits + self.block_misses
        return self.block_hits / total if total else 0.0


def snapshot_of(
    counters: Counters,
    *,
    uptime_s: float,
    active_leases: int,
    tiers: tuple[TierSnapshot, ...],
    spills_dropped: int,
    remote_up: bool | None,
    remote: dict[str, float],
    moves: bool = True,
) -> StatsSnapshot:
    """The snapshot of `counters` (the whole cache's, or one tenant's: `moves=False` leaves out
    spills and promotions, which are not counted per tenant). The one place that maps counters
    to snapshot fields."""
    c = counters
    evictions: dict[str, dict[str, int]] = {}
    for (tier, reason), count in c.evictions.items():
        evictions.setdefault(tier.label, {})[reason.value] = count
    return StatsSnapshot(
        uptime_s=uptime_s,
        lookups=c.lookups,
        request_hits=c.request_hits,
        request_misses=c.request_misses,
        block_hits=c.block_hits,
        block_misses=c.block_misses,
        token_hits=c.token_hits,
        tokens_looked_up=c.tokens_looked_up,
        tokens_saved=c.token_hits,
        blocks_committed=c.blocks_committed,
        blocks_deduplicated=c.blocks_deduplicated,
        active_leases=active_leases,
        tiers=tiers,
        spills={tier.label: n for tier, n in c.spills.items()} if moves else {},
        spills_dropped=spills_dropped,
        promotions={tier.label: n for tier, n in c.promotions.items()} if moves else {},
        evictions=evictions,
        miss_reasons={reason.value: n for reason, n in c.miss_reasons.items()},
        remote_up=remote_up,
        remote=remote,
    )


__all__ = ["Counters", "EvictionReason", "MissReason", "StatsSnapshot", "TierSnapshot", "snapshot_of"]
