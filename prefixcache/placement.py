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
from typing import Callable, Iterable

import numpy as np

from .index import RadixIndex
from .stats import Counters, EvictionReason
from .tiers.base import FreeSlots, SlotTier, TierKind

log = logging.getLogger(__name__)


class Placement:
    def __init__(self, index: RadixIndex, tiers: dict[TierKind, SlotTier], counters: Counters,
                 reclaim: Callable[[], None], on_drop: Callable[[int, bool], bool]) -> None:
        self.index = index
        self.tiers = tiers
        self.counters = counters
        self.free = {kind: FreeSlots(tier.num_slots) for kind, tier in tiers.items()}
        self._reclaim = reclaim
        self._on_drop = on_drop  # (node, spill) -> whether the block now lives on in Redis

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
        lower = self.lower(kind)
        for node in self.index.lru(kind):
            if lower is None:
                if self.index.children[node]:
                    continue  # leaf-first: a block leaves the last tier after its descendants
                self.drop(node, EvictionReason.LRU, spill=True)
            elif self.make_room(lower, 1):
                self.move(node, lower)
                self.counters.spills[kind] += 1
                self.counters.evictions[(kind, EvictionReason.LRU)] += 1
            else:
                break
            if len(free) >= count:
                return True
        return len(free) >= count

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
        if self._on_drop(node, spill):
            self.counters.spills[kind] += 1
        self.counters.evictions[(kind, reason)] += 1
        slot = int(self.index.slot[node])
        self.index.remove(node)
        self.free[kind].give(slot)

    def drop_all(self, nodes: Iterable[int], reason: EvictionReason,
                 before: Callable[[int], None] | None = None) -> int:
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

    def promote(self, path: np.ndarray) -> None:
        """Move host-resident blocks of a hit path up to the device tier, root first.

        A block another lease pins never moves. Promotion stops at the first block that
        cannot move, so the device keeps the root side of a path.
        """
        index = self.index
        if TierKind.DEVICE not in self.tiers or not len(path) or not (index.tier[path] == TierKind.HOST).any():
            return
        index.pin(path)  # this path's blocks are not candidates for making room
        try:
            for node in path.tolist():
                if index.tier[node] != TierKind.HOST:
                    continue
                if index.pins[node] > 1 or not self.make_room(TierKind.DEVICE, 1):
                    break
                self.move(node, TierKind.DEVICE)
                self.counters.promotions[TierKind.DEVICE] += 1
        finally:
            index.unpin(path)
