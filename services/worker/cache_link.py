"""The worker's fail-open link to the cache service: lookup, read, store and release.

It owns every call to the service on the request path. The hit policy (hit_policy.py)
only decides how much of a hit to load; the link does the read and reports its timing
back to the policy, and feeds it each prefill (`observe`).

Wraps `CacheClient` so that the cache can only make a request faster, never
fail it: every call has a deadline; any cache failure (service down, slower
than the deadline, invalid reply, expired lease) turns into "prefill in full"
for that request, is counted as a fallback, and marks the link down. While
down, requests skip the cache without waiting (counted too); the link
re-attaches after a backoff, on a fresh gRPC channel (the old one may be in
gRPC's own, much longer, reconnect backoff). Two cases do not take the link
down: a lookup rejected for the request's own tokens or salt (only that
request prefills in full), and a service that restarted and forgot the
namespace (the link attaches again at once and retries the lookup). When to
re-attach is the shared `CircuitBreaker` (prefixcache/breaker.py): one
failure takes the link down, re-attach attempts follow after 1-2 s (jittered,
`RETRY_MAX_S`). State changes are logged once, not per request.

Invariant: the prefix KV handed to the engine covers strictly fewer tokens
than the prompt (at least one token is always computed), and the `Hit`'s
lease is released exactly once (`release`, queued by the backend's `finally` on store_queue.py's
thread, after the request's store). `store` and `release` run on that thread, the rest on the
inference thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter

from prefixcache.breaker import Backoff, CircuitBreaker
from prefixcache.client import CacheClient
from prefixcache.client.api import Hit
from prefixcache.config import KVLayout
from prefixcache.errors import InvalidArgument, PrefixCacheError

from .engine import PrefillResult
from .events import LinkState
from .hit_policy import Decision, HitPolicy, ReadPath
from .model import LoadedModel

log = logging.getLogger(__name__)

# Re-attach backoff while the service is down: at most 2 s (1-2 s with jitter), as before the
# breaker: a longer cap kept workers off a recovered service past the chaos soak's recovery window.
RETRY_MIN_S = RETRY_MAX_S = 2.0
REQUEST_FIELDS = frozenset({"tokens", "cache_salt"})  # a lookup rejected for these is the request's fault


class CacheLink:
    def __init__(
        self,
        address: str,
        loaded: LoadedModel,
        block_size: int,
        deadline_s: float,
        registry: CollectorRegistry,
        auth_token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: HitPolicy | None = None,
    ) -> None:
        kv = loaded.kv
        self.layout = KVLayout(kv.layers, kv.kv_heads, kv.head_dim, block_size, kv.dtype)
        self.model_id, self.revision = loaded.model_id, loaded.weights_digest
        self.deadline_s = deadline_s
        self.clock = clock
        self._address, self._auth_token = address, auth_token
        self._client = self._new_client()
        self._attached = False
        self._failed = False  # the link went down since the client's channel was opened
        self._breaker = CircuitBreaker("cache link", 1, Backoff(RETRY_MIN_S, RETRY_MAX_S), clock=clock)
        self._lock = threading.Lock()  # one Attach at a time
        self._state_lock = threading.Lock()  # up/down transitions: the store thread fails too
        self.fallbacks = Counter(
            "prefixcache_worker_cache_fallbacks",
            "Requests served without the cache because it failed or was down",
            ["stage"],
            registry=registry,
        )
        self.policy = policy if policy is not None else HitPolicy(registry)  # load or recompute (hit_policy.py)

    def _new_client(self) -> CacheClient:
        return CacheClient(self._address, auth_token=self._auth_token, timeout_s=self.deadline_s)

    @property
    def up(self) -> bool:
        return self._attached

    @property
    def state(self) -> LinkState:
        """UP, DOWN (failed, re-attaching after a backoff) or PENDING (not attached yet)."""
        if self._attached:
            return LinkState.UP
        return LinkState.DOWN if self._failed else LinkState.PENDING

    def connect(self) -> bool:
        """Attach now if possible (at start-up, so the first request does not pay for it)."""
        return self._ready()

    def _ready(self) -> bool:
        """Attached, or re-attached now if the backoff has passed."""
        if self._attached:
            return True
        if not self._breaker.is_up() and not self._breaker.probe_due():
            self.fallbacks.labels("down").inc()  # skipped without trying: the link is in its backoff
            return False
        return self._attach()

    def _attach(self) -> bool:
        with self._lock:
            if self._failed:
                # A fresh channel: the old one may sit in gRPC's exponential reconnect
                # backoff (up to minutes), failing every call fast after the service is back.
                self._client.close()
                self._client = self._new_client()
            try:
                self._client.attach(
                    self.model_id,
                    self.layout,
                    revision=self.revision,
                    same_host=True,
                    timeout_s=max(self.deadline_s, 1.0),
                )
            except PrefixCacheError as error:
                self._down("attach", error)
                return False
            with self._state_lock:
                self._attached, self._failed = True, False
            self._breaker.record_success()
            log.info(
                "cache link up (%s, namespace %s, shared memory %s)",
                self._client.address,
                self._client.attachment.namespace_id,
                self._client.attachment.shared_memory,
            )
            return True

    def _down(self, stage: str, error: Exception) -> None:
        self.fallbacks.labels(stage).inc()
        with self._state_lock:  # logged once when the inference and store threads fail together
            if self._attached or not self._failed:
                log.warning("cache link down (%s failed: %s); prefilling in full until it recovers", stage, error)
            self._breaker.record_failure(f"{stage}: {error}")  # (re)schedules the next attach attempt
            self._attached, self._failed = False, True

    def lookup(self, tokens: list[int], salt: str | None) -> tuple[Hit | None, torch.Tensor | None]:
        """The leased hit (None when the link is down or the Lookup failed) and the KV of the
        leading blocks the policy decided to load (None: none), `[n, *block_shape]`.

        The caller releases the hit (`release`) whatever happens, also after a failed read."""
        if not self._ready():
            return None, None
        hit = self._leased_hit(tokens, salt)
        if hit is None:
            return None, None
        decision = self.policy.decide(hit, self.layout)
        if decision.blocks == 0:
            return hit, None
        try:
            return hit, self._read(hit, decision)
        except PrefixCacheError as error:
            self._down("read", error)
            return hit, None

    def _read(self, hit: Hit, decision: Decision) -> torch.Tensor:
        """The decided leading blocks, read by the decided path (and timed for the policy's
        estimate of that path: a stream moves the whole lease)."""
        assert decision.path is not None  # a decision that loads blocks has a path
        started = time.perf_counter()
        blocks = self._client.read(hit, blocks=slice(0, decision.blocks))
        moved = decision.blocks if decision.path is ReadPath.MAPPED else hit.blocks
        self.policy.observe_read(decision.path, moved * self.layout.block_bytes, time.perf_counter() - started)
        return blocks

    def observe(self, prefill: PrefillResult, prefix_blocks: torch.Tensor | None) -> None:
        """One real prefill, for the policy's load-or-recompute estimates."""
        self.policy.observe(prefill, prefix_blocks)

    def _leased_hit(self, tokens: list[int], salt: str | None) -> Hit | None:
        """The Lookup (with a lease), or None after counting the failure."""
        for retried in (False, True):
            try:
                return self._client.lookup(
                    tokens, cache_salt=salt, take_lease=True, recompute_s_per_token=self.policy.recompute_s_per_token()
                )
            except InvalidArgument as error:
                if error.field == "namespace_id" and not retried:  # as the proto names it
                    # The service restarted and forgot this worker's namespace: attach again at
                    # once (it answers, so no backoff) and this request still gets its hit.
                    log.info("cache service lost this namespace (restarted?); attaching again")
                    self._attached = False
                    if self._attach():
                        continue
                elif error.field in REQUEST_FIELDS:  # this request's fault: the link stays up
                    self.fallbacks.labels("rejected").inc()
                    log.info("cache lookup rejected this request (%s); prefilling in full", error)
                else:
                    self._down("lookup", error)
                return None
            except PrefixCacheError as error:
                self._down("lookup", error)
                return None
        return None

    def cached_blocks(self, tokens: list[int], salt: str | None) -> int | None:
        """Leading full blocks of `tokens` cached right now (Inspect: no lease, no LRU touch);
        None when the link is down or the service cannot say."""
        if not self._ready():
            return None
        try:
            return self._client.inspect(tokens, cache_salt=salt).hit_tokens // self.layout.block_size
        except PrefixCacheError as error:
            log.info("cache inspect failed (%s)", error)
            return None

    def blocks_to_store(self, tokens: list[int], start_block: int) -> int:
        """How many full blocks from `start_block` on `store` would send now (0: none, or the link is down)."""
        end = len(tokens) // self.layout.block_size
        return max(0, end - start_block) if self._attached else 0

    def store(self, tokens: list[int], kv: torch.Tensor, start_block: int, salt: str | None) -> None:
        """Commit `kv[i]` as block `start_block + i` of the prompt."""
        if not self._attached or not len(kv):
            return
        try:
            self._client.store(tokens, kv, start_block=start_block, cache_salt=salt)
        except PrefixCacheError as error:
            self._down("store", error)

    def release(self, hit: Hit | None) -> None:
        if hit is None or hit.lease_id is None:
            return
        try:
            self._client.release(hit)
        except PrefixCacheError as error:
            self._down("release", error)  # the service's lease timeout reclaims it

    def close(self) -> None:
        self._client.close()
