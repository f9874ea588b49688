"""The stable JSON document of `prefixcache stats --json` (schema in docs/cli.md).

Owns the mapping from the service's `GetStats` answer to plain JSON values.
The table view and `top` read this same document, so what they show can never
disagree with what a script reads.

Invariants (what "stable" means, version `SCHEMA_VERSION`):
- Every key below is always present, ready or not; closed sets (eviction
  reasons, miss reasons) list every member, with 0 when nothing happened.
- Tiers are keyed by name in order device, host; only tiers the service has
  configured appear (the Redis and disk tiers are reported under "redis" and "disk", not "tiers").
- A ratio whose denominator is 0 is null, never 0 (no lookups is not a 0 % hit rate).
- Adding keys keeps the version; renaming, removing or retyping one bumps it.
"""

from __future__ import annotations

from typing import Any

from prefixcache.client import ServiceStats
from prefixcache.kinds import EvictionReason
from prefixcache.stats import PER_TIER, STATS, TIER_STATS, Label, Stat, TierSnapshot, empty_snapshot

SCHEMA_VERSION = 1
EVICTION_REASONS = tuple(reason.value for reason in EvictionReason)


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _json_of(stat: Stat, value: Any) -> Any:
    """A stat's value as the document shows it: dicts keyed in the label's order, every value of
    a `complete` label present (0 when nothing happened), an open label's keys sorted."""
    if stat is PER_TIER:
        return _tiers(value)
    return _keyed(value, stat.labels) if stat.labels else value


def _keyed(value: Any, labels: tuple[Label, ...]) -> Any:
    if not labels:
        return value
    label, rest = labels[0], labels[1:]
    keys = (
        sorted(value)
        if not label.values
        else label.values
        if label.complete
        else [k for k in label.values if k in value]
    )
    return {key: _keyed(value.get(key, {} if rest else 0), rest) for key in keys}


def _tiers(tiers: tuple[TierSnapshot, ...]) -> dict[str, dict]:
    rows = {}
    for tier in sorted(tiers, key=lambda t: t.kind):
        row: dict[str, Any] = {stat.name: getattr(tier, stat.name) for stat in TIER_STATS}
        row["utilization"] = ratio(tier.bytes_used, tier.capacity_bytes)
        rows[tier.kind.label] = row
    return rows


def _put(doc: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        doc = doc.setdefault(key, {})
    doc[leaf] = value


def stats_document(stats: ServiceStats, address: str) -> dict:
    """The `stats --json` document of one `GetStats` answer: each stat at its `Stat.json` path,
    then what is derived from them (ratios, totals, the Redis state)."""
    s = stats.snapshot if stats.snapshot is not None else empty_snapshot()
    layout = stats.layout
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "address": address,
        "ready": stats.ready,
        "uptime_seconds": None,
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
        "attach_refusals": dict(sorted(stats.attach_refusals.items())),
    }
    for stat in STATS:
        if stat.json is not None:
            _put(doc, stat.json, _json_of(stat, getattr(s, stat.name)))
    requests, blocks, tokens = doc["requests"], doc["blocks"], doc["tokens"]
    requests["hit_rate"] = ratio(requests["hits"], requests["lookups"])
    blocks["hit_rate"] = ratio(blocks["hits"], blocks["hits"] + blocks["misses"])
    tokens["hit_rate"] = ratio(tokens["hits"], tokens["looked_up"])
    evictions = doc["evictions"]
    by_reason = {reason: sum(counts[reason] for counts in evictions["by_tier"].values()) for reason in EVICTION_REASONS}
    evictions.update(total=sum(by_reason.values()), by_reason=by_reason)
    redis = doc["redis"]
    redis["configured"] = s.remote_up is not None
    redis["state"] = "absent" if s.remote_up is None else "up" if s.remote_up else "down"
    disk = doc["disk"]
    disk["configured"] = s.disk_up is not None
    disk["state"] = "absent" if s.disk_up is None else "up" if s.disk_up else "off"
    return doc


# Keys of the document that no `Stat` places: the rest is derived from the stats (the schema test
# checks that every key is one or the other).
DERIVED = frozenset(
    {
        "schema_version",
        "address",
        "ready",
        "layout",
        "attach_refusals",
        "requests.hit_rate",
        "blocks.hit_rate",
        "tokens.hit_rate",
        "tiers.*.utilization",
        "evictions.total",
        "evictions.by_reason",
        "redis.configured",
        "redis.state",
        "disk.configured",
        "disk.state",
    }
)
