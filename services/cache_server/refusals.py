"""Attaches the service refused, kept where the operator looks (GetStats, ListNamespaces, /metrics).

An engine whose Attach is refused (a block size that is not a multiple of the service's, a
block larger than a chunk, a tenant at its namespace limit, a malformed layout) runs without
the cache and says so only in its own log; from the service it looked like a cache nobody uses.
Each refusal is counted by the request field refused, and the latest few kinds (tenant, model,
revision, field) keep their last message, so `prefixcache namespaces` names the engine and why.

Invariants: bounded memory (at most MAX_KINDS kinds, the least recent dropped); a tenant sees
only its own kinds; the counts by field only grow (a Prometheus counter reads them).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from prefixcache.wire import RefusedAttach

MAX_KINDS = 64


class AttachRefusals:
    """Thread-safe record of refused Attach calls."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_field: dict[str, int] = {}
        self._kinds: OrderedDict[tuple[str, str, str, str], tuple[str, int, float]] = OrderedDict()

    def record(self, tenant: str, model: str, revision: str, field: str, reason: str) -> None:
        key = (tenant, model[:512], revision[:512], field)
        with self._lock:
            self._by_field[field] = self._by_field.get(field, 0) + 1
            count = self._kinds.pop(key, ("", 0, 0.0))[1]
            self._kinds[key] = (reason[:1024], count + 1, self._clock())
            while len(self._kinds) > MAX_KINDS:
                self._kinds.popitem(last=False)

    def by_field(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_field)

    def recent(self, tenant: str | None) -> list[RefusedAttach]:
        """Newest first; `tenant` None: every tenant's (an admin), named."""
        now = self._clock()
        with self._lock:
            kinds = list(self._kinds.items())
        return [
            RefusedAttach(model, revision, owner if tenant is None else "", field, reason, count, now - last)
            for (owner, model, revision, field), (reason, count, last) in reversed(kinds)
            if tenant is None or owner == tenant
        ]
