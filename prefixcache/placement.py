"""Placement: which slot of which slot tier holds each block, and making room.

Owns the arenas of the slot tiers (device, host; tiers/arena.py), hence every layout's free-slot
list and which layout each chunk serves, and every change of a block's residency: moving it down
a tier (a spill), up a tier (a promotion), or out of the last one. The cache builds it with its
collaborators, each typed: the index, the arenas, the `LeaseTable` (expired leases and
reservations are reclaimed before anything is evicted), the tenant table (evictions counted per
tenant) and the `RemoteLink` when there is Redis (a leaving block may spill there). It never sees
tokens. A block's layout is its namespace's (`layout_of_ns`, the registry's table).

Invariants:
- A slot of a layout is free, reserved, or owned by exactly one live node of that layout (see
  `FreeSlots`); a chunk serves one layout, and changes layout only while it holds nothing.
- `make_room` evicts in the index's LRU order (least recent first, deeper first), across every
  layout: the LRU victim of the layout making room goes as with one layout (from a tier with a
  lower tier it moves down; from the last tier leaves only); a victim of another layout has its
  whole chunk emptied (moved down, or in the last tier dropped with every block that depends on
  one of them) and the chunk changes layout. So every cached prefix stays contiguous from the root.
- A pinned block is never moved or dropped: its lease holder reads that very slot. A chunk holding
  a pinned block or a reservation is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np

from .config import KVLayout
from .index import ROOT, RadixIndex
from .kinds import EvictionReason, TierKind
from .leases import Lease, LeaseTable, Reservation
from .remote_link import RemoteLink
from .stats import Counters
from .tenants import Tenants
from .tiers.arena import Arena
from .tiers.base import FreeSlots, SlotTier
from .tiers.pool import TensorPool

log = logging.getLogger(__name__)

Mask = Callable[[np.ndarray], np.ndarray]


class Placement:
    def __init__(
        self,
        index: RadixIndex,
        arenas: dict[TierKind, Arena],
        counters: Counters,
        layout_of_ns: np.ndarray,
        leases: LeaseTable,
        tenants: Tenants,
        remote_link: RemoteLink | None,
        clock: Callable[[], float],
    ) -> None:
        self.index = index
        self.arenas = arenas
        self.counters = counters
        self.layout_of_ns = layout_of_ns  # namespace row -> layout id (filled by the registry)
        self.leases = leases
        self.tenants = tenants
        self.remote_link = remote_link  # None: no Redis
        self.clock = clock
        # Called with each block leaving the last slot tier by eviction (the cache offers it to
        # the disk tier, tiers/disk.py); None: no disk tier.
        self.spill_disk: Callable[[int], None] | None = None
        # Called with each operator pin that expired, after its rows are unpinned (the cache gives
        # their Redis keys their normal TTL back); None: nothing to do.
        self.pin_ended: Callable[[Lease], None] | None = None

    # -- layouts and slots --------------------------------------------------------
    def add_layout(self, layout: KVLayout) -> None:
        """Let every tier hold `layout` (next id); LayoutMismatch, changing nothing, if one cannot."""
        for arena in self.arenas.values():
            arena.per_chunk(layout)
        for arena in self.arenas.values():
            arena.add_layout(layout)

    def free(self, kind: TierKind, layout: int = 0) -> FreeSlots:
        return self.arenas[kind].free[layout]

    def pool(self, kind: TierKind, layout: int = 0) -> TensorPool:
        return self.arenas[kind].pools[layout]

    def shared(self, kind: TierKind) -> bool:
        """Whether layouts share `kind`'s chunks (a chunk changes layout only while empty)."""
        return len(self.arenas[kind].pools) > 1

    def layout_of(self, nodes: np.ndarray) -> np.ndarray:
        return np.asarray(self.layout_of_ns[self.index.namespace[nodes]])

    def _layout_of_node(self, node: int) -> int:
        return int(self.layout_of_ns[self.index.namespace[node]])

    def tier_of(self, node: int) -> SlotTier:
        """The pool that holds live `node`."""
        return self.pool(TierKind(int(self.index.tier[node])), self._layout_of_node(node))

    def used(self, kind: TierKind) -> int:
        """Slots of `kind` owned by blocks or reservations, every layout's."""
        arena = self.arenas[kind]
        return sum(arena.used(layout) for layout in range(len(arena.pools)))

    def used_bytes(self, kind: TierKind) -> int:
        return self.arenas[kind].used_bytes()

    def lower(self, kind: TierKind) -> TierKind | None:
        lower = [k for k in self.arenas if k > kind]
        return min(lower) if lower else None

    # -- what leases, reservations and Redis hold ---------------------------------------
    def reclaim_expired(self, now: float) -> None:
        """Unpin expired leases and the paths of finished Redis writes; return expired reservations' slots."""
        if self.remote_link is not None:
            self.remote_link.settle()
        leases, reservations = self.leases.expired(now)
        for lease in leases:
            self.index.unpin(list(lease.nodes))
            if lease.operator and self.pin_ended is not None:
                self.pin_ended(lease)
        for reservation in reservations:
            self.free_reserved(reservation)

    def free_reserved(self, reservation: Reservation) -> None:
        """Return a reservation's slots (it was taken from the lease table, or expired)."""
        free = self.free(reservation.tier, reservation.layout)
        for slot in reservation.slots:
            free.give(slot)

    def _leave(self, node: int, spill: bool) -> bool:
        """A block is leaving the slot tiers; with `spill`, make sure Redis keeps it. Whether it
        now lives on in Redis (only called with a remote link)."""
        assert self.remote_link is not None
        if not spill:
            self.remote_link.dropped(node)
            return False
        kept = self.remote_link.keep(node, self.clock())
        self.counters.spills_dropped += not kept
        return kept

    # -- counting -------------------------------------------------------------------
    def _count_eviction(self, node: int, kind: TierKind, reason: EvictionReason) -> None:
        self.counters.evictions[(kind, reason)] += 1
        self.tenants.counters_of_node(node).evictions[(kind, reason)] += 1

    def _count_evictions(self, rows: np.ndarray, kind: TierKind, reason: EvictionReason) -> None:
        key = (kind, reason)
        self.counters.evictions[key] += len(rows)
        sole = self.tenants.sole_counters()
        if sole is not None:  # one tenant: no need to read the rows' namespaces
            sole.evictions[key] += len(rows)
            return
        # one tenant lookup per namespace among them
        namespaces = self.index.namespace[rows]
        if not (namespaces != namespaces[0]).any():  # the usual case: one namespace
            self.tenants.counters_of_node(int(rows[0])).evictions[key] += len(rows)
            return
        _, first, counts = np.unique(namespaces, return_index=True, return_counts=True)
        for i, count in zip(first.tolist(), counts.tolist()):
            self.tenants.counters_of_node(int(rows[i])).evictions[key] += count

    # -- making room ------------------------------------------------------------------
    def make_room(self, kind: TierKind, count: int, layout: int = 0) -> bool:
        """Free slots of `layout` in `kind` until `count` are free, evicting in LRU order."""
        if self._make_room(kind, count, layout):
            return True
        # Short of room while blocks are pinned for their Redis writes: the writer copies those
        # frames (or finishes sending them), and the blocks can go.
        return (
            self.remote_link is not None and self.remote_link.release_writes() and self._make_room(kind, count, layout)
        )

    def _make_room(self, kind: TierKind, count: int, layout: int) -> bool:
        free = self.free(kind, layout)
        if len(free) >= count:
            return True
        self.reclaim_expired(self.clock())  # a crashed worker's pins and slots go first
        arena = self.arenas[kind]
        shared = self.shared(kind)
        while shared and len(free) < count and arena.take_empty_chunk(layout):
            pass
        if len(free) >= count:
            return True
        if self.lower(kind) is None:
            if shared:
                self._drop_across(kind, count, layout)
            else:
                self._drop_leaves(kind, count - len(free), EvictionReason.LRU)
            return len(free) >= count
        index, skipped = self.index, set()
        for node in index.lru(kind):
            if index.tier[node] != kind or index.pins[node]:
                continue  # moved with a chunk emptied since its part of the log was read
            owner = self._layout_of_node(node) if shared else layout
            if owner == layout:
                if not self.evict(node, EvictionReason.LRU):
                    break  # the lower tier is pinned full
            else:
                chunk = int(index.slot[node]) // arena.pools[owner].per_chunk
                if (owner, chunk) not in skipped:
                    if self._empty_chunk(kind, owner, chunk):
                        arena.give_chunk(chunk, layout)
                    else:
                        skipped.add((owner, chunk))
            if len(free) >= count:
                return True
        return len(free) >= count

    def _drop_across(self, kind: TierKind, count: int, layout: int) -> None:
        """`make_room` in the last tier when layouts share it: the layout's own LRU leaves go as
        with one layout; at the first LRU block of another layout, its chunk is emptied and
        changes hands."""
        free, arena = self.free(kind, layout), self.arenas[kind]
        skipped: set[tuple[int, int]] = set()  # (layout, chunk) that cannot be emptied now
        while len(free) < count:
            victims, _, foreign = self._pick_leaves(kind, count - len(free), layout=layout, skipped=skipped)
            if len(victims):
                self.drop_many(victims, EvictionReason.LRU, spill=True, kind=kind)
            if foreign is not None:
                if self._empty_chunk(kind, *foreign):
                    arena.give_chunk(foreign[1], layout)
                else:
                    skipped.add(foreign)
            elif not len(victims):
                return

    def _pick_leaves(
        self,
        kind: TierKind,
        wanted: int,
        members: Mask | None = None,
        weight: Mask | None = None,
        layout: int | None = None,
        skipped: set[tuple[int, int]] | None = None,
    ) -> tuple[np.ndarray, int, tuple[int, int] | None]:
        """Unpinned blocks (int64 rows, among `members`) of `kind`, the last slot tier, in LRU order and
        leaf-first, until their `weight` (default 1 each) reaches `wanted`: the blocks `evict` of
        each LRU node in turn would drop (a block goes once its children have), picked from the
        touch log by the compiled core (`RadixIndex.lru_leaves`). Costs O(log entries scanned),
        not O(blocks cached).

        With `layout`, only that layout's blocks are picked, and the scan stops at the first
        block of another layout whose (layout, chunk) is not in `skipped`, returned third."""
        foreign: tuple[int, int] | None = None

        def cut(nodes: np.ndarray) -> tuple[np.ndarray, bool]:
            # Keep this layout's nodes up to the first block of another layout whose chunk is not
            # skipped: that chunk is the one to empty next.
            nonlocal foreign
            owners = self.layout_of(nodes)
            keep = owners == layout
            for i in np.flatnonzero(~keep).tolist():
                owner = int(owners[i])
                chunk = int(self.index.slot[nodes[i]]) // self.arenas[kind].pools[owner].per_chunk
                if skipped is None or (owner, chunk) not in skipped:
                    foreign = (owner, chunk)
                    return nodes[:i][keep[:i]], True
            return nodes[keep], False

        if weight is None:
            victims = self.index.lru_leaves(kind, wanted, members, cut if layout is not None else None)
            # Enough of this layout's blocks before the other layout's: its chunk stays.
            return victims, len(victims), foreign if len(victims) < wanted else None
        # Weighted (bytes): pick as many blocks as the lightest could need, keep the LRU-first
        # prefix that reaches `wanted` (any prefix of a leaf-first order is one).
        lightest = min(pool.layout.block_bytes for pool in self.arenas[kind].pools)
        picked = self.index.lru_leaves(kind, -(-wanted // lightest), members, cut if layout is not None else None)
        costs = np.cumsum(weight(picked)) if len(picked) else np.zeros(0, dtype=np.int64)
        end = min(int(np.searchsorted(costs, wanted)) + 1, len(picked))
        total = int(costs[end - 1]) if end else 0
        return picked[:end], total, foreign if total < wanted else None

    def _drop_leaves(
        self,
        kind: TierKind,
        wanted: int,
        reason: EvictionReason,
        members: Mask | None = None,
        weight: Mask | None = None,
    ) -> int:
        """Drop what `_pick_leaves` picks, in one batch (index rows, block-map cells, free slots,
        counters); returns its weight."""
        victims, total, _ = self._pick_leaves(kind, wanted, members, weight)
        if len(victims):
            self.drop_many(victims, reason, spill=True, kind=kind)
        return total

    def _empty_chunk(self, kind: TierKind, layout: int, chunk: int) -> bool:
        """Empty a chunk of `layout` in `kind`: its blocks move down a tier, or, from the last
        tier, leave with every block below them (any tier: a prefix stays contiguous). False,
        with what moved moved, when a block there or below is pinned, a reservation holds a slot
        there, or the lower tier is pinned full."""
        index, arena = self.index, self.arenas[kind]
        slots = arena.pools[layout].chunk_slots(chunk)
        rows = np.flatnonzero(
            (index.tier == kind)
            & (index.slot >= slots.start)
            & (index.slot < slots.stop)
            & (self.layout_of_ns[index.namespace] == layout)
        )
        held = len(slots) - int(arena.free[layout].flags()[slots.start : slots.stop].sum())
        if held != len(rows) or index.pins[rows].any():
            return False  # a reservation or a lease holds part of it
        if self.lower(kind) is not None:
            return all(self.evict(int(node), EvictionReason.LRU) for node in rows)
        leaving = self._with_descendants(rows)
        if index.pins[leaving].any():
            return False
        if leaving.size:
            self.drop_many(leaving.tolist(), EvictionReason.LRU, spill=True)
        return True

    def _with_descendants(self, rows: np.ndarray) -> np.ndarray:
        """`rows` and every live node below one of them, descendants first (pointer jumping:
        O(index capacity x log depth), only when a chunk changes layout)."""
        index = self.index
        n = index.capacity
        live = index.tier >= 0
        up = np.where(live & (index.parent != ROOT), index.parent, n).astype(np.int64)
        up = np.append(up, n)  # row n: the sentinel above every root
        marked = np.zeros(n + 1, dtype=bool)
        marked[rows] = True
        while (up != n).any():
            marked |= marked[up]
            up = up[up]
        found = np.flatnonzero(marked[:n] & live)
        return found[np.argsort(index.tick[found], kind="stable")]

    # -- residency changes --------------------------------------------------------------
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
        if not self.make_room(lower, 1, self._layout_of_node(node)):
            return False
        self.move(node, lower)
        self.counters.spills[kind] += 1
        self._count_eviction(node, kind, reason)
        return True

    def trim(self, kind: TierKind, members: Mask, excess: int, reason: EvictionReason, weight: Mask) -> int:
        """Evict unpinned blocks of `kind` among `members` (a mask over node rows) until their
        `weight` reaches `excess`, least recent first and leaf-first as in `make_room` (blocks
        pinned for their Redis writes too, when short); returns the weight that left `kind`."""
        evicted = self._trim(kind, members, excess, reason, weight)
        if evicted < excess and self.remote_link is not None and self.remote_link.release_writes():
            evicted += self._trim(kind, members, excess - evicted, reason, weight)
        return evicted

    def _trim(self, kind: TierKind, members: Mask, excess: int, reason: EvictionReason, weight: Mask) -> int:
        index, evicted = self.index, 0
        if excess <= 0:
            return 0
        if self.lower(kind) is None:
            return self._drop_leaves(kind, excess, reason, members, weight)
        eligible = lambda nodes: (index.tier[nodes] == kind) & (index.pins[nodes] == 0) & members(nodes)  # noqa: E731
        for node in index.log.scan(eligible):
            if index.tier[node] != kind or index.pins[node]:
                continue  # moved or pinned since its chunk was read
            cost = int(weight(np.asarray([node]))[0])
            if self.evict(node, reason):
                evicted += cost
            else:
                break  # the lower tier is pinned full
            if evicted >= excess:
                break
        return evicted

    def move(self, node: int, kind: TierKind) -> None:
        """Copy a block into a free slot of `kind` (the caller made room) and free its old slot."""
        layout = self._layout_of_node(node)
        old_kind, old_slot = TierKind(int(self.index.tier[node])), int(self.index.slot[node])
        slot = self.free(kind, layout).take()
        assert slot is not None, "caller made room"
        self.pool(kind, layout).write(slot, self.pool(old_kind, layout).view(old_slot))
        self.index.move(node, kind, slot)
        self.free(old_kind, layout).give(old_slot)

    def drop(self, node: int, reason: EvictionReason, spill: bool) -> None:
        """Remove a leaf from the slot tiers; with Redis, `spill` makes sure Redis keeps it first."""
        kind = TierKind(int(self.index.tier[node]))
        if self.remote_link is not None and self._leave(node, spill):
            self.counters.spills[kind] += 1
        if spill and self.spill_disk is not None:
            self.spill_disk(node)
        self._count_eviction(node, kind, reason)
        slot, layout = int(self.index.slot[node]), self._layout_of_node(node)
        self.index.remove(node)
        self.free(kind, layout).give(slot)

    def drop_many(
        self, nodes: list[int] | np.ndarray, reason: EvictionReason, spill: bool, kind: TierKind | None = None
    ) -> None:
        """`drop` of each of `nodes` (given descendants first), batched: all in `kind` when given,
        else in any tiers; of any layouts."""
        index = self.index
        rows = np.asarray(nodes, dtype=np.int64)
        groups: list[tuple[TierKind, int, slice | np.ndarray]]
        if kind is not None and not self.shared(kind):  # the usual case: one tier, one layout
            groups = [(kind, 0, slice(None))]
        else:
            kinds = index.tier[rows].astype(np.int64)
            layouts = self.layout_of(rows).astype(np.int64)
            pairs = np.unique(np.stack([kinds, layouts]), axis=1).T.tolist()
            groups = [(TierKind(k), lay, (kinds == k) & (layouts == lay)) for k, lay in pairs]
        if self.remote_link is not None:
            tiers = [kind] * len(nodes) if kind is not None else [TierKind(k) for k in index.tier[rows].tolist()]
            for node, tier in zip(rows.tolist(), tiers):
                if self._leave(node, spill):
                    self.counters.spills[tier] += 1
        if spill and self.spill_disk is not None:
            for node in rows.tolist():
                self.spill_disk(node)
        slots = index.slot[rows]
        for kind, _, where in groups:
            self._count_evictions(rows[where], kind, reason)
        index.remove_many(rows)
        for kind, layout, where in groups:
            self.free(kind, layout).give_many(slots[where])

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
        if TierKind.DEVICE not in self.arenas or not len(path) or not (index.tier[path] == TierKind.HOST).any():
            return
        layout = self._layout_of_node(int(path[0]))  # one namespace, one layout
        moved = 0
        index.pin(path)  # this path's blocks are not candidates for making room
        try:
            for node in path.tolist():
                if index.tier[node] != TierKind.HOST:
                    continue
                if (
                    (limit is not None and moved >= limit)
                    or index.pins[node] > 1
                    or not self.make_room(TierKind.DEVICE, 1, layout)
                ):
                    break
                moved += 1
                self.move(node, TierKind.DEVICE)
                self.counters.promotions[TierKind.DEVICE] += 1
        finally:
            index.unpin(path)
