"""The worker's use of the cache service on the request path: lookup, read, store and release.

It owns every call to the service on the request path, through the library's fail-open link
(prefixcache/client/link.py: attach with backoff, one classification of errors, drop a failed
client and re-attach). The hit policy (hit_policy.py) only decides how much of a hit to load;
`WorkerLink` does the read and reports its timing back to the policy, and feeds it each prefill
(`observe`). What is the worker's own: its namespace (the loaded model, `--block-size`), every
call's deadline (`--cache-deadline-ms`), the fallback counters, /health's `LinkState`.

A prompt that the service's presence table (prefixcache/presence.py) shows holding no block of
is not looked up: a miss then costs a read of shared memory, not a call.

The cache can only make a request faster, never fail it: every call has a deadline; any cache
failure (service down, slower than the deadline, invalid reply, expired lease) turns into
"prefill in full" for that request and is counted as a fallback. A service-level failure (see
`service_level`) also drops the link's client: while down, requests skip the cache without
waiting (counted too) until the link re-attaches after its backoff; a failure that is the
request's own (its tokens or salt rejected, its lease expired) costs only that request.

Invariant: the prefix KV handed to the engine covers strictly fewer tokens than the prompt (at
least one token is always computed), and the `Hit`'s lease is released exactly once (`release`,
queued by the backend's `finally` on store_queue.py's thread, after the request's store). `store`
and `release` run on that thread, the rest on the inference thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry, Counter

from prefixcache.client.api import Attachment, CacheClient, Hit
from prefixcache.client.hit_policy import Decision, ReadPath
from prefixcache.client.link import CacheLink, service_level
from prefixcache.config import KVLayout, Namespace
from prefixcache.errors import PrefixCacheError

from .engine import PrefillResult
from .events import LinkState
from .hit_policy import HitPolicy
from .model import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerLink:
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
        self.link = CacheLink(
            address,
            Namespace(self.model_id, self.revision, self.layout),
            auth_token=auth_token,
            timeout_s=deadline_s,
            attach_timeout_s=max(deadline_s, 1.0),
            logger=log,
            clock=clock,
        )
        self.fallbacks = Counter(
            "prefixcache_worker_cache_fallbacks",
            "Requests served without the cache because it failed or was down",
            ["stage"],
            registry=registry,
        )
        self.lookups_skipped = Counter(
            "prefixcache_worker_lookups_skipped",
            "Lookups not sent: the service's presence table held no block of the prompt",
            registry=registry,
        )
        self.policy = policy if policy is not None else HitPolicy(registry)  # load or recompute (hit_policy.py)

    @property
    def up(self) -> bool:
        """Attached now."""
        return self.link.up is True

    @property
    def state(self) -> LinkState:
        """UP, DOWN (failed, re-attaching after a backoff) or PENDING (not attached yet)."""
        up = self.link.up
        return LinkState.PENDING if up is None else LinkState.UP if up else LinkState.DOWN

    def connect(self) -> bool:
        """Attach now if possible (at start-up, so the first request does not pay for it)."""
        return self._client() is not None

    def _client(self) -> tuple[CacheClient, Attachment] | None:
        """The attached client, or None after counting why not (in its backoff, or attaching failed)."""
        if self.link.skipping:
            self.fallbacks.labels("down").inc()  # skipped without trying: the link is in its backoff
            return None
        attached = self.link.client()
        if attached is None:
            self.fallbacks.labels("attach").inc()
        return attached

    def _call(self, stage: str, operation: Callable[[CacheClient, Attachment], T]) -> T | None:
        """`operation` through the link (which re-attaches a restarted service and tries once
        more), or None after counting the fallback."""
        if self._client() is None:
            return None
        try:
            answer = self.link.call(operation)
        except PrefixCacheError as error:
            self._failed(stage, error)  # a service-level failure: the link already dropped its client
            return None
        if answer is None:
            self.fallbacks.labels("attach").inc()  # the service failed and re-attaching failed
            return None
        return answer[0]

    def _failed(self, stage: str, error: PrefixCacheError, client: CacheClient | None = None) -> None:
        """Count a failed call; drop `client` when the service is unusable (else it was this call's fault)."""
        if service_level(error):
            self.fallbacks.labels(stage).inc()
            if client is not None:
                self.link.failed(error, client)
        else:
            self.fallbacks.labels("rejected").inc()
            log.info("cache %s rejected this request (%s); prefilling in full", stage, error)

    def lookup(self, tokens: list[int], salt: str | None) -> tuple[Hit | None, torch.Tensor | None]:
        """The leased hit (None when the link is down or the Lookup failed) and the KV of the
        leading blocks the policy decided to load (None: none), `[n, *block_shape]`.

        The caller releases the hit (`release`) whatever happens, also after a failed read."""
        if self._holds_nothing(tokens, salt):
            return None, None
        budget = self.policy.recompute_s_per_token()
        hit = self._call(
            "lookup",
            lambda client, _: client.lookup(tokens, cache_salt=salt, take_lease=True, recompute_s_per_token=budget),
        )
        if hit is None:
            return None, None
        decision = self.policy.decide(hit, self.layout)
        if decision.blocks == 0:
            return hit, None
        attached = self.link.client()
        if attached is None:
            self.fallbacks.labels("read").inc()
            return hit, None
        try:
            return hit, self._read(attached[0], hit, decision)
        except PrefixCacheError as error:
            self._failed("read", error, attached[0])
            return hit, None

    def _holds_nothing(self, tokens: list[int], salt: str | None) -> bool:
        """The presence table shows no block of `tokens` held (False where it cannot say:
        `CacheLink.held_tokens`)."""
        held = self.link.held_tokens(tokens, salt)
        if held is None or held >= self.layout.block_size:
            return False
        self.lookups_skipped.inc()
        return True

    def _read(self, client: CacheClient, hit: Hit, decision: Decision) -> torch.Tensor:
        """The decided leading blocks, read by the decided path (and timed for the policy's
        estimate of that path: a stream moves the whole lease)."""
        assert decision.path is not None  # a decision that loads blocks has a path
        started = time.perf_counter()
        blocks = client.read(hit, blocks=slice(0, decision.blocks))
        moved = decision.blocks if decision.path is ReadPath.MAPPED else hit.blocks
        self.policy.observe_read(decision.path, moved * self.layout.block_bytes, time.perf_counter() - started)
        return blocks

    def observe(self, prefill: PrefillResult, prefix_blocks: torch.Tensor | None) -> None:
        """One real prefill, for the policy's load-or-recompute estimates."""
        self.policy.observe(prefill, prefix_blocks)

    def cached_blocks(self, tokens: list[int], salt: str | None) -> int | None:
        """Leading full blocks of `tokens` cached right now (Inspect: no lease, no LRU touch);
        None when the link is down or the service cannot say."""
        if self.link.skipping:
            return None
        try:
            answer = self.link.call(lambda client, _: client.inspect(tokens, cache_salt=salt))
        except PrefixCacheError as error:
            log.info("cache inspect failed (%s)", error)
            return None
        return None if answer is None else answer[0].hit_tokens // self.layout.block_size

    def blocks_to_store(self, tokens: list[int], start_block: int, max_tokens: int | None = None) -> int:
        """How many full blocks from `start_block` on `store` would send now (0: none, or the link is
        down); with `max_tokens` (a request's prompt_cache_max_tokens), only blocks within them."""
        end = (len(tokens) if max_tokens is None else min(len(tokens), max_tokens)) // self.layout.block_size
        return max(0, end - start_block) if self.up else 0

    def store(
        self, tokens: list[int], kv: torch.Tensor, start_block: int, salt: str | None, retention_s: float | None = None
    ) -> None:
        """Commit `kv[i]` as block `start_block + i` of the prompt (kept `retention_s` if the service allows)."""
        if not self.up or not len(kv):
            return
        self._call(
            "store",
            lambda client, _: client.store(
                tokens, kv, start_block=start_block, cache_salt=salt, retention_s=retention_s
            ),
        )

    def release(self, hit: Hit | None) -> None:
        self.link.release(hit)  # a failure never raises: the service's lease timeout reclaims it

    def close(self) -> None:
        self.link.close()
