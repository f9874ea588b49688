"""Placement: which slot of which slot tier holds each block, and making room.

Owns the free-slot lists of the slot tiers (device, host) and every change of a block's
residency: moving it down a tier (a spill), up a tier (a promotion), or out of the last one.
The cache composes it beside the index; it never sees tokens, leases or Redis, which the cache
brings in through two callbacks (`reclaim` frees what expired leases and reservations hold;
`on_drop` may spill a leaving block to Redis).

Invariants:
- A slot is free, reserved, or owned by exactly one live node (see `FreeSlots`).
- `make_room` evicts in the index's LRU order (least recent first, deeper first): from a tier
  with a lower tier it moves the block down; from the last tier it drops leaves only, so every
  cached prefix stays contiguous from the root.
- A pinned block is never moved or dropped: its lease holder reads that very slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np

from .index import RadixIndex
from .stats import Counters, EvictionReason
from .tiers.base import FreeSlots, SlotTier, TierKind

log = logging.getLogger(__name__)


class Placement:
    def __init__(
        self,
        index: RadixIndex,
        tiers: dict[TierKind, SlotTier],
        counters: Counters,
        reclaim: Callable[[], None],
        on_drop: Callable[[int, bool], bool] | None,
        owner_counters: Callable[[int], Counters] | None = None,
    ) -> None:
        self.index = index
        self.tiers = tiers
        self.counters = counters
        self.free = {kind: FreeSlots(tier.num_slots) for kind, tier in tiers.items()}
        self._reclaim = reclaim
        self._on_drop = on_drop  # (node, spill) -> whether the block now lives on in Redis; None: no Redis
        self._owner_counters = owner_counters  # node -> its tenant's counters (evictions per tenant)

    def _count_eviction(self, node: int, kind: TierKind, reason: EvictionReason) -> None:
        self.counters.evictions[(kind, reason)] += 1
        if self._owner_counters is not None:
            self._owner_counters(node).evictions[(kind, reason)] += 1

    def _count_evictions(self, rows: np.ndarray, kind: TierKind, reason: EvictionReason) -> None:
        self.counters.evictions[(kind, reason)] += len(rows)
        if self._owner_counters is not None:  # one tenant lookup per namespace among them
            namespaces = self.index.namespace[rows]
            if not (namespaces != namespaces[0]).any():  # the usual case: one namespace
                self._owner_counters(int(rows[0])).evictions[(kind, reason)] += len(rows)
                return
            _, first, counts = np.unique(namespaces, return_index=True, return_counts=True)
            for i, count in zip(first.tolist(), counts.tolist()):
                self._owner_counters(int(rows[i])).evictions[(kind, reason)] += count

    def used(self, kind: TierKind) -> int:
        """Slots of `kind` owned by blocks or reservations."""
        return self.tiers[kind].num_slots - len(self.free[kind])

    def lower(self, kind: TierKind) -> TierKind | None:
        lower = [k for k in self.tiers if k > kind]
        return min(lower) if lower else None

    def make_room(self, kind: TierKind, count: int) -> bool:
        """Free slots in `kind` until `count` are free, evicting in LRU order."""
        free = self.free[kind]
        if len(free) >= count:
            return True
        self._reclaim()  # a crashed worker's pins and slots go first
        if len(free) >= count:
            return True
        if self.lower(kind) is None:
            self._drop_leaves(kind, count - len(free), EvictionReason.LRU)
            return len(free) >= count
        for node in self.index.lru(kind):
            if not self.evict(node, EvictionReason.LRU):
                break  # the lower tier is pinned full
            if len(free) >= count:
                return True
        return len(free) >= count

    def _drop_leaves(
        self,
        kind: TierKind,
        wanted: int,
        reason: EvictionReason,
        members: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> int:
        """Drop up to `wanted` unpinned blocks (among `members`) from `kind`, the last slot tier, in
        LRU order and leaf-first: the blocks `evict` of each LRU node in turn would drop (a block goes
        once its children have), picked from the touch log and removed in one batch. Picking changes
        nothing the scan reads but children counts, which `gone` carries. Costs O(log entries
        scanned), not O(blocks cached). Returns how many were dropped."""
        index = self.index
        tier, pins, children, parent = index.tier, index.pins, index.children, index.parent

        def eligible(nodes: np.ndarray) -> np.ndarray:
            ok = (tier[nodes] == kind) & (pins[nodes] == 0)
            return np.asarray(ok & members(nodes)) if members is not None else ok

        gone: dict[int, int] = {}  # node -> its children picked before it
        victims: list[int] = []
        for nodes in index.log.scan_chunks(eligible):
            for node, kids, up in zip(nodes.tolist(), children[nodes].tolist(), parent[nodes].tolist()):
                if not kids or kids == gone.get(node):
                    victims.append(node)
                    gone[up] = gone.get(up, 0) + 1
                    if len(victims) >= wanted:
                        break
            if len(victims) >= wanted:
                break
        if victims:
            self.drop_many(victims, kind, reason, spill=True)
        return len(victims)

    def evict(self, node: int, reason: EvictionReason) -> bool:
        """Move an unpinned block one tier down, or drop it from the last slot tier (leaves only).

        False when it cannot go: it has descendants (last tier) or the lower tier has no room.
        """
        kind = TierKind(int(self.index.tier[node]))
        lower = self.lower(kind)
        if lower is None:
            if self.index.children[node]:
                return False
            self.drop(node, reason, spill=True)
            return True
        if not self.make_room(lower, 1):
            return False
        self.move(node, lower)
        self.counters.spills[kind] += 1
        self._count_eviction(node, kind, reason)
        return True

    def trim(
        self, kind: TierKind, members: Callable[[np.ndarray], np.ndarray], excess: int, reason: EvictionReason
    ) -> int:
        """Evict up to `excess` unpinned blocks of `kind` among `members` (a mask over node rows),
        least recent first and leaf-first as in `make_room`; returns how many left `kind`."""
        index, evicted = self.index, 0
        if excess <= 0:
            return 0
        if self.lower(kind) is None:
            return self._drop_leaves(kind, excess, reason, members)
        eligible = lambda nodes: (index.tier[nodes] == kind) & (index.pins[nodes] == 0) & members(nodes)  # noqa: E731
        for node in index.log.scan(eligible):
            if index.tier[node] != kind or index.pins[node]:
                continue  # moved or pinned since its chunk was read
            if self.evict(node, reason):
                evicted += 1
            elif self.lower(kind) is not None:
                break  # the lower tier is pinned full
            if evicted >= excess:
                break
        return evicted

    def move(self, node: int, kind: TierKind) -> None:
        """Copy a block into a free slot of `kind` (the caller made room) and free its old slot."""
        old_kind, old_slot = TierKind(int(self.index.tier[node])), int(self.index.slot[node])
        slot = self.free[kind].take()
        assert slot is not None, "caller made room"
        self.tiers[kind].write(slot, self.tiers[old_kind].view(old_slot))
        self.index.move(node, kind, slot)
        self.free[old_kind].give(old_slot)

    def drop(self, node: int, reason: EvictionReason, spill: bool) -> None:
        """Remove a leaf from the slot tiers; `on_drop` may spill it to Redis first."""
        kind = TierKind(int(self.index.tier[node]))
        if self._on_drop is not None and self._on_drop(node, spill):
            self.counters.spills[kind] += 1
        self._count_eviction(node, kind, reason)
        slot = int(self.index.slot[node])
        self.index.remove(node)
        self.free[kind].give(slot)

    def drop_many(self, nodes: list[int], kind: TierKind, reason: EvictionReason, spill: bool) -> None:
        """`drop` of each of `nodes` (all in `kind`, given descendants first), batched."""
        index = self.index
        rows = np.asarray(nodes, dtype=np.int64)
        if self._on_drop is not None:
            for node in nodes:
                if self._on_drop(node, spill):
                    self.counters.spills[kind] += 1
        self._count_evictions(rows, kind, reason)
        slots = index.slot[rows]
        index.remove_many(rows)
        self.free[kind].give_many(slots)

    def drop_all(
        self, nodes: Iterable[int], reason: EvictionReason, before: Callable[[int], None] | None = None
    ) -> int:
        """Drop the unpinned leaves among `nodes` (given descendants first); returns how many."""
        dropped = 0
        for node in nodes:
            if self.index.pins[node] or self.index.children[node]:
                continue
            if before is not None:
                before(node)
            self.drop(node, reason, spill=False)
            dropped += 1
        return dropped

    def promote(self, path: np.ndarray, limit: int | None = None) -> None:
        """Move host-resident blocks of a hit path up to the device tier, root first.

        A block another lease pins never moves. Promotion stops at the first block that
        cannot move (or after `limit` blocks), so the device keeps the root side of a path.
        """
        index = self.index
        if TierKind.DEVICE not in self.tiers or not len(path) or not (index.tier[path] == TierKind.HOST).any():
            return
        moved = 0
        index.pin(path)  # this path's blocks are not candidates for making room
        try:
            for node in path.tolist():
                if index.tier[node] != TierKind.HOST:
                    continue
                if (
                    (limit is not None and moved >= limit)
                    or index.pins[node] > 1
                    or not self.make_room(TierKind.DEVICE, 1)
                ):
                    break
                moved += 1
                self.move(node, TierKind.DEVICE)
                self.counters.promotions[TierKind.DEVICE] += 1
        finally:
            index.unpin(path)
