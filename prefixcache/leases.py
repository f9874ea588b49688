"""Leases (timed pins on a matched path) and reservations (slots being written): `LeaseTable`.

An operator pin (`PrefixCache.pin`) is a lease too, marked `operator`: it has its own TTL
(or none), does not count against `max_leases`, and only `unpin` ends it early, or a pin of
higher `priority` of the same tenant that needs its room (`PrefixCache.pin`).

Ids are random 63-bit numbers, so a client cannot guess another's lease; lease and
reservation ids are drawn from one space, so neither can be mistaken for the other.
Both expire, so a crashed worker cannot hold memory forever.

The table only records; the cache (under its lock) pins and unpins index rows and takes
and gives slots, so the invariants below hold between the cache's calls:
- every node of a live lease's path carries one pin for that lease;
- every reserved slot is out of its tier's free list and owned by nobody else;
- an entry leaves the table exactly once (`pop_lease`, `take_reservation`, `expired`), and
  whoever removed it undoes its pins or slots.
"""

from __future__ import annotations

import array
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from .kinds import TierKind


@dataclass(frozen=True)
class Lease:
    id: int
    namespace: int
    nodes: tuple[int, ...]
    expires_at: float  # inf: an operator pin without a TTL
    tenant: str = ""  # the namespace's tenant: each holds at most its share of the table (`full`)
    operator: bool = False  # an operator pin, not a worker's lease (not counted in `full`)
    priority: int = 0  # an operator pin's (retention.PIN_PRIORITIES): lower gives way first


@dataclass(frozen=True)
class Reservation:
    id: int
    tier: TierKind
    slots: tuple[int, ...]
    expires_at: float
    namespace: int = -1  # row of the namespace it was reserved for (its tenant's quota); -1: none given
    layout: int = 0  # the KV layout whose slots these are (the namespace's; the cache's first without one)


# With several tenants, one holds at most this share of max_leases: one client taking every
# lease cannot refuse every other tenant's next one (issue 33).
TENANT_LEASE_SHARE = 0.5


class LeaseTable:
    """The live leases and reservations of one cache, by id."""

    def __init__(self, max_leases: int) -> None:
        self.max_leases = max_leases
        self.tenant_share = max(1, int(max_leases * TENANT_LEASE_SHARE))
        self._per_tenant: dict[str, int] = {}  # live leases by tenant
        self._leases: dict[int, Lease] = {}
        self._pins = 0  # how many of `_leases` are operator pins
        self._reservations: dict[int, Reservation] = {}
        self._random = array.array("Q")  # unused random 64-bit words for ids

    # -- leases ------------------------------------------------------------------
    def lease_count(self) -> int:
        """Workers' leases (operator pins not counted)."""
        return len(self._leases) - self._pins

    def leases(self) -> Iterable[Lease]:
        """Every lease, operator pins included (each holds its index pins)."""
        return self._leases.values()

    def pins(self) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.operator]

    def full(self, tenant: str | None = None) -> bool:
        """No lease may be added now: the table is full, or `tenant` (given when the cache holds
        several tenants) holds its share. Operator pins count in neither."""
        if self.lease_count() >= self.max_leases:
            return True
        return tenant is not None and self._per_tenant.get(tenant, 0) >= self.tenant_share

    def tenant_leases(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def _counted_out(self, lease: Lease) -> None:
        if lease.operator:
            self._pins -= 1
            return
        left = self._per_tenant[lease.tenant] - 1
        if left:
            self._per_tenant[lease.tenant] = left
        else:
            del self._per_tenant[lease.tenant]

    def add_lease(
        self,
        namespace: int,
        nodes: tuple[int, ...],
        expires_at: float,
        tenant: str = "",
        operator: bool = False,
        priority: int = 0,
        lease_id: int | None = None,
    ) -> Lease:
        """`lease_id`: the id to use where it is free (a pin of the last run made again)."""
        if lease_id is None or lease_id in self._leases or lease_id in self._reservations:
            lease_id = self._new_id()
        lease = Lease(lease_id, namespace, nodes, expires_at, tenant, operator, priority)
        self._leases[lease.id] = lease
        if operator:
            self._pins += 1
        else:
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return lease

    def live_lease(self, lease_id: int, now: float, operator: bool = False) -> Lease | None:
        """The lease (or, with `operator`, the pin) if it exists and has not expired (an expired
        one stays until reclaimed)."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at > now and lease.operator == operator else None

    def pop_lease(self, lease_id: int, operator: bool = False) -> Lease | None:
        """Remove a lease (with `operator`, a pin); a pin is never taken for a lease or back."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.operator != operator:
            return None
        self._counted_out(lease)
        return self._leases.pop(lease_id)

    # -- reservations ----------------------------------------------------------------
    def reservations(self) -> Iterable[Reservation]:
        return self._reservations.values()

    def add_reservation(
        self, tier: TierKind, slots: tuple[int, ...], expires_at: float, namespace: int, layout: int = 0
    ) -> Reservation:
        reservation = Reservation(self._new_id(), tier, slots, expires_at, namespace, layout)
        self._reservations[reservation.id] = reservation
        return reservation

    def reservation(self, reservation_id: int) -> Reservation | None:
        return self._reservations.get(reservation_id)

    def take_reservation(self, reservation_id: int) -> Reservation | None:
        """Remove and return a reservation (its slots are now the caller's to publish or free)."""
        return self._reservations.pop(reservation_id, None)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._leases or entry_id in self._reservations

    # -- expiry ------------------------------------------------------------------------
    def expired(self, now: float) -> tuple[list[Lease], list[Reservation]]:
        """Remove and return the leases and reservations whose `expires_at` has passed."""
        leases = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in leases:
            del self._leases[lease.id]
            self._counted_out(lease)
        reservations = [r for r in self._reservations.values() if r.expires_at <= now]
        for reservation in reservations:
            del self._reservations[reservation.id]
        return leases, reservations

    def _new_id(self) -> int:
        while True:
            if not self._random:  # the OS's randomness drawn 256 ids at a time (a draw costs a syscall)
                self._random = array.array("Q", secrets.token_bytes(8 * 256))
            candidate = self._random.pop() >> 1 or 1
            if candidate not in self:
                return candidate
