"""Tenants inside one cache: per-tenant figures and per-tenant byte quotas in the slot tiers.

The tenant of a block is the `tenant` of its namespace (set by the service from the caller's
credential). This ledger maps namespace rows to tenants, keeps each tenant's counters (the
figures a tenant may see about itself), and makes room for a tenant within its quota.

Why quotas evict the tenant's own blocks: new blocks normally make room by global LRU, so one
tenant writing fast enough would push every other tenant's prefixes out. With a quota, a tenant
that would go over it first evicts its *own* least recently used blocks there (counted as
`EvictionReason.CAPACITY`), and only then does the tier's ordinary LRU run, for what is left.

Quotas are bytes: a tenant's blocks may be of several KV layouts (models), whose blocks differ
in size, so usage counts each block at its layout's block bytes.

Invariants:
- A tenant's usage of a tier = the bytes of its live blocks resident there + the bytes of the
  slots of its outstanding reservations there. `room` never lets a placement take usage above the quota; it may stay
  above only where the tenant's blocks are pinned (leases) or arrived by a spill from the tier
  above (trimmed at the tenant's next placement).
- Trimming touches only the tenant's own unpinned blocks, least recent first, leaf-first in the
  last slot tier (as `Placement.make_room`), so cached prefixes stay contiguous.
- Without any quota configured, `room` does no counting at all (no cost on the hot path).

Wiring: the ledger is built once with the index, the namespace registry (the block bytes of
each namespace row) and the cache's `LeaseTable` (reservations count as usage, leases as a
tenant's own figures). `room` is still handed the `Placement`:
placement counts each eviction against its block's tenant through this ledger, so owning
the placement here would make the two a construction cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .config import TenantQuota, TenantQuotas
from .index import RadixIndex
from .leases import LeaseTable
from .namespaces import NamespaceRegistry
from .placement import Placement
from .stats import Counters, EvictionReason, StatsSnapshot, TierSnapshot, snapshot_of
from .tiers.base import SlotTier, TierKind

Members = Callable[[np.ndarray], np.ndarray]


class TenantLedger:
    """Tenant of every namespace row, counters per tenant, quota room per tier."""

    def __init__(
        self,
        index: RadixIndex,
        quotas: TenantQuotas,
        namespaces: NamespaceRegistry,
        leases: LeaseTable,
        max_namespaces: int = int(np.iinfo(np.int16).max) + 1,
    ) -> None:
        self._index = index
        self._leases = leases
        self._quotas = quotas
        self._bytes_of_row = namespaces.bytes_of_row  # namespace row -> block bytes of its layout
        self._tenant_of_ns = np.zeros(max_namespaces, dtype=np.int32)  # namespace row -> tenant number
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []
        self._counters: list[Counters] = []
        self._limits: list[TenantQuota] = []

    # -- tenants ------------------------------------------------------------------
    def register(self, ns_row: int, tenant: str) -> None:
        """Record the tenant of a newly attached namespace row."""
        number = self._numbers.get(tenant)
        if number is None:
            number = self._numbers[tenant] = len(self._names)
            self._names.append(tenant)
            self._counters.append(Counters())
            self._limits.append(self._quotas.of(tenant))
        self._tenant_of_ns[ns_row] = number

    def tenant(self, ns_row: int) -> str:
        return self._names[int(self._tenant_of_ns[ns_row])]

    def counters(self, ns_row: int) -> Counters:
        """The counters of the tenant that owns namespace row `ns_row`."""
        return self._counters[int(self._tenant_of_ns[ns_row])]

    def counters_of_node(self, node: int) -> Counters:
        return self.counters(int(self._index.namespace[node]))

    def tenant_counters(self, tenant: str) -> Counters:
        """A tenant's counters (fresh zeros for a tenant that never attached)."""
        number = self._numbers.get(tenant)
        return Counters() if number is None else self._counters[number]

    def members(self, tenant: str) -> Members:
        """Mask function over node rows: which belong to `tenant`."""
        number = self._numbers.get(tenant, -1)
        table, namespace = self._tenant_of_ns, self._index.namespace
        return lambda nodes: table[namespace[nodes]] == number

    # -- residency and quotas ---------------------------------------------------------
    def block_bytes(self, nodes: np.ndarray) -> np.ndarray:
        """Bytes of each of `nodes`' blocks (their layouts')."""
        return np.asarray(self._bytes_of_row[self._index.namespace[nodes]])

    def _resident_rows(self, tenant: str, kind: TierKind) -> np.ndarray:
        rows = np.flatnonzero(self._index.tier == kind)
        return rows[self.members(tenant)(rows)] if rows.size else rows

    def resident(self, tenant: str, kind: TierKind) -> int:
        """Live blocks of `tenant` in `kind`."""
        return len(self._resident_rows(tenant, kind))

    def resident_bytes(self, tenant: str, kind: TierKind) -> int:
        return int(self.block_bytes(self._resident_rows(tenant, kind)).sum())

    def limit_bytes(self, tenant: str, kind: TierKind) -> int | None:
        """The tenant's quota in `kind` in bytes, or None without a limit."""
        number = self._numbers.get(tenant)
        quota = self._limits[number] if number is not None else self._quotas.of(tenant)
        limit: int | None = getattr(quota, kind.label, None)
        return limit

    def usage(self, tenant: str, kind: TierKind) -> int:
        """Bytes `tenant` holds in `kind`: resident blocks and outstanding reservations."""
        reserved = sum(
            len(r.slots) * int(self._bytes_of_row[r.namespace])
            for r in self._leases.reservations()
            if r.tier == kind and r.namespace >= 0 and self.tenant(r.namespace) == tenant
        )
        return self.resident_bytes(tenant, kind) + reserved

    def room(self, placement: Placement, ns_row: int, kind: TierKind, count: int) -> int:
        """How many of `count` new blocks of namespace row `ns_row` may go into `kind`.

        Over its quota, the tenant's own least recently used blocks there (of any layout) are
        evicted first (reason `capacity`); what its pinned blocks keep occupied is not given out.
        """
        tenant = self.tenant(ns_row)
        limit = self.limit_bytes(tenant, kind)
        if limit is None or count <= 0:
            return count
        block = int(self._bytes_of_row[ns_row])
        used = self.usage(tenant, kind)
        excess = used + count * block - limit
        if excess > 0:
            used -= placement.trim(kind, self.members(tenant), excess, EvictionReason.CAPACITY, self.block_bytes)
        return max(0, min(count, (limit - used) // block))

    def snapshot(
        self, tenant: str, tiers: Mapping[TierKind, SlotTier], uptime_s: float, remote_up: bool | None
    ) -> StatsSnapshot:
        """The figures `tenant` may see: its own lookups, commits, evictions, residency and leases.

        Service-wide figures (spills, promotions, Redis counters) are left out: they describe
        other tenants' traffic too. A tier's capacity is the tenant's quota there when smaller.
        """
        c = self.tenant_counters(tenant)
        snapshots = []
        for kind, tier in tiers.items():
            rows = self._resident_rows(tenant, kind)
            limit = self.limit_bytes(tenant, kind)
            capacity = tier.capacity_bytes if limit is None else min(tier.capacity_bytes, limit)
            snapshots.append(TierSnapshot(kind, len(rows), int(self.block_bytes(rows).sum()), capacity))
        own = sum(1 for lease in self._leases.leases() if self.tenant(lease.namespace) == tenant)
        return snapshot_of(
            c,
            uptime_s=uptime_s,
            active_leases=own,
            tiers=tuple(snapshots),
            spills_dropped=0,
            remote_up=remote_up,
            remote={},
            moves=False,
        )
