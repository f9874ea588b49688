"""Tiers under the cache: device(cpu) <-> host spill and promotion byte-exact in every dtype,
leased blocks never move, the host segment is mappable by another process (owner-only), exact
byte budgets, and config validation."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from prefixcache.config import CacheConfig, DType, KVLayout, Namespace, parse_duration, parse_size
from prefixcache.errors import ConfigError
from prefixcache.kinds import TierKind
from prefixcache.results import BlockLocations
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.host import HostTier, MappedSegment
from prefixcache.tiers.shm import PAGE
from tests.support.core import (
    TINY,
    ManualClock,
    assert_consistent,
    block_hashes,
    kv_for,
    make_cache,
    namespace,
    read_blocks,
    same_bytes,
)

pytestmark = pytest.mark.unit

BS = TINY.block_size
HOST, DEVICE = TierKind.HOST, TierKind.DEVICE


def prompt(*block_ids: int) -> list[int]:
    return [b for b in block_ids for _ in range(BS)]


def where(cache, ns: str, tokens: list[int]) -> BlockLocations:
    """Current locations of a prompt's cached blocks, read from the index without touching them."""
    nodes = [cache.index.node_of(h) for h in block_hashes(cache, ns, tokens)]
    assert None not in nodes
    return BlockLocations(cache.index.tier[nodes], cache.index.slot[nodes])


@pytest.mark.parametrize("dtype", list(DType))
def test_spill_and_promote_round_trips_are_byte_exact(dtype: DType) -> None:
    layout = replace(TINY, dtype=dtype, head_dim=3)
    clock = ManualClock()
    with make_cache(host_slots=6, device_slots=2, layout=layout, clock=clock) as cache:
        ns = cache.attach(namespace(layout))
        p, q = prompt(1, 2), prompt(3, 4)
        cache.store(ns, p, kv_for(p, layout))
        assert where(cache, ns, p).tiers.tolist() == [HOST, HOST]  # new blocks land in the host tier
        clock.advance(1)
        hit = cache.lookup(ns, p)
        assert hit.locations.tiers.tolist() == [DEVICE, DEVICE]  # promoted on hit
        assert same_bytes(read_blocks(cache, hit.locations), kv_for(p, layout))
        cache.store(ns, q, kv_for(q, layout))
        clock.advance(1)
        assert cache.lookup(ns, q).locations.tiers.tolist() == [DEVICE, DEVICE]
        assert where(cache, ns, p).tiers.tolist() == [HOST, HOST]  # p spilled, not dropped
        assert same_bytes(read_blocks(cache, where(cache, ns, p)), kv_for(p, layout))
        clock.advance(1)
        again = cache.lookup(ns, p)  # host -> device once more
        assert again.locations.tiers.tolist() == [DEVICE, DEVICE]
        assert same_bytes(read_blocks(cache, again.locations), kv_for(p, layout))
        assert same_bytes(read_blocks(cache, where(cache, ns, q)), kv_for(q, layout))
        stats = cache.stats()
        assert stats.promotions == {"device": 6}
        assert stats.spills == {"device": 4}
        assert stats.evictions == {"device": {"lru": 4}}
        assert_consistent(cache)


def test_device_spills_its_lru_block_first_and_promotion_stops_when_the_device_is_pinned_full() -> None:
    clock = ManualClock()
    with make_cache(host_slots=8, device_slots=2, clock=clock) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2, 3)
        cache.store(ns, p, kv_for(p))
        result = cache.lookup(ns, p, take_lease=True)
        # Root side first; the third block finds the device full of this path's own pinned blocks.
        assert result.locations.tiers.tolist() == [DEVICE, DEVICE, HOST]
        assert same_bytes(read_blocks(cache, cache.lease(result.lease_id).locations), kv_for(p))
        cache.release(result.lease_id)
        q = prompt(5)
        cache.store(ns, q, kv_for(q))
        clock.advance(1)
        assert cache.lookup(ns, q).locations.tiers.tolist() == [DEVICE]
        assert where(cache, ns, p).tiers.tolist() == [DEVICE, HOST, HOST]  # the deeper p1 left first
        assert_consistent(cache)


def test_a_leased_block_is_never_moved_by_another_lookup() -> None:
    """A lease holder reads its slots directly, so promotion must leave leased blocks in place."""
    clock = ManualClock()
    with make_cache(host_slots=6, device_slots=1, clock=clock) as cache:
        ns = cache.attach(namespace())
        y, p = prompt(7), prompt(1)
        cache.store(ns, y, kv_for(y))
        blocker = cache.lookup(ns, y, take_lease=True)  # y on the device, pinned
        cache.store(ns, p, kv_for(p))
        leased = cache.lookup(ns, p, take_lease=True)  # no room: p stays on the host
        assert leased.locations.tiers.tolist() == [HOST]
        cache.release(blocker.lease_id)
        clock.advance(1)
        other = cache.lookup(ns, p)  # room could be made now
        assert other.locations == leased.locations
        assert cache.lease(leased.lease_id).locations == leased.locations
        for k in range(10):  # churn the host's free slots
            cache.store(ns, prompt(100 + k), kv_for(prompt(100 + k)))
        assert same_bytes(read_blocks(cache, leased.locations), kv_for(p))
        cache.release(leased.lease_id)
        assert_consistent(cache)


def test_promotion_can_be_switched_off() -> None:
    with make_cache(host_slots=4, device_slots=2, promote_on_hit=False) as cache:
        ns = cache.attach(namespace())
        cache.store(ns, prompt(1), kv_for(prompt(1)))
        assert cache.lookup(ns, prompt(1)).locations.tiers.tolist() == [HOST]
        assert cache.stats().promotions == {}


def test_the_host_segment_is_owner_only_and_mappable_by_another_process() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2)
        cache.store(ns, p, kv_for(p))
        host = cache.tiers[HOST]
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{host.segment_name}").st_mode)
        assert mode == 0o600
        slots = cache.lookup(ns, p).locations.slots.tolist()
        child = (
            "import json, sys\n"
            "from multiprocessing import resource_tracker, shared_memory\n"
            "shm = shared_memory.SharedMemory(sys.argv[1])\n"
            "resource_tracker.unregister(shm._name, 'shared_memory')\n"
            "size = int(sys.argv[2])\n"
            "print(json.dumps([bytes(shm.buf[s * size:(s + 1) * size]).hex() for s in json.loads(sys.argv[3])]))\n"
            "shm.close()\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", child, host.segment_name, str(TINY.block_bytes), json.dumps(slots)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        seen = [bytes.fromhex(h) for h in json.loads(done.stdout)]
        expected = kv_for(p)
        assert seen == [expected[i].numpy().tobytes() for i in range(2)]
        mapped = MappedSegment(host.segment_name, TINY, host.num_slots)  # the worker-side view, no copy
        try:
            assert same_bytes(mapped.pool.read(slots), expected)
        finally:
            mapped.close()
        name = host.segment_name
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked when the tier closes


@pytest.mark.parametrize("capacity, slots", [(64, 1), (64 * 5 + 63, 5), (64 * 1000, 1000)])
def test_capacities_are_exact_byte_budgets(capacity: int, slots: int) -> None:
    host = HostTier(TINY, capacity)
    device = DeviceTier(TINY, capacity, device="cpu")
    try:
        for tier in (host, device):
            assert tier.num_slots == slots
            assert tier.capacity_bytes == slots * TINY.block_bytes <= capacity
            assert tier.storage.numel() * tier.storage.element_size() == tier.capacity_bytes
        # The segment: the slots rounded up to a page, then one page of owner record (tiers/shm.py).
        segment = host._segment
        assert segment.data_bytes == -(-slots * TINY.block_bytes // PAGE) * PAGE
        assert os.fstat(segment._fd).st_size == segment.data_bytes + PAGE
    finally:
        host.close()
        device.close()


def test_a_capacity_below_one_block_names_its_field() -> None:
    with pytest.raises(ConfigError) as caught:
        HostTier(TINY, TINY.block_bytes - 1)
    assert caught.value.field == "host_capacity"
    with pytest.raises(ConfigError) as caught:
        DeviceTier(TINY, 0, device="cpu")
    assert caught.value.field == "device_capacity"


def test_the_cache_never_holds_more_blocks_than_slots() -> None:
    with make_cache(host_slots=5, device_slots=2) as cache:
        ns = cache.attach(namespace())
        rng = np.random.default_rng(0)
        for _ in range(40):
            tokens = prompt(*rng.integers(0, 4, rng.integers(1, 4)).tolist())
            cache.store(ns, tokens, kv_for(tokens))
            cache.lookup(ns, tokens)
            used = {t.kind: t.blocks for t in cache.stats().tiers}
            assert used[HOST] <= 5 and used[DEVICE] <= 2
        assert_consistent(cache)


@pytest.mark.parametrize(
    "text, size",
    [
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64", 64),
        (4096, 4096),
        (" 1 KiB ", 1024),
        ("3k", 3072),
    ],
)
def test_size_strings(text, size: int) -> None:
    assert parse_size(text) == size
    assert CacheConfig(host_capacity=text).host_capacity == size


@pytest.mark.parametrize(
    "field, value",
    [
        ("host_capacity", "lots"),
        ("host_capacity", "-1GiB"),
        ("device_capacity", "2XB"),
        ("host_capacity", True),
        ("ttl_s", 0),
        ("ttl_s", "forever"),
        ("lease_ttl_s", "-5s"),
        ("hash_algorithm", "md5"),
        ("max_prompt_tokens", 0),
        ("max_leases", 2.5),
    ],
)
def test_bad_config_names_its_field(field: str, value) -> None:
    with pytest.raises(ConfigError) as caught:
        CacheConfig(**{field: value})
    assert caught.value.field == field


def test_durations_and_layouts() -> None:
    assert parse_duration("10m") == 600 and parse_duration("250ms") == 0.25
    assert CacheConfig(ttl_s="1h").ttl_s == 3600
    for field, value in (("layers", 0), ("kv_heads", -1), ("head_dim", 1.5), ("block_size", True), ("dtype", "int8")):
        with pytest.raises(ConfigError) as caught:
            KVLayout(**{"layers": 1, "kv_heads": 1, "head_dim": 1, field: value})
        assert caught.value.field == field
    for field, value in (("model", ""), ("model", 5), ("revision", None), ("cache_salt", "\n"), ("tenant", 3)):
        fields = {"model": "m", "revision": "r", "layout": TINY, field: value}
        with pytest.raises(ConfigError) as caught:
            Namespace(**fields)
        assert caught.value.field == field
