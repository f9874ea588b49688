"""Tenants inside one cache: the tenant of every namespace row and each tenant's counters.

The tenant of a block is the `tenant` of its namespace (set by the service from the caller's
credential). This table is what the parts that count per tenant share: `Placement` counts each
eviction against its block's tenant, the cache its lookups and commits, `TenantLedger`
(quota.py) reads it for quotas and per-tenant snapshots. It depends on the index alone, so each
of those is built with it, and none is built with another's callbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .index import RadixIndex
from .stats import Counters

Members = Callable[[np.ndarray], np.ndarray]


class Tenants:
    """Tenant number of every namespace row; names, and counters, by number."""

    def __init__(self, index: RadixIndex, max_namespaces: int = int(np.iinfo(np.int16).max) + 1) -> None:
        self._index = index
        self._tenant_of_ns = np.zeros(max_namespaces, dtype=np.int32)  # namespace row -> tenant number
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []
        self._counters: list[Counters] = []

    def register(self, ns_row: int, tenant: str) -> None:
        """Record the tenant of a newly attached namespace row."""
        number = self._numbers.get(tenant)
        if number is None:
            number = self._numbers[tenant] = len(self._names)
            self._names.append(tenant)
            self._counters.append(Counters())
        self._tenant_of_ns[ns_row] = number

    def tenant(self, ns_row: int) -> str:
        return self._names[int(self._tenant_of_ns[ns_row])]

    def counters(self, ns_row: int) -> Counters:
        """The counters of the tenant that owns namespace row `ns_row`."""
        return self._counters[int(self._tenant_of_ns[ns_row])]

    def sole_counters(self) -> Counters | None:
        """The counters of the one tenant when only one has attached (every block is its own)."""
        return self._counters[0] if len(self._counters) == 1 else None

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
