"""The cache service's own counters, for the replay report's `service_stats` section.

Owns: reading the service's GetStats before and after a replay and turning the two
snapshots into plain JSON data: the counters at the end, and what changed during the run
(lookups, hits, tokens saved, commits, evictions per tier and reason, spills, promotions).

Invariants:
- the section is plain JSON (str keys; ints, floats, bools, None) so `Report.to_json` needs no
  special cases;
- `during_run` is `after - before` for every counter (counters only grow), so traffic from
  before the replay is not credited to it; it is None when the service had no cache yet
  before the run (no Attach), in which case `at_end` is the whole run;
- reading stats never changes the service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixcache.client import CacheClient, ServiceStats
from prefixcache.stats import STATS, Kind, StatsSnapshot

# Counters (they only grow, so a run's share is a difference), from the one schema.
_COUNTERS = tuple(stat.name for stat in STATS if stat.kind is Kind.COUNTER and not stat.labels)
_MAPS = tuple(stat.name for stat in STATS if stat.kind is Kind.COUNTER and len(stat.labels) == 1)


def fetch_stats(address: str, auth_token: str | None = None, timeout_s: float = 5.0) -> ServiceStats:
    """One GetStats call (raises the client's PrefixCacheError when the service is unreachable)."""
    with CacheClient(address, auth_token=auth_token, timeout_s=timeout_s) as client:
        return client.stats()


def snapshot_dict(s: StatsSnapshot) -> dict[str, Any]:
    """Every counter of a snapshot as plain data, plus the derived hit rates."""
    out: dict[str, Any] = {name: getattr(s, name) for name in _COUNTERS}
    out.update({name: dict(getattr(s, name)) for name in _MAPS})
    out["evictions"] = {tier: dict(reasons) for tier, reasons in s.evictions.items()}
    out["uptime_s"] = s.uptime_s
    out["active_leases"] = s.active_leases
    out["tiers"] = {
        t.kind.label: {"blocks": t.blocks, "bytes_used": t.bytes_used, "capacity_bytes": t.capacity_bytes}
        for t in s.tiers
    }
    out["remote_up"] = s.remote_up
    out["disk_up"] = s.disk_up
    out["token_hit_rate"] = s.token_hit_rate
    out["block_hit_rate"] = s.block_hit_rate
    out["request_hit_rate"] = s.request_hit_rate
    return out


def _map_delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def delta_dict(before: StatsSnapshot, after: StatsSnapshot) -> dict[str, Any]:
    """Counter increments between two snapshots of the same service."""
    out: dict[str, Any] = {name: getattr(after, name) - getattr(before, name) for name in _COUNTERS}
    out.update({name: _map_delta(getattr(after, name), getattr(before, name)) for name in _MAPS})
    out["evictions"] = {
        tier: _map_delta(reasons, before.evictions.get(tier, {})) for tier, reasons in after.evictions.items()
    }
    looked_up = out["tokens_looked_up"]
    out["token_hit_rate"] = out["token_hits"] / looked_up if looked_up else None
    return out


def stats_section(address: str, before: ServiceStats | None, after: ServiceStats) -> dict[str, Any]:
    """The report's `service_stats`: where from, the counters at the end, the run's increments."""
    end = after.snapshot
    start = before.snapshot if before is not None else None
    return {
        "address": address,
        "ready": after.ready,
        "at_end": snapshot_dict(end) if end is not None else None,
        "during_run": delta_dict(start, end) if start is not None and end is not None else None,
    }
