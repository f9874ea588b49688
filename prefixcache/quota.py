"""Per-tenant byte quotas in the slot tiers, and the figures a tenant may see about itself.

Why quotas evict the tenant's own blocks: new blocks normally make room by global LRU, so one
tenant writing fast enough would push every other tenant's prefixes out. With a quota, a tenant
that would go over it first evicts its *own* least recently used blocks there (counted as
`EvictionReason.CAPACITY`), and only then does the tier's ordinary LRU run, for what is left.

Quotas are bytes: a tenant's blocks may be of several KV layouts (models), whose blocks differ
in size, so usage counts each block at its layout's block bytes.

Invariants:
- A tenant's usage of a tier = the bytes of its live blocks resident there + the bytes of the
  slots of its outstanding reservations there. `room` never lets a placement take usage above
  the quota; it may stay above only where the tenant's blocks are pinned (leases) or arrived by
  a spill from the tier above (trimmed at the tenant's next placement).
- Trimming touches only the tenant's own unpinned blocks, least recent first, leaf-first in the
  last slot tier (as `Placement.make_room`), so cached prefixes stay contiguous.
- Without any quota configured, `room` does no counting at all (no cost on the hot path).

Wiring: the ledger is built once, last, with what it reads: the tenant table (tenants.py), the
index, the namespace registry (the block bytes of each namespace row), the cache's `LeaseTable`
(reservations count as usage, leases as a tenant's own figures) and the `Placement` it trims
through. Nothing is built with the ledger, so there is no cycle to break with callbacks.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .config import TenantQuota, TenantQuotas
from .index import RadixIndex
from .kinds import EvictionReason, TierKind
from .leases import LeaseTable
from .namespaces import NamespaceRegistry
from .placement import Placement
from .stats import StatsSnapshot, TierSnapshot, snapshot_of
from .tenants import Tenants
from .tiers.base import SlotTier


class TenantLedger:
    """Quota room per tenant and tier, and per-tenant snapshots."""

    def __init__(
        self,
        tenants: Tenants,
        index: RadixIndex,
        quotas: TenantQuotas,
        namespaces: NamespaceRegistry,
        leases: LeaseTable,
        placement: Placement,
    ) -> None:
        self._tenants = tenants
        self._index = index
        self._leases = leases
        self._placement = placement
        self._quotas = quotas
        self._bytes_of_row = namespaces.bytes_of_row  # namespace row -> block bytes of its layout
        self._limits: dict[str, TenantQuota] = {}  # tenant -> its quota, looked up once

    # -- residency and quotas ---------------------------------------------------------
    def block_bytes(self, nodes: np.ndarray) -> np.ndarray:
        """Bytes of each of `nodes`' blocks (their layouts')."""
        return np.asarray(self._bytes_of_row[self._index.namespace[nodes]])

    def _resident_rows(self, tenant: str, kind: TierKind) -> np.ndarray:
        rows = np.flatnonzero(self._index.tier == kind)
        return rows[self._tenants.members(tenant)(rows)] if rows.size else rows

    def resident(self, tenant: str, kind: TierKind) -> int:
        """Live blocks of `tenant` in `kind`."""
        return len(self._resident_rows(tenant, kind))

    def resident_bytes(self, tenant: str, kind: TierKind) -> int:
        return int(self.block_bytes(self._resident_rows(tenant, kind)).sum())

    def limit_bytes(self, tenant: str, kind: TierKind) -> int | None:
        """The tenant's quota in `kind` in bytes, or None without a limit."""
        quota = self._limits.get(tenant)
        if quota is None:
            quota = self._limits[tenant] = self._quotas.of(tenant)
        limit: int | None = getattr(quota, kind.label, None)
        return limit

    def usage(self, tenant: str, kind: TierKind) -> int:
        """Bytes `tenant` holds in `kind`: resident blocks and outstanding reservations."""
        reserved = sum(
            len(r.slots) * int(self._bytes_of_row[r.namespace])
            for r in self._leases.reservations()
            if r.tier == kind and r.namespace >= 0 and self._tenants.tenant(r.namespace) == tenant
        )
        return self.resident_bytes(tenant, kind) + reserved

    def room(self, ns_row: int, kind: TierKind, count: int, evict: bool = True) -> int:
        """How many of `count` new blocks of namespace row `ns_row` may go into `kind`.

        Over its quota, the tenant's own least recently used blocks there (of any layout) are
        evicted first (reason `capacity`; with `evict` False, none are: only the room left now);
        what its pinned blocks keep occupied is not given out.
        """
        tenant = self._tenants.tenant(ns_row)
        limit = self.limit_bytes(tenant, kind)
        if limit is None or count <= 0:
            return count
        block = int(self._bytes_of_row[ns_row])
        used = self.usage(tenant, kind)
        excess = used + count * block - limit
        if excess > 0 and evict:
            used -= self._placement.trim(
                kind, self._tenants.members(tenant), excess, EvictionReason.CAPACITY, self.block_bytes
            )
        return max(0, min(count, (limit - used) // block))

    def snapshot(
        self,
        tenant: str,
        tiers: Mapping[TierKind, SlotTier],
        uptime_s: float,
        remote_up: bool | None,
        disk_up: bool | None = None,
    ) -> StatsSnapshot:
        """The figures `tenant` may see: its own lookups, commits, evictions, residency and leases.

        Service-wide figures (spills, promotions, Redis and disk counters) are left out: they
        describe other tenants' traffic too; the two tiers' states stay. A tier's capacity is the tenant's quota there when smaller.
        """
        c = self._tenants.tenant_counters(tenant)
        snapshots = []
        for kind, tier in tiers.items():
            rows = self._resident_rows(tenant, kind)
            limit = self.limit_bytes(tenant, kind)
            capacity = tier.capacity_bytes if limit is None else min(tier.capacity_bytes, limit)
            snapshots.append(TierSnapshot(kind, len(rows), int(self.block_bytes(rows).sum()), capacity))
        own = sum(
            1
            for lease in self._leases.leases()
            if not lease.operator and self._tenants.tenant(lease.namespace) == tenant
        )
        return snapshot_of(
            c,
            uptime_s=uptime_s,
            active_leases=own,
            tiers=tuple(snapshots),
            spills_dropped=0,
            remote_up=remote_up,
            remote={},
            moves=False,
            disk_up=disk_up,
        )
