"""One stats schema (`prefixcache.stats.STATS`): the proto message and every view agree with it.

Each test fails when one side gains a field the others lack: the `StatsSnapshot` dataclass, the
proto `Stats` / `TierStats` messages, the Prometheus families, the `stats --json` document and
the replay report's counters. A snapshot with every field set survives the proto both ways.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from prefixcache.config import DType, KVLayout
from prefixcache.kinds import TierKind
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.stats import STATS, TIER_STATS, Kind, StatsSnapshot, TierSnapshot, empty_snapshot
from prefixcache.wire import ServiceStats, stats_message, stats_of
from prefixcache_services.admin.document import DERIVED, stats_document
from prefixcache_services.cache_server.metrics import PREFIX, StatsCollector
from prefixcache_services.replay.service_stats import delta_dict, snapshot_dict

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=DType.BFLOAT16)


def full_snapshot(remote_up: bool | None = True) -> StatsSnapshot:
    """Every field set to a distinct non-zero value (labelled ones with several keys)."""
    return StatsSnapshot(
        uptime_s=12.5,
        lookups=10,
        request_hits=7,
        request_misses=3,
        block_hits=40,
        block_misses=9,
        token_hits=160,
        tokens_looked_up=220,
        tokens_saved=160,
        blocks_committed=30,
        blocks_deduplicated=4,
        active_leases=2,
        tiers=(TierSnapshot(TierKind.DEVICE, 3, 3 << 10, 8 << 10), TierSnapshot(TierKind.HOST, 11, 11 << 10, 64 << 10)),
        spills={"device": 5, "host": 6},
        spills_dropped=1,
        promotions={"device": 2, "redis": 8},
        evictions={"device": {"lru": 5}, "host": {"ttl": 2, "capacity": 1}},
        miss_reasons={"not_cached": 2, "expired": 1},
        remote_up=remote_up,
        remote={"link_latency_s": 0.0005, "probes_declined": 3.0},
        pins_displaced=2,
        retention_clamped=1,
        disk_up=remote_up,
        disk={"blocks": 48.0, "pinned_blocks": 16.0, "restore_s": 0.25},
    )


def test_the_table_is_the_snapshot_and_the_proto_message():
    assert [stat.name for stat in STATS] == [f.name for f in dataclasses.fields(StatsSnapshot)]
    assert [stat.name for stat in TIER_STATS] == [f.name for f in dataclasses.fields(TierSnapshot) if f.name != "kind"]
    proto = {f.name for f in pb.Stats.DESCRIPTOR.fields} - {
        "ready",
        "layout",
        "attach_refusals",
    }  # the frame; the service's own
    assert proto == {stat.proto_field for stat in STATS}
    assert {f.name for f in pb.TierStats.DESCRIPTOR.fields} - {"tier"} == {stat.name for stat in TIER_STATS}
    assert len({stat.metric_name for stat in STATS + TIER_STATS if stat.metric_name}) == len(
        [stat for stat in STATS + TIER_STATS if stat.metric_name]
    )


@pytest.mark.parametrize("remote_up", [True, False, None])
def test_proto_round_trip_keeps_every_field(remote_up):
    snapshot = full_snapshot(remote_up)
    message = stats_message(snapshot, LAYOUT)
    assert message.HasField("remote_up") is (remote_up is not None)
    assert message.HasField("disk_up") is (remote_up is not None)
    assert stats_of(pb.Stats.FromString(message.SerializeToString())) == ServiceStats(True, LAYOUT, snapshot)
    assert stats_of(stats_message(None, None)) == ServiceStats(False, None, None)


def _families(snapshot: StatsSnapshot | None) -> dict[str, object]:
    return {family.name: family for family in StatsCollector(lambda: snapshot).collect()}


def test_prometheus_exports_each_stat_once_with_its_kind_and_labels():
    families = _families(full_snapshot())
    expected = {f"{PREFIX}_ready"} | {f"{PREFIX}_{s.metric_name}" for s in STATS + TIER_STATS if s.metric_name}
    assert set(families) == expected
    for stat in STATS + TIER_STATS:
        if stat.metric_name is None:
            continue
        family = families[f"{PREFIX}_{stat.metric_name}"]
        assert family.type == stat.kind.value
        for sample in family.samples:
            assert set(sample.labels) == {label.name for label in stat.labels}
    lookups = families[f"{PREFIX}_lookups"].samples
    assert [(s.name, s.value) for s in lookups] == [("prefixcache_lookups_total", 10.0)]
    evictions = {(s.labels["tier"], s.labels["reason"]): s.value for s in families[f"{PREFIX}_evictions"].samples}
    assert evictions == {("device", "lru"): 5, ("host", "ttl"): 2, ("host", "capacity"): 1}
    assert f"{PREFIX}_remote_up" not in _families(full_snapshot(None))
    assert set(_families(None)) == {f"{PREFIX}_ready"}


def test_a_registry_scrape_names_only_stats():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(full_snapshot))
    counters = {m.name for m in registry.collect() if m.type == "counter"}
    assert counters == {f"{PREFIX}_{s.metric_name}" for s in STATS if s.metric_name and s.kind is Kind.COUNTER}


def _leaves(doc: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{path}.")
        else:
            out.add(path)
    return out


def _covered(path: str, roots: set[str]) -> bool:
    """`path` is one of `roots` or lies below one (`*` stands for any one key)."""
    parts = path.split(".")
    for root in roots:
        pattern = root.split(".")
        if len(parts) >= len(pattern) and all(p in ("*", q) for p, q in zip(pattern, parts)):
            return True
    return False


@pytest.mark.parametrize("ready", [True, False])
def test_json_document_is_the_stats_plus_what_is_derived(ready):
    snapshot = full_snapshot() if ready else None
    doc = stats_document(ServiceStats(ready, LAYOUT if ready else None, snapshot), "127.0.0.1:1")
    placed = {stat.json for stat in STATS if stat.json}
    for path in placed | {d for d in DERIVED if "*" not in d}:  # all there, ready or not
        node = doc
        for key in path.split("."):
            node = node[key]
    stray = {leaf for leaf in _leaves(doc) if not _covered(leaf, placed | DERIVED)}
    assert not stray, f"document keys no Stat places and DERIVED does not list: {stray}"
    if ready:
        assert doc["tiers"]["host"] == {"blocks": 11, "bytes_used": 11 << 10, "capacity_bytes": 64 << 10,
                                        "utilization": pytest.approx(11 / 64)}  # fmt: skip
        assert doc["evictions"]["by_tier"]["host"] == {"lru": 0, "ttl": 2, "capacity": 1, "manual": 0}
        assert doc["evictions"]["total"] == 8 and doc["redis"]["stats"]["probes_declined"] == 3.0
        assert doc["disk"] == {
            "configured": True,
            "state": "up",
            "up": True,
            "stats": {"blocks": 48.0, "pinned_blocks": 16.0, "restore_s": 0.25},
        }
        assert doc["miss_reasons"]["verification_failed"] == 0 and doc["tokens"]["saved"] == 160


def test_replay_report_counters_are_the_schema_counters():
    counters = {s.name for s in STATS if s.kind is Kind.COUNTER}
    before, after = empty_snapshot(), full_snapshot()
    delta = delta_dict(before, after)
    assert set(delta) - {"token_hit_rate"} == counters
    at_end = snapshot_dict(after)
    assert set(at_end) - {"token_hit_rate", "block_hit_rate", "request_hit_rate"} == {s.name for s in STATS} - {
        "remote",
        "disk",
    }
