"""The cache: lookup and leases, reserve/commit, spill, promote, evict, stats.

It composes the radix index with the tiers, fastest first: an optional device
pool, the host pool (shared memory), an optional disk tier (tiers/disk.py) and an
optional remote tier (Redis). New blocks land in the host tier; a block evicted from
a slot tier moves to the next one; a block leaving the host tier is offered to the
disk tier (written there once reused, its admission policy) and stays reachable in
Redis, and a lookup continues past the local index with the disk tier, then Redis,
for the next block hashes, admitting what they hold into the host tier (a promotion).

Namespaces of any number of KV layouts (models) share the tiers: each slot tier is an
arena of chunks, each chunk serving one layout at a time (tiers/arena.py), with one
byte budget and one LRU order across layouts. `layout` and `tiers` name the first
layout and its pools (the one a single-model cache has); a namespace's own are
`layout_of` and `pool`.

Namespaces live in namespaces.py, the Redis side in remote_link.py (the only
holder of the remote tier), slot placement and eviction in placement.py, tenant
quotas in quota.py, leases and reservations in leases.py (`LeaseTable`).

Concurrency: one lock guards the index, tiers' free lists, leases and
counters; it is never held across Redis I/O (a lookup pins its local path,
drops the lock for the probe, and re-takes it to admit what came back).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from .codec import decode_block, encode_block
from .config import CacheConfig, KVLayout, Namespace
from .errors import CorruptBlock, InvalidArgument, LayoutMismatch, ResourceExhausted, UnknownLease
from .hashing import Hasher, Tokens
from .index import ROOT, Match, RadixIndex
from .kinds import EvictionReason, MissReason, TierKind
from .leases import Lease, LeaseTable, Reservation
from .namespaces import NamespaceRegistry, Prompt
from .pin_book import PinRecord
from .placement import Placement
from .quota import TenantLedger
from .remote_link import RemoteLink
from .results import BlockLocations, CommitResult, LookupResult, PrefixMatch
from .retention import check_priority, check_retention
from .stats import Counters, StatsSnapshot, TierSnapshot, snapshot_of
from .tenants import Tenants
from .tiers.base import RemoteTier, SlotTier
from .tiers.device import DeviceTier
from .tiers.disk import DiskTier
from .tiers.host import HostTier
from .transfer import ProbeBudget

log = logging.getLogger(__name__)

# A writer's spare reservation evicts in a full tier only while it is at most this fraction (1/8)
# of the slots it may fill.
SPARE_SHARE = 8


class PrefixCache:
    """Many namespaces of any KV layouts; see the module docstring for the tiers."""

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout,
        host: HostTier,
        device: DeviceTier | None = None,
        remote: RemoteTier | None = None,
        clock: Callable[[], float] = time.monotonic,
        hasher: Hasher | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        tiers = [t for t in (device, host) if t is not None]
        if any(t.layout != layout for t in tiers):
            raise LayoutMismatch(f"the tiers' first layout differs from the cache's {layout}")
        self.tiers: dict[TierKind, SlotTier] = {t.kind: t for t in tiers}  # the first layout's pools
        arenas = {t.kind: t.arena for t in tiers}
        self.clock = clock
        self.hasher = hasher or Hasher(config.hash_algorithm)
        # One row per slot the arenas can ever hold, whatever layouts come (tiers/arena.py).
        self.index = RadixIndex(sum(a.max_slots for a in arenas.values()), layout.block_size, self.hasher.digest_size)
        self.namespaces = NamespaceRegistry(layout.block_size, self.hasher, config.max_prompt_tokens)
        self.namespaces.add_layout(layout)  # layout 0: the one every chunk serves at the start
        self.leases = LeaseTable(config.max_leases)
        self.counters = Counters()
        self.tenants = Tenants(self.index)
        self.remote_link = None if remote is None else RemoteLink(remote, self.index, self.namespaces, arenas)
        self.placement = Placement(
            self.index,
            arenas,
            self.counters,
            self.namespaces.layout_of_row,
            self.leases,
            self.tenants,
            self.remote_link,
            clock,
        )
        self.disk = disk
        # Pins of the last run (the disk tier's pin book), made again as their namespaces attach.
        self._waiting_pins: dict[str, list[PinRecord]] = {}  # (kept in the book until restored)
        self._restoring: set[str] = set()  # namespaces whose first attach is restoring their pins
        self._pins_changed = False  # the pin book lags the live pins (a pin ended in `expire`)
        if disk is not None:
            self.placement.spill_disk = self._spill_to_disk
            for record in disk.kept_pins():
                self._waiting_pins.setdefault(record.namespace_id, []).append(record)
        self.ledger = TenantLedger(
            self.tenants, self.index, config.tenant_quotas, self.namespaces, self.leases, self.placement
        )  # quota.py
        self.placement.pin_ended = self._pin_ended
        self._lock = threading.RLock()
        self._started = clock()
        self._next_pin_refresh = 0.0  # when `expire` next renews pinned blocks' Redis TTLs

    # -- namespaces -------------------------------------------------------
    def attach(self, namespace: Namespace) -> str:
        """Register a namespace (idempotent) and return its id.

        A namespace of a layout new to the cache adds that layout to every tier's arena; one
        whose block cannot live in a chunk (or has another block size in tokens) is
        LayoutMismatch. The first attach after a restart makes the namespace's pins of the last
        run again, from the disk tier (`_restore_pins`)."""
        with self._lock:
            if self.namespaces.layout_id(namespace.layout) is None:
                self.placement.add_layout(namespace.layout)
                self.namespaces.add_layout(namespace.layout)
            entry, new = self.namespaces.register(namespace)
            if new:
                self.tenants.register(entry.index, namespace.tenant)
            waiting = None if entry.id in self._restoring else self._waiting_pins.get(entry.id)
            if waiting:
                self._restoring.add(entry.id)
        if waiting:
            self._restore_pins(entry.id, waiting)
        return entry.id

    def namespace(self, ns_id: str) -> Namespace:
        return self.namespaces.get(ns_id).namespace

    def idle_namespaces(self, ns_ids: Iterable[str]) -> set[str]:
        """Those of `ns_ids` that hold no block in the index and no lease or reservation now (the
        service stops counting them against their tenant; Redis keys are by id, so a namespace
        attached again finds its blocks there)."""
        with self._lock:
            rows = {self.namespaces.get(ns_id).index: ns_id for ns_id in ns_ids}
            busy = set(np.unique(self.index.namespace[self.index.live()]).tolist())
            busy.update(lease.namespace for lease in self.leases.leases())
            busy.update(reservation.namespace for reservation in self.leases.reservations())
            return {ns_id for row, ns_id in rows.items() if row not in busy}

    def layout_of(self, ns_id: str) -> KVLayout:
        return self.namespaces.get(ns_id).namespace.layout

    def pool(self, kind: TierKind, ns_id: str) -> SlotTier:
        """The `kind` tier's pool of the namespace's layout (its slots, its share handle)."""
        return self.placement.pool(kind, self.namespaces.get(ns_id).layout)

    # -- lookup -------------------------------------------------------------
    def lookup(
        self,
        ns_id: str,
        tokens: Tokens,
        take_lease: bool = False,
        recompute_s_per_token: float | None = None,
        block_size: int = 0,
    ) -> LookupResult:
        """Longest cached prefix of `tokens`; with a lease its blocks stay put until release.

        `recompute_s_per_token` is the asking worker's prefill cost: given, Redis is asked only
        for blocks it is expected to deliver faster than that (`transfer.ProbeBudget`); the
        blocks left unasked are `LookupResult.remote_blocks_declined`. `block_size` is the
        asking engine's in tokens (0: the namespace's), a multiple of the namespace's: the hit
        is cut to whole engine blocks, and only those are leased, touched and counted.
        """
        return self._lookup(ns_id, tokens, take_lease, recompute_s_per_token, block_size=block_size)

    def _lookup(
        self,
        ns_id: str,
        tokens: Tokens,
        take_lease: bool = False,
        recompute_s_per_token: float | None = None,
        pin_priority: int | None = None,
        block_size: int = 0,
    ) -> LookupResult:
        """`lookup`; with `pin_priority` (a pin's lookup), room for what it promotes may come from
        the tenant's pins of lower priority (`_displace_pin`)."""
        budget_s = _recompute_cost(recompute_s_per_token)
        multiple = self.layout_of(ns_id).blocks_per(block_size)
        prompt = self.namespaces.prompt(ns_id, tokens, multiple)
        with self._lock:
            match = self.index.match(prompt.entry.index, prompt.hashes, prompt.blocks, self.clock(), self.config.ttl_s)
            path, stop = match.rows, match.stop
            link, disk = self.remote_link, self.disk
            if (link is None and disk is None) or stop is not MissReason.NOT_CACHED:
                return self._finish_lookup(prompt, path, stop, take_lease)
            self.index.pin(path)  # the local prefix stays put while disk and Redis are asked without the lock

        # Each slow tier reads only what beats recomputing (budget_s: the worker's cost per token).
        saving_s = None if budget_s is None else budget_s * self.layout.block_size
        budget = None
        try:
            disk_budget = None if saving_s is None else ProbeBudget(len(prompt.hashes) - len(path), saving_s)
            from_disk, corrupt_disk = self._fetch_disk(disk, prompt, len(path), disk_budget)
            payloads: list[memoryview] = []
            corrupt = False
            start = len(path) + len(from_disk)
            budget = None if saving_s is None else ProbeBudget(len(prompt.hashes) - start, saving_s)
            if link is not None and start < len(prompt.hashes):
                payloads, corrupt = link.fetch(
                    prompt.entry.id,
                    prompt.entry.root,
                    prompt.hashes,
                    prompt.blocks,
                    start,
                    prompt.entry.namespace.layout,
                    budget,
                )
        except BaseException:
            with self._lock:
                self.index.unpin(path)
            raise
        with self._lock:
            try:
                extended = self._admit(link, prompt, path, from_disk + payloads, len(from_disk), pin_priority)
            finally:
                self.index.unpin(path)
            self.counters.remote_integrity_failures += corrupt
            corrupt = corrupt or (corrupt_disk and not payloads)  # Redis may hold a good copy
            if len(extended) == len(prompt.hashes):
                stop = None
            elif corrupt and len(extended) == len(path) + len(from_disk) + len(payloads):
                stop = MissReason.VERIFICATION_FAILED  # the hit ends at the block Redis held corrupt
            return self._finish_lookup(prompt, extended, stop, take_lease, budget.declined if budget else 0)

    def match(self, ns_id: str, tokens: Tokens) -> PrefixMatch:
        """Where `tokens`' longest cached prefix lives, for a router: the lookup's match alone,
        leaving no trace (no touch, lease, promotion, count) and never asking Redis; with what the
        disk tier holds past it (its index in memory: no read)."""
        prompt = self.namespaces.prompt(ns_id, tokens)
        with self._lock:
            now = self.clock()
            found = self.index.match(prompt.entry.index, prompt.hashes, prompt.blocks, now, self.config.ttl_s)
            tiers = np.bincount(self.index.tier[found.rows], minlength=len(TierKind))
            remote = 0 if self.remote_link is None else self.remote_link.believed(found.rows, now)
        stop = MissReason.TOO_SHORT if not prompt.hashes else found.stop
        blocks = {kind: int(tiers[kind]) for kind in TierKind if tiers[kind]}
        hit = len(found.rows) * self.layout.block_size
        disk = 0
        if self.disk is not None and stop is MissReason.NOT_CACHED:
            disk = self.disk.held_run(prompt.entry.id, prompt.hashes[len(found.rows) :])
        return PrefixMatch(prompt.entry.id, len(prompt.tokens), hit, blocks, remote, stop, disk)

    def _finish_lookup(
        self, prompt: Prompt, path: np.ndarray, stop: MissReason | None, take_lease: bool, declined: int = 0
    ) -> LookupResult:
        """Touch, promote, count and (optionally) lease an unpinned, verified path, cut to whole
        blocks of the asking engine."""
        now = self.clock()
        whole = len(path) // prompt.multiple * prompt.multiple
        if whole < len(path):
            # The engine block it ends in is not all here: why the next block was not (expired,
            # failed verification) stays the reason when the match said so.
            path, stop = path[:whole], stop or MissReason.NOT_CACHED
        full, hit = len(prompt.hashes), len(path)
        if full == 0:
            stop = MissReason.TOO_SHORT
        lease_id = expires = None
        # several tenants: each holds at most its share of the leases (leases.TENANT_LEASE_SHARE)
        owner = self.tenants.tenant(prompt.entry.index)
        tenant = None if self.tenants.sole_counters() is not None else owner
        if take_lease and hit:
            if self.leases.full(tenant):
                self.placement.reclaim_expired(now)
            if self.leases.full():
                raise ResourceExhausted(f"take_lease: lease limit of {self.config.max_leases} reached", "take_lease")
            if self.leases.full(tenant):
                raise ResourceExhausted(
                    f"take_lease: this tenant holds its share of the lease limit ({self.leases.tenant_share})",
                    "take_lease",
                )
        self.index.touch(path, now)
        if self.config.promote_on_hit:
            if self.remote_link is not None:
                self.remote_link.settle()  # a block still being written to Redis stays where it is
            self._promote(prompt, path)
        if take_lease and hit:
            expires = now + self.config.lease_ttl_s
            self.index.pin(path)
            lease_id = self.leases.add_lease(prompt.entry.index, tuple(path.tolist()), expires, owner).id
        self._count_lookup(prompt, hit, stop)
        return LookupResult(
            prompt.entry.id,
            len(prompt.tokens),
            hit * self.layout.block_size,
            self._locations(path),
            stop,
            lease_id,
            expires,
            declined,
        )

    def _promote(self, prompt: Prompt, path: np.ndarray) -> None:
        """Promote a hit path to the device tier, within its tenant's device quota (quota.py)."""
        limit = None
        if TierKind.DEVICE in self.tiers and len(path) and self.config.tenant_quotas.limited:
            wanted = int(np.count_nonzero(self.index.tier[path] == TierKind.HOST))
            self.index.pin(path)  # room is made from the tenant's other blocks, never from this path
            try:
                limit = self.ledger.room(prompt.entry.index, TierKind.DEVICE, wanted)
            finally:
                self.index.unpin(path)
        self.placement.promote(path, limit)

    def _count_lookup(self, prompt: Prompt, hit: int, stop: MissReason | None) -> None:
        full = len(prompt.hashes)
        for counters in (self.counters, self.tenants.counters(prompt.entry.index)):  # service-wide, tenant
            counters.lookups += 1
            counters.request_hits += hit > 0
            counters.request_misses += hit == 0
            counters.block_hits += hit
            counters.block_misses += full - hit
            counters.token_hits += hit * self.layout.block_size
            counters.tokens_looked_up += len(prompt.tokens)
            if stop is not None:
                counters.miss_reasons[stop] += 1

    def _locations(self, path: np.ndarray | list[int]) -> BlockLocations:
        rows = np.asarray(path, dtype=np.int64)
        return BlockLocations.adopt(self.index.tier[rows], self.index.slot[rows])

    def _fetch_disk(
        self, disk: DiskTier | None, prompt: Prompt, start: int, budget: ProbeBudget | None
    ) -> tuple[list[memoryview], bool]:
        """Verified payloads of the blocks after `start` that the disk tier holds (and, with a
        `budget`, reads faster than the worker recomputes them), in order, and whether they end
        at a block that failed verification (counted by the tier, its slot freed). No cache lock
        held."""
        if disk is None or start >= len(prompt.hashes):
            return [], False
        ns_id, layout = prompt.entry.id, prompt.entry.namespace.layout
        payloads: list[memoryview] = []
        frames = disk.fetch(ns_id, prompt.hashes[start:], budget, layout.block_bytes)
        for i, frame in enumerate(frames, start=start):
            parent = prompt.hashes[i - 1] if i else prompt.entry.root
            try:
                payloads.append(decode_block(frame, layout, ns_id, prompt.hashes[i], parent, prompt.blocks[i]))
            except CorruptBlock as error:
                log.debug("disk block failed verification: %s", error)
                disk.corrupt(ns_id, prompt.hashes[i])
                return payloads, True
        return payloads, False

    def _spill_to_disk(self, node: int) -> None:
        """Offer a block leaving the host tier to the disk tier: written (a copy, queued) once the
        tier's admission policy takes it. Cache lock held; the slot is still the block's."""
        disk, index = self.disk, self.index
        assert disk is not None
        ns_id = self.namespaces.by_row(int(index.namespace[node])).id
        if disk.offer(ns_id, index.hash_of(node)):
            disk.submit(ns_id, *self._disk_frame(node))

    def _disk_frame(self, node: int) -> tuple[bytes, bytes]:
        """(hash, frame) of a local block, the frame a copy out of its slot. Locked."""
        index = self.index
        entry = self.namespaces.by_row(int(index.namespace[node]))
        block_hash = index.hash_of(node)
        parent = int(index.parent[node])
        layout = int(self.namespaces.layout_of_row[index.namespace[node]])
        payload = self.placement.pool(TierKind(int(index.tier[node])), layout).block_bytes(int(index.slot[node]))
        parent_hash = entry.root if parent == ROOT else index.hash_of(parent)
        frame = encode_block(entry.namespace.layout, entry.id, block_hash, parent_hash, index.tokens[node], payload)
        return block_hash, frame

    def _admit(
        self,
        link: RemoteLink | None,
        prompt: Prompt,
        pinned: np.ndarray,
        payloads: list[memoryview],
        from_disk: int = 0,
        pin_priority: int | None = None,
    ) -> np.ndarray:
        """Insert blocks fetched from disk (the first `from_disk` of `payloads`), then Redis, after
        the (pinned) `path` into the host tier.

        Room is made once, up front, so nothing admitted here can be evicted
        before the lookup finishes.
        """
        path: list[int] = pinned.tolist()
        layout = prompt.entry.layout
        free = self.placement.free(TierKind.HOST, layout)
        row, wanted = prompt.entry.index, len(payloads)
        room = self.ledger.room(row, TierKind.HOST, wanted)  # the tenant's quota
        while room < wanted and pin_priority is not None and self._displace_pin(row, pin_priority):
            room = self.ledger.room(row, TierKind.HOST, wanted)
        payloads = payloads[:room]
        fits = not payloads or self.placement.make_room(TierKind.HOST, len(payloads), layout)
        while not fits and pin_priority is not None and self._displace_pin(row, pin_priority):
            fits = self.placement.make_room(TierKind.HOST, len(payloads), layout)
        if not fits:
            payloads = payloads[: len(free)]
        now = self.clock()
        for k, payload in enumerate(payloads):
            i = len(path)
            known = self.index.node_of(prompt.hashes[i])
            if known is not None:
                # Indexed while the lock was dropped (a concurrent lookup admitted it, or a commit
                # stored it): continue through it if it is this very block, else stop there.
                if not self._continues(known, path[-1] if path else ROOT, prompt, i):
                    break
                path.append(known)
                continue
            slot = free.take()
            if slot is None:
                break
            self.placement.pool(TierKind.HOST, layout).write_bytes(slot, payload)
            node = self.index.add(
                prompt.entry.index,
                path[-1] if path else ROOT,
                prompt.hashes[i],
                prompt.blocks[i],
                TierKind.HOST,
                slot,
                now,
            )
            if link is not None and k >= from_disk:
                link.fetched(node, now)
            path.append(node)
            self.counters.promotions[TierKind.HOST] += 1
        return np.asarray(path, dtype=np.int64)

    def _continues(self, node: int, parent: int, prompt: Prompt, i: int) -> bool:
        """Whether indexed `node` is block `i` of the prompt right below `parent` (tokens verified)."""
        index = self.index
        return (
            int(index.parent[node]) == parent
            and int(index.namespace[node]) == prompt.entry.index
            and bool(np.array_equal(index.tokens[node], prompt.blocks[i]))
        )

    # -- leases ----------------------------------------------------------------
    def lease(self, lease_id: int) -> LookupResult:
        """Where the blocks of a live lease are (pinned blocks never move, so: where they were)."""
        with self._lock:
            lease = self._live_lease(lease_id)
            return LookupResult(
                self.namespaces.by_row(lease.namespace).id,
                0,
                len(lease.nodes) * self.layout.block_size,
                self._locations(list(lease.nodes)),
                None,
                lease.id,
                lease.expires_at,
            )

    def release(self, lease_id: int) -> None:
        with self._lock:
            lease = self.leases.pop_lease(lease_id)
            if lease is None:
                raise UnknownLease(lease_id)
            self.index.unpin(list(lease.nodes))

    # -- operator pins ----------------------------------------------------------------
    def pin(self, ns_id: str, tokens: Tokens, ttl_s: float | None = None, priority: int = 0) -> Lease:
        """Pin the cached prefix of `tokens` (promoted from Redis first, as a lookup does) so LRU,
        TTL expiry and flush leave it in its local tier until `unpin` or `ttl_s` (None: no end).

        A lease held by the operator: the lookup's lease becomes the pin, so the path is verified
        and never unpinned in between. Raises InvalidArgument when no block of it is cached.

        `priority` (PIN_PRIORITIES, 0..100) orders pins of one tenant: when promoting this prefix
        into the host tier finds no room (or the tenant's host quota is reached) because the rest is
        pinned, that tenant's pins of lower priority are released, lowest first (`_displace_pin`),
        until it fits. Nothing else ever releases a pin early: stores and lookups never do.

        With Redis, the pinned blocks' keys live as long as the pin and then the Redis TTL
        (`_hold_pin_keys`, renewed by `expire`), so other instances keep finding them."""
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0):
            raise InvalidArgument("ttl_s", f"must be a number > 0 or None, got {ttl_s!r}")
        check_priority(priority)
        return self._pin(ns_id, tokens, ttl_s, priority)

    def _pin(self, ns_id: str, tokens: Tokens, ttl_s: float | None, priority: int, pin_id: int | None = None) -> Lease:
        """`pin`, as `pin_id` where given and free (a pin of the last run made again). With a disk
        tier the pin is written to its pin book, and its blocks the disk lacks to the disk, so a
        restart restores it."""
        found = self._lookup(ns_id, tokens, take_lease=True, pin_priority=priority)
        if found.lease_id is None:
            raise InvalidArgument("tokens", f"no block of this prefix is cached in {ns_id!r}: store or warm it first")
        with self._lock:
            lease = self.leases.pop_lease(found.lease_id)
            if lease is None:  # reclaimed in between (a lease TTL shorter than this call)
                raise UnknownLease(found.lease_id)
            now = self.clock()
            expires = float("inf") if ttl_s is None else now + ttl_s
            pin = self.leases.add_lease(
                lease.namespace, lease.nodes, expires, lease.tenant, operator=True, priority=priority, lease_id=pin_id
            )
            self._hold_pin_keys([pin], now)
            self._keep_pins()
            frames = self._frames_for_disk(pin)
        if self.disk is not None:  # (copies: written without the lock)
            for block_hash, frame in frames:
                self.disk.write_now(ns_id, block_hash, frame)
        return pin

    def _restore_pins(self, ns_id: str, records: list[PinRecord]) -> None:
        """Make the pins of the last run in a namespace attached again, from what the tiers hold
        (the disk tier kept their blocks); one the tiers no longer hold is logged and dropped."""
        assert self.disk is not None  # (only the disk tier's book has records)
        try:
            for record in records:
                now = self.disk.clock()
                if record.live(now):
                    left = None if record.expires_unix is None else record.expires_unix - now
                    self._restore_pin(ns_id, record, left)
        finally:
            with self._lock:
                del self._waiting_pins[ns_id]
                self._restoring.discard(ns_id)
                self._keep_pins()  # (those not restored leave the book)

    def _restore_pin(self, ns_id: str, record: PinRecord, ttl_s: float | None) -> None:
        try:
            pin = self._pin(ns_id, record.tokens, ttl_s, record.priority, record.pin_id)
        except (InvalidArgument, UnknownLease) as error:
            log.warning("pin %d of namespace %s not restored: %s", record.pin_id, ns_id, error)
            return
        blocks = len(pin.nodes) * self.layout.block_size
        log.info("pin %d of namespace %s restored: %d of %d token(s)", pin.id, ns_id, blocks, len(record.tokens))

    def unpin(self, pin_id: int) -> None:
        """End a pin, or forget a pin of the last run still waiting for its namespace."""
        with self._lock:
            pin = self.leases.pop_lease(pin_id, operator=True)
            if pin is None and self._forget_waiting_pin(pin_id):
                self._keep_pins()
                return
            if pin is None:
                raise InvalidArgument("pin_id", f"pin {pin_id} is unknown or has expired")
            self.index.unpin(list(pin.nodes))
            self._pin_ended(pin)
            self._keep_pins()

    def _retain(self, rows: list[int], retain_s: float, now: float) -> None:
        """A retention hint: `rows` stay `retain_s` since their last use where that outlasts the
        TTL (`RadixIndex.retain`), and their Redis keys as long where that outlasts the Redis TTL.
        Locked."""
        self.index.retain(rows, retain_s - self.config.ttl_s)
        link = self.remote_link
        if link is not None and rows and retain_s > link.ttl_s:
            link.set_ttl(np.asarray(rows, dtype=np.int64), retain_s, now, extend_only=True)

    def _displace_pin(self, ns_row: int, priority: int) -> bool:
        """Release the lowest-priority pin (the soonest to expire among equals) of the tenant of
        namespace row `ns_row` below `priority`, for a pin of that priority that needs its room;
        False if there is none. Its blocks become ordinary LRU blocks. Locked."""
        tenant = self.tenants.tenant(ns_row)
        below = [p for p in self.leases.pins() if p.priority < priority and self.tenants.tenant(p.namespace) == tenant]
        if not below:
            return False
        victim = min(below, key=lambda p: (p.priority, p.expires_at))
        self.leases.pop_lease(victim.id, operator=True)
        self.index.unpin(list(victim.nodes))
        self._pin_ended(victim)
        self.counters.pins_displaced += 1
        log.info("pin %d (priority %d) released for a pin of priority %d", victim.id, victim.priority, priority)
        return True

    def _hold_pin_keys(self, pins: Iterable[Lease], now: float) -> None:
        """Redis keeps pinned blocks while pinned: each key's TTL becomes the pin's time left plus
        the Redis TTL (a pin without a TTL: the Redis TTL, renewed by `expire` four times per Redis
        TTL). Another instance's read only lengthens a TTL (`PEXPIRE ... GT`); on a Redis before
        7.0 it resets it to the Redis TTL (GETEX), which cannot outlast a renewal. Locked."""
        link = self.remote_link
        if link is None:
            return
        for pin in pins:
            left = 0.0 if pin.expires_at == float("inf") else max(0.0, pin.expires_at - now)
            link.set_ttl(np.asarray(pin.nodes, dtype=np.int64), link.ttl_s + left, now)
        self._next_pin_refresh = now + link.ttl_s / 4

    def _pin_ended(self, pin: Lease) -> None:
        """A pin ended (unpin, expiry, displaced): its blocks' keys get their normal TTL back, as if
        used now (a retention hint's longer TTL kept). Locked."""
        self._pins_changed = True
        link = self.remote_link
        if link is None:
            return
        now = self.clock()
        rows = np.asarray(pin.nodes, dtype=np.int64)
        extra = self.index.extra_ttl[rows]
        retained = np.where(extra > 0, self.index.last_access[rows] + self.config.ttl_s + extra - now, 0.0)
        link.set_ttl(rows, np.maximum(link.ttl_s, retained), now)

    def _forget_waiting_pin(self, pin_id: int) -> bool:
        """Drop a waiting pin's record (not while its namespace's first attach restores it). Locked."""
        for ns_id, records in self._waiting_pins.items():
            kept = [r for r in records if r.pin_id != pin_id]
            if len(kept) < len(records) and ns_id not in self._restoring:
                self._waiting_pins[ns_id] = kept
                return True
        return False

    def _keep_pins(self) -> None:
        """With a disk tier, its pin book becomes the live pins and those of the last run still
        waiting for their namespace (their blocks kept on disk). Locked."""
        self._pins_changed = False
        if self.disk is None:
            return
        now, wall = self.clock(), self.disk.clock()
        records = [self._pin_record(pin, now, wall) for pin in self.leases.pins() if pin.expires_at > now]
        made = {record.pin_id for record in records}
        for waiting in self._waiting_pins.values():  # (a namespace's stay until all are tried)
            records += [r for r in waiting if r.live(wall) and r.pin_id not in made]
        self.disk.keep_pins(records)

    def _pin_record(self, pin: Lease, now: float, wall: float) -> PinRecord:
        rows = list(pin.nodes)
        return PinRecord(
            pin_id=pin.id,
            namespace_id=self.namespaces.by_row(pin.namespace).id,
            tokens=tuple(self.index.tokens[rows].reshape(-1).tolist()),
            block_hashes=tuple(self.index.hash_of(row) for row in rows),
            expires_unix=None if pin.expires_at == float("inf") else wall + (pin.expires_at - now),
            priority=pin.priority,
        )

    def _frames_for_disk(self, pin: Lease) -> list[tuple[bytes, bytes]]:
        """(hash, frame) of the pin's blocks the disk tier lacks, copied out of their slots. Locked."""
        disk = self.disk
        if disk is None:
            return []
        ns_id = self.namespaces.by_row(pin.namespace).id
        return [self._disk_frame(node) for node in pin.nodes if not disk.holds(ns_id, self.index.hash_of(node))]

    def pins(self) -> list[tuple[str, Lease]]:
        """Live operator pins with their namespace ids, soonest to expire first; with them the
        pins of the last run still waiting for their namespace to attach, as pins holding nothing
        (namespace row -1, no nodes), so an operator sees them and can unpin them."""
        with self._lock:
            now = self.clock()
            live = [(self.namespaces.by_row(p.namespace).id, p) for p in self.leases.pins() if p.expires_at > now]
            made = {p.id for _, p in live}
            wall = self.disk.clock() if self.disk is not None else 0.0
            for ns_id, records in self._waiting_pins.items():
                for r in records:
                    if r.live(wall) and r.pin_id not in made:
                        ends = float("inf") if r.expires_unix is None else now + (r.expires_unix - wall)
                        live.append((ns_id, Lease(r.pin_id, -1, (), ends, operator=True, priority=r.priority)))
            return sorted(live, key=lambda pair: pair[1].expires_at)

    def count_retention_clamped(self, ns_id: str) -> None:
        """A store's retention hint was cut to its tenant's bound (the service's policy)."""
        row = self.namespaces.get(ns_id).index
        with self._lock:
            self.counters.retention_clamped += 1
            self.tenants.counters(row).retention_clamped += 1

    def _live_lease(self, lease_id: int) -> Lease:
        lease = self.leases.live_lease(lease_id, self.clock())
        if lease is None:
            raise UnknownLease(lease_id)
        return lease

    # -- storing ------------------------------------------------------------------
    def reserve(
        self, count: int, ns_id: str | None = None, spare: bool = False, replaces: int | None = None
    ) -> Reservation:
        """Up to `count` free host slots for a writer; fewer when the tier is pinned full.

        With `ns_id`, the slots count against its tenant's host quota (fewer when over it) and
        only that tenant may commit them. `spare` (a writer's reservation for its next store, asked
        by a Commit): as any other, evicting in LRU order in a full tier, since a writer that has
        just stored stores again and the eviction then leaves its next store's path; but where
        it may not evict (`_spare_may_evict`), only slots free now and none unless as many more
        stay free. `replaces` names a reservation
        of the same tenant to give back first (a spare too small for this store); an unknown or
        expired one is ignored.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidArgument("count", f"must be a non-negative integer, got {count!r}")
        entry = self.namespaces.get(ns_id) if ns_id is not None else None
        row, layout = (entry.index, entry.layout) if entry is not None else (-1, 0)
        with self._lock:
            old = self.leases.reservation(replaces) if replaces else None
            if old is not None and self._same_tenant(old.namespace, row):
                self.leases.take_reservation(old.id)
                self.placement.free_reserved(old)
            slots = self._take_slots(count, row, layout, spare)
            return self.leases.add_reservation(
                TierKind.HOST, slots, self.clock() + self.config.lease_ttl_s, row, layout
            )

    def _same_tenant(self, row: int, other: int) -> bool:
        """Whether namespace rows `row` and `other` (-1: none) belong to one tenant."""
        return row == other or (row >= 0 and other >= 0 and self.tenants.tenant(row) == self.tenants.tenant(other))

    def _take_slots(self, count: int, row: int, layout: int, spare: bool = False) -> tuple[int, ...]:
        """`reserve`'s slots for a checked count, namespace row `row` (-1: none) of `layout`; locked."""
        host = self.placement.pool(TierKind.HOST, layout)
        if count > host.num_slots:
            raise ResourceExhausted(f"count: {count} blocks exceed the host tier's {host.num_slots} slots", "count")
        free = self.placement.free(TierKind.HOST, layout)
        evict = not spare or self._spare_may_evict(count, row, layout)
        if row >= 0:
            count = self.ledger.room(row, TierKind.HOST, count, evict)
        if evict:
            self.placement.make_room(TierKind.HOST, count, layout)
        elif len(free) < 2 * count:
            return ()
        # Ascending: slots freed apart (LRU leaves of several prompts) that are adjacent make one
        # run, which a writer fills with one copy.
        return tuple(sorted(free.take_many(count)))

    def _spare_may_evict(self, count: int, row: int, layout: int) -> bool:
        """Whether a spare of `count` slots may evict: not where layouts share the tier (held slots
        keep a chunk from changing layout), and only while it is at most 1/SPARE_SHARE of the slots
        it may fill (the tier's, or its tenant's quota's): a larger one would hold the room that
        promotions and other writers need."""
        if self.placement.shared(TierKind.HOST):
            return False
        pool = self.placement.pool(TierKind.HOST, layout)
        room = pool.num_slots
        limit = self.ledger.limit_bytes(self.tenants.tenant(row), TierKind.HOST) if row >= 0 else None
        if limit is not None:
            room = min(room, limit // pool.layout.block_bytes)
        return count * SPARE_SHARE <= room

    def commit(
        self,
        ns_id: str,
        tokens: Tokens,
        reservation_id: int,
        start_block: int,
        retention_s: float | None = None,
        count: int | None = None,
    ) -> CommitResult:
        """Publish reserved slots as blocks `start_block..` of the prompt `tokens`; with `count`,
        only the first `count` slots (the rest go back to the free list).

        `retention_s` (a retention hint, already bounded by the caller's policy): these blocks and
        their prefix are kept at least that long since their last use, in the index and in Redis,
        where that is longer than the TTLs (never shorter than they had)."""
        prompt = self.namespaces.prompt(ns_id, tokens)
        if not isinstance(start_block, int) or isinstance(start_block, bool) or start_block < 0:
            raise InvalidArgument("start_block", f"must be a non-negative integer, got {start_block!r}")
        check_retention(retention_s)
        with self._lock:
            return self._commit(prompt, reservation_id, start_block, retain_s=retention_s, count=count)

    def _commit(
        self,
        prompt: Prompt,
        reservation_id: int,
        start_block: int,
        match: Match | None = None,
        retain_s: float | None = None,
        count: int | None = None,
    ) -> CommitResult:
        reservation = self.leases.reservation(reservation_id)
        if reservation is None or (
            reservation.namespace >= 0  # another tenant's stays theirs, untouched
            and self.tenants.tenant(reservation.namespace) != prompt.entry.namespace.tenant
        ):
            raise InvalidArgument("reservation_id", "the reservation is unknown or has expired")
        if reservation.layout != prompt.entry.layout:  # its slots hold blocks of another size
            raise InvalidArgument(
                "reservation_id", "the reservation was made for another KV layout than the namespace's"
            )
        if count is not None and not 0 < count <= len(reservation.slots):
            raise InvalidArgument("block_count", f"must be 1 to the reservation's {len(reservation.slots)} slots")
        used = reservation.slots if count is None else reservation.slots[:count]
        end = start_block + len(used)
        if end > len(prompt.hashes):  # checked first: a refused commit keeps its reservation (retry it right)
            raise InvalidArgument(
                "start_block", f"the reservation's blocks would end at {end}, past the prompt's full blocks"
            )
        self.leases.take_reservation(reservation_id)
        if len(used) < len(reservation.slots):
            rest = np.asarray(reservation.slots[len(used) :], dtype=np.int64)
            self.placement.free(reservation.tier, reservation.layout).give_many(rest)
            reservation = dataclasses.replace(reservation, slots=used)
        return self._publish(prompt, reservation, start_block, end, match, retain_s)

    def _match_for_commit(self, prompt: Prompt, end: int) -> Match:
        # No TTL here: an expired block of this very prefix (tokens verified) holds the same KV
        # the writer just computed, so it counts as a duplicate and the commit's touch revives it.
        return self.index.match(
            prompt.entry.index, prompt.hashes[:end], prompt.blocks[:end], self.clock(), float("inf")
        )

    def _publish(
        self,
        prompt: Prompt,
        reservation: Reservation,
        start: int,
        end: int,
        match: Match | None,
        retain_s: float | None = None,
    ) -> CommitResult:
        """Index the reserved slots' blocks after the cached prefix; `match` (of hashes[:end]) may
        come from the caller when its matched rows have stayed pinned since."""
        now = self.clock()
        if match is None or len(match.found) < end:
            match = self._match_for_commit(prompt, end)
        path, cached = match.rows.tolist(), len(match.rows)
        tier = reservation.tier
        nodes: list[int] = []
        first = cached - start  # block `cached` was written to the reservation's slot `cached - start`
        if match.stop is MissReason.NOT_CACHED and start <= cached < end:
            # The blocks after a cached prefix that reaches `start`, up to any hash indexed
            # elsewhere or repeated (a collision's KV is never replaced): `extend` stops there.
            nodes = self.index.extend(
                prompt.entry.index,
                path[-1] if path else ROOT,
                prompt.hashes[cached:end],
                prompt.blocks[cached:end],
                tier,
                reservation.slots[first:],
                now,
            )
            if self.remote_link is not None and nodes:
                # Sent from their slots: the path stays pinned until the writer is done with them.
                self.counters.spills_dropped += self.remote_link.write_through(path, nodes, now, retain_s)
        if retain_s is not None:
            self._retain(path[:end] + nodes, retain_s, now)
        new = len(nodes)
        unused = reservation.slots[:first] + reservation.slots[first + new :] if new else reservation.slots
        if unused:
            self.placement.free(tier, reservation.layout).give_many(np.asarray(unused, dtype=np.int64))
        self.index.touch(path + nodes, now)
        deduplicated = max(0, min(cached, end) - start)
        for counters in (self.counters, self.tenants.counters(prompt.entry.index)):  # service-wide, tenant
            counters.blocks_committed += new
            counters.blocks_deduplicated += deduplicated
        return CommitResult(new, deduplicated, end - start - new - deduplicated)

    def store(
        self, ns_id: str, tokens: Tokens, kv: torch.Tensor, start_block: int = 0, retention_s: float | None = None
    ) -> CommitResult:
        """Reserve, write and commit in one call (the path for bytes sent over the wire).

        `kv[j]` is block `start_block + j` of `tokens`; every block must be a full one.
        Blocks already cached are not written again (deduplicated), and the cached
        prefix is pinned while room is made, so a store never evicts its own prefix.
        Blocks that get no slot (the host tier is pinned full) count as rejected.
        `retention_s`: as in `commit`.
        """
        check_retention(retention_s)
        layout = self.layout_of(ns_id)
        if not isinstance(kv, torch.Tensor) or kv.dim() != len(layout.block_shape) + 1:
            shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise LayoutMismatch(f"kv must be [blocks, *{layout.block_shape}], got {shape}")
        blocks = kv.shape[0]
        if kv.dtype != layout.dtype.torch:
            raise LayoutMismatch(f"kv dtype {kv.dtype} differs from the namespace's {layout.dtype.torch}")
        if blocks and kv.shape[1:] != layout.block_shape:
            raise LayoutMismatch(f"kv block shape {tuple(kv.shape[1:])} differs from {layout.block_shape}")
        prompt = self.namespaces.prompt(ns_id, tokens)  # validate before taking slots
        if (
            not isinstance(start_block, int)
            or isinstance(start_block, bool)
            or start_block < 0
            or start_block + blocks > len(prompt.hashes)
        ):
            raise InvalidArgument(
                "kv",
                f"{blocks} blocks from start_block {start_block!r} exceed the prompt's "
                f"{len(prompt.hashes)} full blocks",
            )
        end = start_block + blocks
        entry = prompt.entry
        with self._lock:
            match = self._match_for_commit(prompt, end)
            cached = match.rows
            skip = max(0, len(cached) - start_block)
            self.index.pin(cached)
            try:
                slots = self._take_slots(blocks - skip, entry.index, entry.layout)
            finally:
                self.index.unpin(cached)
            # Written and published under this lock: a reservation no other call can see, so no id.
            reservation = Reservation(0, TierKind.HOST, slots, float("inf"), entry.index, entry.layout)
            try:
                self.placement.pool(TierKind.HOST, entry.layout).write_many(slots, kv[skip : skip + len(slots)])
            except BaseException:
                self.placement.free_reserved(reservation)
                raise
            first = start_block + skip
            result = self._publish(prompt, reservation, first, first + len(slots), match, retention_s)
            self.counters.blocks_deduplicated += skip
            self.tenants.counters(entry.index).blocks_deduplicated += skip
        unreserved = blocks - skip - len(slots)
        return CommitResult(result.stored, result.deduplicated + skip, result.rejected + unreserved)

    # -- eviction -----------------------------------------------------------------
    def expire(self) -> int:
        """Reclaim expired leases, reservations and blocks; returns blocks dropped."""
        with self._lock:
            now = self.clock()
            self.placement.reclaim_expired(now)
            if self._pins_changed:  # a pin expired (or was displaced by a pin that then failed)
                self._keep_pins()
            if self.remote_link is not None and now >= self._next_pin_refresh:
                self._hold_pin_keys(self.leases.pins(), now)
            index = self.index
            stale = index.select(index.last_access + self.config.ttl_s + index.extra_ttl < now)
            return self.placement.drop_all(stale, EvictionReason.TTL)

    def evict(
        self, ns_id: str | None = None, older_than_s: float | None = None, prefix_tokens: Tokens | None = None
    ) -> int:
        """Manual eviction by namespace, by age, or of every prompt that starts with `prefix_tokens`."""
        if older_than_s is not None and (
            isinstance(older_than_s, bool) or not isinstance(older_than_s, (int, float)) or not older_than_s >= 0
        ):
            raise InvalidArgument("older_than_s", f"must be a number >= 0, got {older_than_s!r}")
        with self._lock:
            if self.remote_link is not None:
                self.remote_link.release_writes()  # blocks being written go too
            index, live = self.index, self.index.live()
            if prefix_tokens is not None:
                if ns_id is None:
                    raise InvalidArgument("namespace", "evicting by prefix needs a namespace")
                prompt = self.namespaces.prompt(ns_id, prefix_tokens)
                match = index.match(prompt.entry.index, prompt.hashes, prompt.blocks, self.clock(), float("inf"))
                nodes = index.subtree(int(match.rows[-1])) if len(match.rows) and match.stop is None else []
            else:
                mask = live.copy()
                if ns_id is not None:
                    mask &= index.namespace == self.namespaces.get(ns_id).index
                    if self.remote_link is not None:
                        self.remote_link.forget_namespace(ns_id, np.flatnonzero(mask))
                    if self.disk is not None:
                        self.disk.delete_namespace(ns_id)
                if older_than_s is not None:
                    mask &= index.last_access < self.clock() - older_than_s
                nodes = index.select(mask)
            forget = self.remote_link.forget if self.remote_link is not None else None
            return self.placement.drop_all(nodes, EvictionReason.MANUAL, before=forget)

    def flush(self) -> int:
        """Drop every unpinned block from every tier, Redis included."""
        with self._lock:
            if self.remote_link is not None:
                self.remote_link.release_writes()  # blocks being written go too
            dropped = self.placement.drop_all(self.index.select(self.index.live()), EvictionReason.MANUAL)
            if self.remote_link is not None:
                self.remote_link.flush()
            if self.disk is not None:
                self.disk.flush()
            return dropped

    # -- stats ----------------------------------------------------------------------
    def resident_blocks(self) -> dict[str, dict[TierKind, int]]:
        """Per namespace id, the blocks resident in each local tier (namespaces holding none: absent)."""
        with self._lock:
            live = self.index.live()
            pairs, counts = np.unique(
                np.stack([self.index.namespace[live], self.index.tier[live]]).astype(np.int64),
                axis=1,
                return_counts=True,
            )
            resident: dict[str, dict[TierKind, int]] = {}
            for (row, tier), count in zip(pairs.T.tolist(), counts.tolist()):
                resident.setdefault(self.namespaces.by_row(row).id, {})[TierKind(tier)] = count
            return resident

    def stats(self, tenant: str | None = None) -> StatsSnapshot:
        """Service-wide figures, or with `tenant` only that tenant's own (see `TenantLedger.snapshot`)."""
        with self._lock:
            if tenant is not None:
                return self.ledger.snapshot(
                    tenant,
                    self.tiers,
                    self.clock() - self._started,
                    self.remote_link.is_up() if self.remote_link is not None else None,
                    self.disk.is_up() if self.disk is not None else None,
                )
            c = self.counters
            tiers = []
            for kind, tier in self.tiers.items():  # every layout's blocks together
                # Blocks, not slots: a writer's reservation (a spare one waits between stores) holds none yet.
                reserved = [r for r in self.leases.reservations() if r.tier == kind]
                blocks = self.placement.used(kind) - sum(len(r.slots) for r in reserved)
                layouts = self.namespaces.layouts
                reserved_bytes = sum(len(r.slots) * layouts[r.layout].block_bytes for r in reserved)
                tiers.append(
                    TierSnapshot(kind, blocks, self.placement.used_bytes(kind) - reserved_bytes, tier.capacity_bytes)
                )
            remote_up: bool | None = None
            remote: dict[str, float] = {}
            if self.remote_link is not None:
                remote_up, remote = self.remote_link.is_up(), self.remote_link.figures()
            disk_up: bool | None = None
            disk: dict[str, float] = {}
            if self.disk is not None:
                disk_up = self.disk.is_up()
                disk = {name: float(v) for name, v in vars(self.disk.stats()).items() if name != "up"}
            return snapshot_of(
                c,
                uptime_s=self.clock() - self._started,
                active_leases=self.leases.lease_count(),
                tiers=tuple(tiers),
                spills_dropped=c.spills_dropped,
                remote_up=remote_up,
                remote=remote,
                disk_up=disk_up,
                disk=disk,
            )

    def close(self) -> bool:
        """Stop the Redis writer, then release the slot tiers; False if the writer is still running
        (stuck past its timeouts): it sends blocks from their slots, so their memory stays mapped
        until the process exits, and the caller must not unmap it either."""
        if self.disk is not None:
            self.disk.close()
        if self.remote_link is not None and not self.remote_link.close():
            log.warning("the Redis writer is still running: the slot tiers stay mapped until exit")
            return False
        with self._lock:  # every write into a tier holds it: none is half done when the tiers go
            for tier in self.tiers.values():
                tier.close()
        return True


def _recompute_cost(seconds_per_token: float | None) -> float | None:
    if seconds_per_token is None:
        return None
    if (
        isinstance(seconds_per_token, bool)
        or not isinstance(seconds_per_token, (int, float))
        or not 0 <= seconds_per_token < float("inf")
    ):
        raise InvalidArgument("recompute_seconds_per_token", f"must be a finite number >= 0, got {seconds_per_token!r}")
    return float(seconds_per_token)
