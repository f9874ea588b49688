"""The operator CLI's pure parts: the stats document, top's ring buffer, token files, checks.

No service here (tests/test_cli.py drives the commands against a real one); these pin the
arithmetic and the schema's stability rules exactly.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from prefixcache.client import ServiceStats
from prefixcache.config import KVLayout
from prefixcache.kinds import TierKind
from prefixcache.stats import StatsSnapshot, TierSnapshot
from prefixcache_services.admin.connect import AdminError, check_address
from prefixcache_services.admin.document import stats_document
from prefixcache_services.admin.prompt import WorkerIdentity, check_layout, read_tokens_file
from prefixcache_services.admin.stats_view import stats_view
from prefixcache_services.admin.top_model import TopModel
from prefixcache_services.admin.top_view import top_frame

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(4, 2, 32, 16, "bfloat16")


def snapshot(
    uptime: float = 10.0,
    lookups: int = 0,
    hits: int = 0,
    tokens: int = 0,
    saved: int = 0,
    evictions: dict | None = None,
    spills: dict | None = None,
    disk: dict | None = None,
) -> StatsSnapshot:
    return StatsSnapshot(
        uptime_s=uptime,
        lookups=lookups,
        request_hits=hits,
        request_misses=lookups - hits,
        block_hits=saved // 16,
        block_misses=0,
        token_hits=saved,
        tokens_looked_up=tokens,
        tokens_saved=saved,
        blocks_committed=0,
        blocks_deduplicated=0,
        active_leases=0,
        tiers=(TierSnapshot(TierKind.HOST, 4, 4 * 16384, 1 << 20),),
        spills=spills or {},
        spills_dropped=0,
        promotions={},
        evictions=evictions or {},
        miss_reasons={},
        remote_up=None,
        disk_up=None if disk is None else True,
        disk=disk or {},
    )


def doc(**fields) -> dict:
    return stats_document(ServiceStats(True, LAYOUT, snapshot(**fields)), "127.0.0.1:1")


def test_the_document_keeps_every_key_before_the_cache_exists():
    ready = doc(lookups=4, hits=3, tokens=100, saved=48, evictions={"host": {"lru": 2}})
    empty = stats_document(ServiceStats(False, None, None), "127.0.0.1:1")

    def shape(value):
        return {k: shape(v) for k, v in value.items()} if isinstance(value, dict) else None

    skip = {"tiers", "layout", "evictions", "spills", "promotions", "redis", "disk"}  # maps keyed by what exists
    assert {k: v for k, v in shape(empty).items() if k not in skip} == {
        k: v for k, v in shape(ready).items() if k not in skip
    }
    assert empty["requests"]["hit_rate"] is None and empty["tokens"]["hit_rate"] is None  # 0/0 is not 0 %
    assert empty["evictions"] == {
        "total": 0,
        "by_reason": {"lru": 0, "ttl": 0, "capacity": 0, "manual": 0},
        "by_tier": {},
    }
    assert ready["requests"]["hit_rate"] == 0.75 and ready["tokens"]["hit_rate"] == 0.48
    assert ready["evictions"]["by_tier"] == {"host": {"lru": 2, "ttl": 0, "capacity": 0, "manual": 0}}
    assert ready["tiers"]["host"]["utilization"] == 4 * 16384 / (1 << 20)
    assert ready["redis"] == {"configured": False, "state": "absent", "up": None, "stats": {}}
    assert ready["disk"] == {"configured": False, "state": "absent", "up": None, "stats": {}}


def test_the_disk_tier_shows_in_the_stats_table_and_in_top():
    figures = {"blocks": 48.0, "used_bytes": 6.5e6, "capacity_bytes": 128e6, "hits": 32.0, "pinned_blocks": 16.0}
    with_disk = doc(disk=figures)
    assert with_disk["disk"] == {"configured": True, "state": "up", "up": True, "stats": dict(sorted(figures.items()))}
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(stats_view(with_disk))
    text = console.export_text()
    assert "disk tier" in text and "pinned blocks" in text and "disk" in text.split("evictions")[0]  # a tiers row
    model = TopModel(window_s=60)
    model.add(with_disk, at=0.0)
    console.print(top_frame(model, "127.0.0.1:1", 1.0, None, False))
    assert "6.2 MiB / 122.1 MiB (5.1%" in console.export_text()  # top's tier occupancy


def test_top_rates_come_from_the_last_two_snapshots():
    model = TopModel(window_s=60)
    model.add(doc(lookups=10, tokens=1000, saved=400), at=0.0)
    assert model.rates()["lookups/s"] is None  # one snapshot: no rate yet
    model.add(doc(lookups=30, tokens=3000, saved=1400, spills={"host": 8}), at=2.0)
    rates = model.rates()
    assert rates["lookups/s"] == 10.0 and rates["tokens saved/s"] == 500.0 and rates["spills/s"] == 4.0


def test_top_window_spans_a_minute_and_drops_older_snapshots():
    model = TopModel(window_s=60)
    for second in range(0, 121, 10):  # 10 lookups/s, the first 60 s all misses, then all hits
        hits = max(0, second - 60)
        model.add(
            doc(uptime=10.0 + second, lookups=second, hits=hits, tokens=second * 10, saved=hits * 10), at=float(second)
        )
    window = model.window()
    assert window["seconds"] == 60.0  # base = the newest snapshot at least a minute old
    assert window["request_hit_rate"] == 1.0 and window["token_hit_rate"] == 1.0
    assert model.latest["requests"]["hit_rate"] == 0.5  # since start


def test_top_resets_when_the_cache_restarts_and_records_eviction_increases():
    model = TopModel(window_s=60, max_events=3)
    model.add(doc(uptime=100.0, evictions={"host": {"lru": 5}}), at=0.0, wall_time=1000.0)
    model.add(doc(uptime=101.0, evictions={"host": {"lru": 7, "manual": 3}}), at=1.0, wall_time=1001.0)
    assert [(e.tier, e.reason, e.blocks) for e in model.events] == [("host", "manual", 3), ("host", "lru", 2)]
    model.add(doc(uptime=1.0, lookups=5), at=2.0, wall_time=1002.0)  # uptime went back: a new cache
    assert model.rates()["lookups/s"] is None and len(model.events) == 2  # no rate across the reset


@pytest.mark.parametrize("text, tokens", [("[1, 2, 3]", [1, 2, 3]), ("1, 2 ,3\n4", [1, 2, 3, 4]), ("", [])])
def test_token_files_accept_json_or_separated_ints(tmp_path, text, tokens):
    path = tmp_path / "t"
    path.write_text(text)
    assert read_tokens_file(str(path)) == tokens


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2.0]", "item 1 is 2.0"),
        ('["1"]', "a JSON list of ints"),
        ("1 -2", "item 1 is '-2'"),
        ("[1,", "invalid JSON"),
    ],
)
def test_token_files_name_the_bad_item(tmp_path, text, message):
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(AdminError, match=message):
        read_tokens_file(str(path))


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "cache.internal:1", "[::1]:50051", " host:9 "])
def test_addresses_that_are_accepted(address):
    assert check_address(address) == address.strip()


@pytest.mark.parametrize("address", ["host", "host:0", "host:65536", ":50051", "a b:1", "::1:50051", "host:port"])
def test_addresses_that_are_refused_name_the_flag(address):
    with pytest.raises(AdminError, match=r"^--cache: expected HOST:PORT"):
        check_address(address)


def test_a_layout_mismatch_names_both_layouts():
    args = SimpleNamespace(model="tiny", dtype="float32", block_size=16)
    identity = WorkerIdentity("prefixcache-tiny-llama", "0" * 64, KVLayout(4, 2, 32, 16, "float32"))
    check_layout(KVLayout(4, 2, 32, 16, "float32"), identity, args)  # equal: no error
    check_layout(None, identity, args)  # a cache without a layout yet: nothing to compare
    with pytest.raises(
        AdminError,
        match=r"holds KV of layout \(4 layers x 2 kv heads x 32, bfloat16, block 16\) "
        r"but --model tiny --dtype float32 .* gives .*float32",
    ):
        check_layout(LAYOUT, identity, args)
