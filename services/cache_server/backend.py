"""The service's side of one cache: created at the first Attach, scoped by tenant.

The service starts with capacities and a block size but not the model
geometry, so the `PrefixCache` (and its host tier) is built at the first
Attach; namespaces of other layouts (other models, another KV dtype) join the
same tiers and byte budgets later (tiers/arena.py), and only a layout that
cannot live in a chunk is FAILED_PRECONDITION. The host tier's shared memory
is reserved earlier, when the server starts (`claim_segment`, sized to
`host_capacity`), so a /dev/shm that cannot hold it stops the start rather
than an Attach or a write.

Owns: that cache, the registry of the namespaces each tenant attached, and
the draining flag.

Invariants:
- Every namespace the cache knows was attached through this backend, so
  `_owners` holds the tenant of every namespace id. A caller of another tenant
  is told the id is unknown, the same answer as for an id never issued.
- A namespace with a `cache_salt` is a namespace of its own, derived from the
  caller's attached namespace; the tenant is never taken from a request.
- A tenant registers at most `max_namespaces_per_tenant` namespaces (the core
  never forgets one and holds 32k in all): one tenant cannot exhaust them. At the
  limit, its salted namespaces that hold no blocks, leases or reservations are
  reclaimed from its count (`_reclaim_locked`): a salt is derived again from its
  parent on its next use, to the same id, so no client holds a stale one, and salts
  that were flushed, evicted or expired never lock the tenant out.
- The cache is created at most once; after `close()` every call raises `Draining`.
- Tier memory is unmapped only when no thread is copying out of it: the only reads
  outside the cache lock (a Fetch stream copying leased slots into a message) run inside
  `reading()`, which `close()` fences off and waits for (at most `FENCE_S`); copies that
  outlast it leave the segment mapped until the process exits (its name is still removed).
- What a non-admin tenant can see or change is its own: its namespaces, leases and
  reservations, its blocks (inspect, evict, flush) and its own figures (GetStats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np
import torch

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, Namespace
from prefixcache.errors import (
    ConfigError,
    InvalidArgument,
    PrefixCacheError,
    ResourceExhausted,
    UnknownLease,
    UnknownNamespace,
)
from prefixcache.hashing import namespace_id, salt_gap
from prefixcache.kinds import MissReason, TierKind
from prefixcache.leases import Lease, Reservation
from prefixcache.presence import PresenceTable, table_bytes
from prefixcache.results import BlockLocation, CommitResult, LookupResult, PrefixMatch
from prefixcache.retention import check_retention
from prefixcache.stats import StatsSnapshot
from prefixcache.tiers.base import RemoteTier, ShareHandle
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.disk import DiskOptions, DiskTier
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.shm import SHM_DIR, OwnedSegment, presence_path
from prefixcache.wire import NamespaceInfo

from .auth import Principal
from .inspect import BlockReport, inspect_prefix

log = logging.getLogger(__name__)


RECLAIM_RETRY_S = 1.0  # a tenant's reclaim scan that freed nothing waits this long to run again
MAX_ENGINE_BLOCK_SIZES = 16  # engine block sizes listed per namespace (a tenant cannot grow the list unbounded)
FENCE_S = 0.25  # how long close() waits for copies out of the tiers (each is one chunk, <= 4 MiB)


class Draining(PrefixCacheError):
    """The service is shutting down and takes no new calls."""


class TierFence:
    """Threads reading tier memory outside the cache lock; once closed, nobody enters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise Draining("the service is shutting down")
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if self._inside == 0:
                    self._cond.notify_all()

    @property
    def inside(self) -> int:
        return self._inside

    def close(self, timeout_s: float) -> int:
        """Let nobody in, wait for those inside; returns how many are still inside."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._inside == 0, timeout=timeout_s)
            return self._inside


class ServiceMisconfigured(PrefixCacheError):
    """The service's own settings cannot hold this namespace (e.g. capacity below one block)."""


@dataclass(frozen=True)
class BackendOptions:
    cache: CacheConfig
    block_size: int = 16
    shm_name: str | None = None
    device: str | None = None  # "cuda" when cache.device_capacity > 0
    remote_factory: Callable[[KVLayout], RemoteTier] | None = None
    disk: DiskOptions | None = None  # the disk tier under the host tier (tiers/disk.py); None: none
    max_namespaces_per_tenant: int = 1024  # models, revisions and salts together


class CacheBackend:
    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._cache: PrefixCache | None = None
        self._create_lock = threading.Lock()
        self._registry_lock = threading.Lock()
        self._owners: dict[str, str] = {}  # namespace id -> tenant
        self._salted: dict[tuple[str, str], str] = {}  # (namespace id, salt) -> namespace id
        self._counts: dict[str, int] = {}  # tenant -> namespaces registered
        self._engine_block_sizes: dict[str, set[int]] = {}  # namespace id -> its engines' block sizes
        self._reclaim_after: dict[str, float] = {}  # tenant -> no reclaim scan before (monotonic)
        self._draining = threading.Event()
        self._fence = TierFence()
        self._closed = False
        self._segment: OwnedSegment | None = None  # reserved at start; the host tier maps it at the first Attach
        self._owner = ""  # the segments' owner record (the listen address)
        self._presence: OwnedSegment | None = None  # the index's blocks for same-host engines (presence.py)

    # -- lifecycle ----------------------------------------------------------
    @property
    def cache(self) -> PrefixCache | None:
        return self._cache

    def check_open(self) -> None:
        if self._draining.is_set():
            raise Draining("the service is draining; retry on another instance")

    def begin_drain(self) -> None:
        self._draining.set()

    def claim_segment(self, name: str, owner: str) -> None:
        """Reserve the host tier's shared memory now, at start (tiers/shm.py): a /dev/shm that cannot
        hold `host_capacity`, or a live service that owns `name`, stops the start with one line."""
        with self._create_lock:
            if self._segment is None and self._cache is None:
                self._owner = owner
                cache = self.options.cache
                self._segment = OwnedSegment(name, cache.host_capacity, owner=owner, prefault=cache.host_prefault)

    def copies_in_progress(self) -> int:
        """Threads copying out of tier memory right now (inside `reading()`)."""
        return self._fence.inside

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Around a copy out of tier memory made without the cache lock (see the invariants)."""
        return self._fence.reading()

    def close(self) -> None:
        """Drop leases and reservations with the cache and close its tiers (unlinks shm).

        Writes to the tiers run under the cache lock, which `PrefixCache.close` takes; reads
        without it are fenced (`reading`)."""
        self._draining.set()
        with self._create_lock:
            cache, self._closed = (self._cache if not self._closed else None), True
            still_reading = self._fence.close(FENCE_S)
            if cache is not None and still_reading:
                log.warning(
                    "%d Fetch handler(s) still copying %.2fs after the drain; the host tier stays mapped "
                    "until the process exits",
                    still_reading,
                    FENCE_S,
                )
                host = cache.tiers[TierKind.HOST]
                assert isinstance(host, HostTier)  # the one _build made; SlotTier has no unlink
                host.unlink()
                if cache.remote_link is not None:
                    cache.remote_link.close()  # the Redis write queue still drains
                self._unpublish(cache, close=False)
                return
            if cache is not None and not cache.close():
                host = cache.tiers[TierKind.HOST]
                assert isinstance(host, HostTier)
                host.unlink()  # the name goes; the memory stays mapped for the Redis writer still sending from it
                self._unpublish(cache, close=False)
                return
            if cache is not None:
                log.info("cache closed; host tier released")
                self._unpublish(cache, close=True)
            if self._segment is not None:
                self._segment.close()  # a no-op once the host tier closed it; else never attached

    def expire(self) -> int:
        cache = self._cache
        dropped = cache.expire() if cache is not None and not self._closed else 0
        if dropped:
            self._reclaim_after.clear()  # salts may hold nothing now
        return dropped

    def _require(self) -> PrefixCache:
        """The cache, for calls that resolved a namespace first (so it exists)."""
        if self._cache is None:
            raise UnknownNamespace("")
        return self._cache

    def _build(self, layout: KVLayout) -> PrefixCache:
        options = self.options
        config = options.cache
        sizing = {"chunk_bytes": config.chunk_bytes, "min_block_bytes": config.min_block_bytes}
        try:
            host = HostTier(
                layout, config.host_capacity, self._segment or options.shm_name, prefault=config.host_prefault, **sizing
            )
        except ConfigError as error:
            raise ServiceMisconfigured(f"{error} for this layout") from None
        try:
            device = (
                DeviceTier(layout, config.device_capacity, options.device or "cuda", **sizing)
                if config.device_capacity
                else None
            )
            remote = options.remote_factory(layout) if options.remote_factory else None
            disk = DiskTier(options.disk) if options.disk is not None else None  # fail-open: off, not raising
        except BaseException:
            host.close()
            raise
        log.info("cache created for layout %s", layout)
        cache = PrefixCache(config, layout, host, device=device, remote=remote, disk=disk)
        # Published where the table can follow all a Lookup can hit: the index, and Redis through
        # its feed; a disk tier's spilled blocks it does not follow.
        if disk is None and (remote is None or remote.presence_blocks):
            self._publish_presence(cache, host.segment_name, remote)
        return cache

    def _publish_presence(self, cache: PrefixCache, host_segment: str, remote: RemoteTier | None) -> None:
        """Same-host engines skip Lookups for prompts whose next block neither the index nor Redis
        holds (presence.py). A segment that cannot be made costs only that: engines then look up
        every prompt."""
        capacity, remote_capacity = cache.index.capacity, remote.presence_blocks if remote is not None else 0
        try:
            name = presence_path(SHM_DIR / host_segment).name
            segment = OwnedSegment(name, table_bytes(capacity, remote_capacity), owner=self._owner)
        except ConfigError as error:
            log.warning("no presence table for same-host engines (%s); they look up every prompt", error)
            return
        table = PresenceTable(segment.buf, capacity, remote_capacity)
        table.beat_every()  # engines trust it only while it beats (a killed service's stops)
        cache.index.publish(table)  # before any engine sees the cache
        if remote is not None and table.remote is not None:
            remote.follow_presence(table.remote)  # its cells read as unknown until the feed is live
        self._presence = segment

    def _unpublish(self, cache: PrefixCache, close: bool) -> None:
        """Remove the presence table's name; `close`: also unmap it (the cache is closed: nothing
        writes to it any more)."""
        segment = self._presence
        if segment is None:
            return
        if cache.index.presence is not None:
            cache.index.presence.stop_beating()  # engines read None from now on, and look up
        if not close:
            segment.unlink()
            return
        table, cache.index.presence = cache.index.presence, None
        if table is not None:
            table.release()
        segment.close()

    def presence_of(self, ns_id: str) -> tuple[str, bytes, str, tuple[bytes, bytes]] | None:
        """How a same-host engine reads the index's presence table for namespace `ns_id`: the
        table's shm name, the namespace's root hash, the hash algorithm and its encoding around
        the salt (`salt_gap`: salted prompts' roots); None: not published."""
        segment, cache = self._presence, self._require()
        if segment is None:
            return None
        entry = cache.namespaces.get(ns_id)
        return segment.name, entry.root, cache.hasher.algorithm.value, salt_gap(entry.namespace)

    def _cache_for(self, layout: KVLayout) -> PrefixCache:
        with self._create_lock:
            if self._closed:
                raise Draining("the service is shutting down")
            if self._cache is None:
                self._cache = self._build(layout)
            return self._cache

    # -- namespaces ---------------------------------------------------------
    def attach(
        self,
        principal: Principal,
        model: str,
        revision: str,
        layout: KVLayout,
        salt: str | None,
        kv_scale: str = "",
        engine_block_size: int = 0,
    ) -> str:
        """`layout` in the service's blocks; `engine_block_size` (0: the same) is listed with the
        namespace, so an operator sees which engines share it."""
        namespace = Namespace(
            model, revision, layout, tenant=principal.tenant, cache_salt=salt or "", kv_scale=kv_scale
        )
        ns_id = self._register(self._cache_for(layout), namespace, "model")
        with self._registry_lock:
            sizes = self._engine_block_sizes.setdefault(ns_id, set())
            if len(sizes) < MAX_ENGINE_BLOCK_SIZES:
                sizes.add(engine_block_size or layout.block_size)
        return ns_id

    def _register(self, cache: PrefixCache, namespace: Namespace, field: str) -> str:
        """Attach `namespace` to the cache for its tenant, within the tenant's namespace budget."""
        tenant, limit = namespace.tenant, self.options.max_namespaces_per_tenant
        with self._registry_lock:
            # The core never forgets a namespace and has room for 32k in all, so each
            # tenant gets a bounded share instead of the power to exhaust everyone's.
            if namespace_id(cache.hasher.root(namespace)) not in self._owners:
                if self._counts.get(tenant, 0) >= limit:
                    self._reclaim_locked(cache, tenant)
                if self._counts.get(tenant, 0) >= limit:
                    raise ResourceExhausted(
                        f"{field}: this tenant already has {limit} namespaces (models, revisions and salts)", field
                    )
                self._counts[tenant] = self._counts.get(tenant, 0) + 1
            ns_id = cache.attach(namespace)
            self._owners[ns_id] = tenant
        return ns_id

    def _reclaim_locked(self, cache: PrefixCache, tenant: str) -> None:
        """Stop counting `tenant`'s salted namespaces that hold nothing (the registry lock held).
        A scan that freed nothing is not repeated within RECLAIM_RETRY_S: a tenant whose salts all
        hold blocks cannot make every new salt scan the index."""
        now = time.monotonic()
        if now < self._reclaim_after.get(tenant, 0.0):
            return
        salted = {key: ns for key, ns in self._salted.items() if self._owners.get(ns) == tenant}
        idle = cache.idle_namespaces(salted.values())
        for key, ns in salted.items():
            if ns in idle:
                del self._salted[key]
                del self._owners[ns]
                self._counts[tenant] -= 1
        self._reclaim_after[tenant] = 0.0 if idle else now + RECLAIM_RETRY_S
        if idle:
            log.info("reclaimed %d idle salted namespaces of a tenant at its limit", len(idle))

    @overload
    def resolve(self, principal: Principal, ns_id: str, salt: str | None, create: Literal[True] = True) -> str: ...

    @overload
    def resolve(self, principal: Principal, ns_id: str, salt: str | None, create: bool) -> str | None: ...

    def resolve(self, principal: Principal, ns_id: str, salt: str | None, create: bool = True) -> str | None:
        """The namespace a call acts on: `ns_id`, or its salted sibling; checks the tenant.

        A new salt creates its namespace only when `create` (lookups and writes);
        read-only calls get None for a salt never used.
        """
        owner = self._owners.get(ns_id)
        if owner is None or (owner != principal.tenant and not principal.admin):
            raise UnknownNamespace(ns_id)
        if salt is None:
            return ns_id
        salted = self._salted.get((ns_id, salt))
        if salted is None and create:
            cache = self._require()
            salted = self._register(cache, dataclasses.replace(cache.namespace(ns_id), cache_salt=salt), "cache_salt")
            with self._registry_lock:  # (a reclaim walks it)
                self._salted[(ns_id, salt)] = salted
        return salted

    def _own_namespaces(self, principal: Principal) -> list[str]:
        with self._registry_lock:
            return [ns for ns, tenant in self._owners.items() if tenant == principal.tenant]

    # -- lookups and leases ---------------------------------------------------------
    def lookup(
        self,
        principal: Principal,
        ns_id: str,
        salt: str | None,
        tokens: np.ndarray,
        take_lease: bool,
        recompute_s_per_token: float | None = None,
        block_size: int = 0,
    ) -> LookupResult:
        """`block_size` (0: the namespace's): the caller's, a multiple the hit is cut to."""
        resolved = self.resolve(principal, ns_id, salt)
        return self._require().lookup(resolved, tokens, take_lease, recompute_s_per_token, block_size)

    def remaining_s(self, expires_at: float | None) -> float:
        if expires_at is None or self._cache is None:
            return 0.0
        return max(0.0, expires_at - self._cache.clock())

    def lease(self, principal: Principal, lease_id: int) -> LookupResult:
        """A live lease of the caller's tenant (another tenant's lease is "unknown")."""
        result = self._require_lease(lease_id).lease(lease_id)
        owner = self._owners.get(result.namespace_id)
        if owner != principal.tenant and not principal.admin:
            raise UnknownLease(lease_id)
        return result

    def _require_lease(self, lease_id: int) -> PrefixCache:
        if self._cache is None:
            raise UnknownLease(lease_id)
        return self._cache

    def release(self, principal: Principal, lease_id: int) -> None:
        self.lease(principal, lease_id)
        self._require_lease(lease_id).release(lease_id)

    def share_handle(self, kind: TierKind, ns_id: str) -> ShareHandle | None:
        """How a same-host worker maps the `kind` tier for namespace `ns_id`'s layout (None: not
        configured or not shareable)."""
        cache = self._require()
        return cache.pool(kind, ns_id).share_handle() if kind in cache.tiers else None

    def layout_of(self, ns_id: str) -> KVLayout:
        return self._require().layout_of(ns_id)

    def block_bytes(self, ns_id: str, location: BlockLocation) -> memoryview:
        """One block of namespace `ns_id` (a view into the tier for the host tier; the caller holds
        a lease and copies it inside `reading()`)."""
        return self._require().pool(location.tier, ns_id).block_bytes(location.slot)

    # -- writes -------------------------------------------------------------------------
    def reserve(
        self, principal: Principal, ns_id: str, count: int, spare: bool = False, replaces: int | None = None
    ) -> Reservation:
        resolved = self.resolve(principal, ns_id, None)
        return self._require().reserve(count, resolved, spare, replaces)  # the tenant's host quota; only it commits

    def commit(
        self,
        principal: Principal,
        ns_id: str,
        salt: str | None,
        tokens: np.ndarray,
        reservation_id: int,
        start_block: int,
        retention_s: float | None = None,
        count: int | None = None,
    ) -> CommitResult:
        resolved = self.resolve(principal, ns_id, salt)
        retain, clamped = self._bounded_retention(resolved, retention_s)
        result = self._require().commit(resolved, tokens, reservation_id, start_block, retain, count)
        return dataclasses.replace(result, retention_s=retain or 0.0, retention_clamped=clamped)

    def store(
        self,
        principal: Principal,
        ns_id: str,
        salt: str | None,
        tokens: np.ndarray,
        kv: torch.Tensor,
        start_block: int,
        retention_s: float | None = None,
    ) -> CommitResult:
        resolved = self.resolve(principal, ns_id, salt)
        retain, clamped = self._bounded_retention(resolved, retention_s)
        result = self._require().store(resolved, tokens, kv, start_block, retain)
        return dataclasses.replace(result, retention_s=retain or 0.0, retention_clamped=clamped)

    def _bounded_retention(self, ns_id: str, retention_s: float | None) -> tuple[float | None, bool]:
        """A store's retention hint within its namespace's tenant's bound (`retention=` of its
        credentials line, else --max-retention): a longer one is cut to the bound and counted, not
        refused, so an engine's request never fails over a hint. (hint, whether it was cut)."""
        retention_s = check_retention(retention_s)
        if retention_s is None:
            return None, False
        cache = self._require()
        bound = self.options.cache.tenant_quotas.of(cache.namespace(ns_id).tenant).retention
        if retention_s <= bound:
            return retention_s, False
        cache.count_retention_clamped(ns_id)
        return bound, True

    # -- operations -------------------------------------------------------------------------
    def stats(self) -> StatsSnapshot | None:
        """Service-wide figures (the metrics endpoint, admins)."""
        return self._cache.stats() if self._cache is not None else None

    def stats_for(self, principal: Principal) -> StatsSnapshot | None:
        """GetStats: an admin sees the whole service, any other tenant only its own figures."""
        if self._cache is None:
            return None
        return self._cache.stats() if principal.admin else self._cache.stats(principal.tenant)

    def namespaces(self, principal: Principal) -> list[NamespaceInfo]:
        """ListNamespaces: the caller's tenant's namespaces (an admin: every tenant's, named)."""
        cache = self._cache
        if cache is None:
            return []
        with self._registry_lock:
            owned = [
                (ns, tenant) for ns, tenant in self._owners.items() if principal.admin or tenant == principal.tenant
            ]
            engines = {ns: tuple(sorted(self._engine_block_sizes.get(ns, ()))) for ns, _ in owned}
        resident = cache.resident_blocks()
        entries = []
        for ns, tenant in owned:
            namespace = cache.namespace(ns)
            entries.append(
                NamespaceInfo(
                    ns,
                    namespace.model,
                    namespace.revision,
                    bool(namespace.cache_salt),
                    tenant if principal.admin else "",
                    resident.get(ns, {}),
                    namespace.kv_scale,
                    namespace.layout.block_bytes,
                    engines[ns],
                )
            )
        return entries

    def inspect(
        self, principal: Principal, ns_id: str, salt: str | None, tokens: np.ndarray
    ) -> tuple[str, BlockReport]:
        resolved = self.resolve(principal, ns_id, salt, create=False)
        if resolved is None:  # a salt never used holds nothing
            return ns_id, BlockReport.empty(len(tokens), self._require().layout.block_size)
        return resolved, inspect_prefix(self._require(), resolved, tokens)

    def match(self, principal: Principal, ns_id: str, salt: str | None, tokens: np.ndarray) -> tuple[PrefixMatch, int]:
        """The router's question (Match), and the namespace's block bytes. Read-only, so a salt
        never used matches nothing."""
        resolved = self.resolve(principal, ns_id, salt, create=False)
        cache = self._require()
        block_bytes = cache.layout_of(ns_id).block_bytes  # a salted sibling has the same layout
        if resolved is None:
            stop = MissReason.TOO_SHORT if len(tokens) < cache.layout.block_size else MissReason.NOT_CACHED
            return PrefixMatch(ns_id, len(tokens), 0, {}, 0, stop), block_bytes
        return cache.match(resolved, tokens), block_bytes

    def evict(
        self,
        principal: Principal,
        ns_id: str | None,
        salt: str | None,
        older_than_s: float | None,
        prefix: np.ndarray | None,
    ) -> int:
        self._reclaim_after.clear()  # salts may hold nothing after it
        if ns_id is None:
            if prefix is not None:
                raise InvalidArgument("namespace_id", "evicting by prefix needs a namespace_id")
            if older_than_s is None:
                raise InvalidArgument("request", "give namespace_id, older_than_seconds or prefix")
            if salt is not None:
                raise InvalidArgument("cache_salt", "needs a namespace_id")
            if self._cache is None:
                return 0
            if principal.admin:
                return self._cache.evict(older_than_s=older_than_s)
            return sum(self._cache.evict(ns, older_than_s=older_than_s) for ns in self._own_namespaces(principal))
        resolved = self.resolve(principal, ns_id, salt, create=False)
        if resolved is None:
            return 0
        if prefix is not None:
            if older_than_s is not None:
                raise InvalidArgument("older_than_seconds", "cannot be combined with prefix")
            return self._require().evict(resolved, prefix_tokens=prefix)
        return self._require().evict(resolved, older_than_s=older_than_s)

    # -- operator pins ------------------------------------------------------------------
    def pin(
        self,
        principal: Principal,
        ns_id: str,
        salt: str | None,
        tokens: np.ndarray,
        ttl_s: float | None,
        priority: int = 0,
    ) -> Lease:
        """Pin: an admin any namespace, a tenant its own (resolve checks); the blocks it pins were
        stored within the tenant's quota, so a pin takes no room beyond it (what it promotes from
        Redis is admitted within that quota, where only the tenant's own lower pins give way)."""
        resolved = self.resolve(principal, ns_id, salt, create=False)
        if resolved is None:  # a salt never used holds nothing
            raise InvalidArgument("prefix.tokens", f"no block of this prefix is cached in {ns_id!r}")
        return self._require().pin(resolved, tokens, ttl_s, priority)

    def pins(self, principal: Principal) -> list[tuple[str, Lease]]:
        if self._cache is None:
            return []
        with self._registry_lock:
            owners = dict(self._owners)
        return [(ns, p) for ns, p in self._cache.pins() if principal.admin or owners.get(ns) == principal.tenant]

    def unpin(self, principal: Principal, pin_id: int) -> None:
        if not any(p.id == pin_id for _, p in self.pins(principal)):  # another tenant's pin reads as unknown
            raise InvalidArgument("pin_id", f"pin {pin_id} is unknown or has expired")
        self._require().unpin(pin_id)

    def flush(self, principal: Principal) -> int:
        """Admin: everything, every tier. A tenant: its own namespaces only."""
        self._reclaim_after.clear()  # salts may hold nothing after it
        if self._cache is None:
            return 0
        if principal.admin:
            return self._cache.flush()
        return sum(self._cache.evict(ns) for ns in self._own_namespaces(principal))
