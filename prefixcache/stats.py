"""Counters owned by one cache, the frozen snapshot they produce, and `STATS`: the schema.

Counters only grow; rates are computed by readers from two snapshots. Label
sets are closed enums (tier, eviction reason, miss reason), never token ids,
prompts or salts.

`STATS` is the one list of what a snapshot reports: each entry's name (the
`StatsSnapshot` field), kind (counter or gauge), labels, help text, and its
spelling in each view: the proto `Stats` field, the Prometheus family and the
path in `prefixcache stats --json`. The proto conversion (wire.py), the
Prometheus export (cache_server/metrics.py), the JSON document (admin/document.py)
and the replay report (replay/service_stats.py) are derived from it, and
tests/test_stats_schema.py fails when the proto message or a view has a field
the table lacks, or the other way round.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .kinds import EvictionReason, MissReason, TierKind


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
    pins_displaced: int = 0  # operator pins released for a pin of higher priority
    retention_clamped: int = 0  # retention hints cut to their tenant's bound (the service counts)


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
    pins_displaced: int = 0
    retention_clamped: int = 0
    disk_up: bool | None = None  # None when no disk tier is configured
    disk: dict[str, float] = field(default_factory=dict)

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


class Kind(enum.Enum):
    COUNTER = "counter"  # only grows (Prometheus `_total`, `rate()` applies)
    GAUGE = "gauge"


@dataclass(frozen=True)
class Label:
    name: str  # as Prometheus and the JSON document spell it
    values: tuple[str, ...]  # the closed set, in display order ((): open, e.g. the remote tier's figures)
    complete: bool = False  # the JSON view lists every value (0 when nothing happened), not just the seen ones


TIER = Label("tier", tuple(kind.label for kind in TierKind))
EVICTION_REASON = Label("reason", tuple(reason.value for reason in EvictionReason), complete=True)
MISS_REASON = Label("reason", tuple(reason.value for reason in MissReason), complete=True)


@dataclass(frozen=True)
class Stat:
    """One reported figure: a scalar, or with `labels` a dict (two labels: a dict of dicts)."""

    name: str  # the StatsSnapshot field
    kind: Kind
    help: str
    labels: tuple[Label, ...] = ()
    proto: str = ""  # the pb.Stats field, when spelled otherwise than `name`
    metric: str | None = ""  # the Prometheus family after `prefixcache_` ("": `name`; None: not exported)
    json: str | None = None  # dotted path in the `stats --json` document (None: not in it)
    optional: bool = False  # may be None (not set in the proto, no sample in Prometheus)

    @property
    def proto_field(self) -> str:
        return self.proto or self.name

    @property
    def metric_name(self) -> str | None:
        return self.name if self.metric == "" else self.metric


C, G = Kind.COUNTER, Kind.GAUGE
STATS: tuple[Stat, ...] = (
    Stat(
        "uptime_s",
        G,
        "Seconds since the cache was created",
        proto="uptime_seconds",
        metric="uptime_seconds",
        json="uptime_seconds",
    ),
    Stat("lookups", C, "Lookups served", json="requests.lookups"),
    Stat("request_hits", C, "Lookups that matched at least one block", json="requests.hits"),
    Stat("request_misses", C, "Lookups that matched nothing", json="requests.misses"),
    Stat("block_hits", C, "Full blocks found", json="blocks.hits"),
    Stat("block_misses", C, "Full blocks not found", json="blocks.misses"),
    # The same count as tokens_saved, which is what Prometheus exports.
    Stat("token_hits", C, "Prompt tokens found in the cache", metric=None, json="tokens.hits"),
    Stat("tokens_looked_up", C, "Prompt tokens looked up", json="tokens.looked_up"),
    Stat("tokens_saved", C, "Prompt tokens served from the cache", json="tokens.saved"),
    Stat("blocks_committed", C, "New blocks stored", json="blocks.committed"),
    Stat("blocks_deduplicated", C, "Blocks committed that were already cached", json="blocks.deduplicated"),
    Stat("active_leases", G, "Leases held by workers", json="active_leases"),
    Stat("tiers", G, "Per local tier: see TIER_STATS", (TIER,), metric=None, json="tiers"),
    Stat("spills", C, "Blocks moved down from a tier", (TIER,), json="spills.by_tier"),
    Stat("spills_dropped", C, "Blocks that could not be queued for the remote tier", json="spills.dropped"),
    Stat("promotions", C, "Blocks moved up into a tier", (TIER,), json="promotions"),
    Stat("evictions", C, "Blocks evicted", (TIER, EVICTION_REASON), json="evictions.by_tier"),
    Stat("miss_reasons", C, "Why lookups stopped", (MISS_REASON,), json="miss_reasons"),
    # None without a remote tier: then neither the proto field nor the gauge is set.
    Stat("remote_up", G, "1 while the remote tier answers", json="redis.up", optional=True),
    # The remote tier's own figures (link estimates, probe counts); Prometheus gets them from
    # the tier itself, with their own names (RemoteCollector).
    Stat("remote", G, "The remote tier's figures by name", (Label("name", ()),), metric=None, json="redis.stats"),
    Stat("pins_displaced", C, "Operator pins released for a pin of higher priority", json="pins.displaced"),
    Stat("retention_clamped", C, "Retention hints cut to the tenant's bound", json="retention.clamped"),
    # The disk tier: whether it is on (None without one) and its own figures (DiskStats), which
    # Prometheus gets from the tier itself (DiskCollector: prefixcache_disk_*).
    Stat("disk_up", G, "1 while the disk tier is on", metric=None, json="disk.up", optional=True),
    Stat("disk", G, "The disk tier's figures by name", (Label("name", ()),), metric=None, json="disk.stats"),
)

PER_TIER = next(stat for stat in STATS if stat.name == "tiers")

# The fields of each `tiers` row (TierSnapshot, pb.TierStats, JSON `tiers.<tier>.<field>`): gauges by tier.
TIER_STATS: tuple[Stat, ...] = (
    Stat("blocks", G, "Blocks resident", (TIER,), metric="tier_blocks"),
    Stat("bytes_used", G, "Bytes used", (TIER,), metric="tier_bytes"),
    Stat("capacity_bytes", G, "Byte budget", (TIER,), metric="tier_capacity_bytes"),
)


def empty_snapshot() -> StatsSnapshot:
    """A snapshot of nothing (what a view shows before the cache exists)."""
    values: dict[str, Any] = {}
    for stat in STATS:
        values[stat.name] = None if stat.optional else () if stat is PER_TIER else {} if stat.labels else 0
    return StatsSnapshot(**values)


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
    disk_up: bool | None = None,
    disk: dict[str, float] | None = None,
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
        pins_displaced=c.pins_displaced,
        retention_clamped=c.retention_clamped,
        disk_up=disk_up,
        disk=disk or {},
    )


__all__ = [
    "STATS",
    "TIER_STATS",
    "PER_TIER",
    "empty_snapshot",
    "Counters",
    "Kind",
    "Label",
    "Stat",
    "StatsSnapshot",
    "TierSnapshot",
    "snapshot_of",
]
