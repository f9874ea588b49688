"""Helpers for the core tests: a manual clock, a cache over real tiers, KV that names its prefix,
and a checker of every cross-structure invariant of a `PrefixCache`.

Everything here is real: the host tier is a shared-memory segment and the device tier is the
real `DeviceTier` on `device="cpu"`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, Namespace
from prefixcache.index import ROOT
from prefixcache.kinds import TierKind
from prefixcache.results import BlockLocations
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.host import HostTier

TINY = KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=4, dtype="float32")


def read_blocks(cache: PrefixCache, locations: BlockLocations, ns_id: str | None = None) -> torch.Tensor:
    """Copy of the blocks at `locations` (of namespace `ns_id`'s layout; default the cache's first),
    `[n, *block_shape]` on the CPU (what a lease holder reads)."""
    layout = cache.layout if ns_id is None else cache.layout_of(ns_id)
    out = torch.empty((len(locations), *layout.block_shape), dtype=layout.dtype.torch)
    for kind in cache.tiers:
        tier = cache.tiers[kind] if ns_id is None else cache.pool(kind, ns_id)
        rows = np.flatnonzero(locations.tiers == kind)
        if rows.size:
            out[torch.from_numpy(rows)] = tier.read(locations.slots[rows].tolist()).to("cpu")
    return out


def write_reserved(cache: PrefixCache, reservation_id: int, position: int, block: torch.Tensor) -> None:
    """Write one block into a reservation's slot, as a same-host worker does through the mapped pool."""
    reservation = cache.leases.reservation(reservation_id)
    assert reservation is not None, "reservation unknown or expired"
    cache.placement.pool(reservation.tier, reservation.layout).write(reservation.slots[position], block)


class ManualClock:
    """A clock that only moves when told to (injected as `PrefixCache(clock=...)`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextmanager
def make_cache(
    host_slots: int, device_slots: int = 0, layout: KVLayout = TINY, clock: ManualClock | None = None, **config
) -> Iterator[PrefixCache]:
    """A cache over a real shared-memory host tier (and a cpu device tier), closed afterwards."""
    hasher = config.pop("hasher", None)
    host = HostTier(layout, host_slots * layout.block_bytes)
    device = DeviceTier(layout, device_slots * layout.block_bytes, device="cpu") if device_slots else None
    cache = PrefixCache(
        CacheConfig(
            host_capacity=host_slots * layout.block_bytes, device_capacity=device_slots * layout.block_bytes, **config
        ),
        layout,
        host,
        device,
        clock=clock or ManualClock(),
        hasher=hasher,
    )
    try:
        yield cache
    finally:
        cache.close()


def namespace(layout: KVLayout = TINY, model: str = "test-model", **fields) -> Namespace:
    return Namespace(model, fields.pop("revision", "r1"), layout, **fields)


def kv_for(tokens, layout: KVLayout = TINY, start_block: int = 0, salt: int = 0) -> torch.Tensor:
    """KV of every full block from `start_block`: block i's bits depend on tokens[: (i+1)*block_size]
    (and on `salt`, standing in for the namespace).

    Random bit patterns (NaN payloads included) so that any conversion, not just a lost
    block, would show up in a byte comparison.
    """
    size = layout.block_size
    full = len(tokens) // size
    blocks = []
    for i in range(start_block, full):
        prefix = np.asarray(tokens[: (i + 1) * size], dtype="<u4").tobytes()
        seed = hashlib.sha256(salt.to_bytes(4, "little") + prefix).digest()
        raw = np.random.default_rng(list(seed)).integers(0, 256, layout.block_bytes, dtype=np.uint8)
        blocks.append(torch.from_numpy(raw.copy()))
    stacked = torch.stack(blocks) if blocks else torch.empty((0, layout.block_bytes), dtype=torch.uint8)
    return stacked.view(layout.dtype.torch).reshape(len(blocks), *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def live_nodes(cache: PrefixCache) -> list[int]:
    return np.flatnonzero(cache.index.tier >= 0).tolist()


def live_hashes(cache: PrefixCache) -> set[bytes]:
    return {cache.index.hash_of(n) for n in live_nodes(cache)}


def block_hashes(cache: PrefixCache, ns_id: str, tokens) -> list[bytes]:
    root = cache.hasher.root(cache.namespace(ns_id))
    return cache.hasher.block_hashes(root, np.asarray(tokens, dtype="<u4"), cache.layout.block_size)


def assert_consistent(cache: PrefixCache) -> None:
    """Every invariant that ties the index, the free lists, leases and reservations together."""
    index = cache.index
    live = live_nodes(cache)
    live_set = set(live)
    assert len(index) == len(live) == len(index.map)
    child_count: Counter = Counter()
    for node in live:
        parent = int(index.parent[node])
        assert parent == ROOT or parent in live_set, f"prefix closure broken at node {node}"
        if parent != ROOT:
            child_count[parent] += 1
            assert index.namespace[parent] == index.namespace[node]
            assert index.tick[parent] > index.tick[node], "a parent must be more recent than its child"
            assert index.last_access[parent] >= index.last_access[node]
        assert index.node_of(index.hash_of(node)) == node
    for node in live:
        assert index.children[node] == child_count[node], f"children count of {node}"
    pins: Counter = Counter()
    for lease in cache.leases.leases():
        pins.update(lease.nodes)
    for node in live:
        assert index.pins[node] == pins[node], f"pins of {node}: {index.pins[node]} vs {pins[node]} leases"
    assert not (set(pins) - live_set), "a lease holds a node that is gone"
    layout_of = cache.namespaces.layout_of_row
    for kind in cache.tiers:
        arena = cache.placement.arenas[kind]
        held_bytes = 0
        for layout, pool in enumerate(arena.pools):
            owned = [
                int(index.slot[n]) for n in live if index.tier[n] == kind and layout_of[index.namespace[n]] == layout
            ]
            reserved = [
                s for r in cache.leases.reservations() if r.tier == kind and r.layout == layout for s in r.slots
            ]
            free_list = cache.placement.free(kind, layout)
            free = list(free_list._free)
            everything = owned + reserved + free
            chunks = np.flatnonzero(arena.owner == layout)
            mine = sorted(s for c in chunks.tolist() for s in pool.chunk_slots(c))
            assert len(everything) == len(set(everything)), f"{kind.label} slots are shared"
            assert sorted(everything) == mine, f"{kind.label} slots leak, or live outside the layout's chunks"
            assert all(free_list.is_free(s) for s in free)
            assert not any(free_list.is_free(s) for s in owned + reserved)
            held_bytes += (len(owned) + len(reserved)) * pool.layout.block_bytes
        assert held_bytes <= arena.capacity_bytes, f"{kind.label} holds more bytes than its budget"
    for snapshot in cache.stats().tiers:
        assert snapshot.bytes_used <= snapshot.capacity_bytes
    assert set(cache.tiers) <= {TierKind.DEVICE, TierKind.HOST}
