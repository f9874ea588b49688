"""Match against each engine's cache service: cheap, concurrent, bounded.

Owns `CacheProbe`, one engine's cache service as the router sees it: a `CacheClient` (gRPC,
thread-safe), the namespace its engine attaches to and the service's block size. `resolve`
(from the health loop, never on a request's path) finds the namespace: `--namespace` if given,
else the service's only unsalted namespace, else the unsalted one holding the most resident
blocks (a request's `cache_salt` goes with the Match, which finds the salted sibling itself). `match` runs
one Match on the router's thread pool with a gRPC deadline of `timeout_s` and an outer
`asyncio.wait_for` of the same length plus a margin: a slow, down or unresolved service is
scored as a miss (a `Hit` of zeros) and never holds the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from prefixcache.client import CacheClient

from .scoring import Hit

log = logging.getLogger(__name__)

OUTER_MARGIN_S = 0.01


class CacheProbe:
    def __init__(self, address: str, timeout_s: float, namespace: str | None = None, auth_token: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.namespace = namespace
        self._fixed_namespace = namespace is not None
        self.block_size = 0
        self.client = CacheClient(address, auth_token=auth_token, timeout_s=max(timeout_s, 2.0))
        self.outcomes: dict[str, int] = {"ok": 0, "timeout": 0, "error": 0, "unresolved": 0}
        self.last_match_s = 0.0

    def resolve(self) -> bool:
        """Blocking (a thread of the health loop): the namespace and block size, if any engine attached yet."""
        if self.namespace is not None and self.block_size:
            return True
        stats = self.client.stats(timeout_s=2.0)
        if stats.layout is None:
            return False
        self.block_size = stats.layout.block_size
        if not self._fixed_namespace:
            # A request's cache_salt makes a salted sibling namespace; Match takes the base one
            # and the salt, so only unsalted namespaces are candidates.
            entries = [e for e in self.client.namespaces(timeout_s=2.0) if not e.salted]
            if not entries:
                return False
            chosen = max(entries, key=lambda e: sum(e.blocks.values()))
            if len(entries) > 1:
                log.warning(
                    "cache %s holds %d unsalted namespaces; matching against %s (%s), the fullest; pass --namespace to choose",
                    self.address,
                    len(entries),
                    chosen.namespace_id,
                    chosen.model,
                )
            self.namespace = chosen.namespace_id
        return True

    def _match(self, tokens: list[int], salt: str | None) -> Hit:
        report = self.client.match(tokens, cache_salt=salt, namespace_id=self.namespace, timeout_s=self.timeout_s)
        return Hit(
            len(tokens),
            self.block_size,
            report.blocks.get("device", 0),
            report.blocks.get("host", 0),
            report.remote_blocks,
            report.disk_blocks,
        )

    async def match(self, executor: Executor, tokens: list[int], salt: str | None) -> tuple[Hit, str]:
        """(the hit, "ok" | "timeout" | "error" | "unresolved"); a miss unless "ok"."""
        miss = Hit(len(tokens))
        if self.namespace is None or not self.block_size:
            outcome = "unresolved"
            self.outcomes[outcome] += 1
            return miss, outcome
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            hit = await asyncio.wait_for(
                loop.run_in_executor(executor, self._match, tokens, salt), self.timeout_s + OUTER_MARGIN_S
            )
            outcome = "ok"
        except TimeoutError:
            hit, outcome = miss, "timeout"
        except Exception as error:  # noqa: BLE001 - any failure of the probe is a miss, never the request's
            hit = miss
            outcome = "timeout" if "DEADLINE" in str(error).upper() else "error"
            log.debug("match on %s failed: %s", self.address, error)
        self.last_match_s = time.perf_counter() - started
        self.outcomes[outcome] += 1
        return hit, outcome

    def close(self) -> None:
        self.client.close()
