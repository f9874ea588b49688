"""The scheduler half: ask the service what vLLM may load, plan loads and saves per step.

Per request: `match` (vLLM's get_num_new_matched_tokens) looks the prompt up with a lease and
answers the cached tokens beyond vLLM's own prefix cache; `allocated` records the blocks vLLM
gave it; `build` turns that into a `LoadOp` the step it is first scheduled and a `SaveOp` the
step its prompt is fully computed; `finished` forgets it and releases a lease no worker took.

Invariants:
- External tokens are a whole number of vLLM blocks, never reach the prompt's last token
  (vLLM must compute >= 1 token) and never exceed the leased hit.
- A lease is either handed to the worker in a `LoadOp` (the worker releases it) or released
  here; re-asking about a request first releases the previous lease (the call is side-effect
  free as vLLM requires).
- Saves start at the block the cache already holds for this prompt (the hit's end), so the
  service's "commit after a cached prefix" rule holds; the service verifies tokens itself.
- Any service failure means 0 external tokens: the request prefills normally.
- The `auto` policy's prefill rate is vLLM's own, measured by `PrefillMeter` from the steps
  this side sees (the prior only until a few steps were timed, and again once they are stale).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...client.api import Attachment, CacheClient, Hit
from ...errors import PrefixCacheError
from ...tiers.base import TierKind
from ...transfer import TransferEstimate, TransferMeter
from .link import LOGGER, CacheLink, service_level
from .metadata import LoadOp, PrefixCacheMetadata, SaveOp
from .stats import StatsBox

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)

# Priors of the `auto` hit policy (services/worker/hit_policy.py measures these on the reference worker).
MAPPED_LOAD = TransferEstimate(latency_s=100e-6, bytes_per_s=2e9)  # shared memory -> staging -> paged cache
STREAM_LOAD = TransferEstimate(latency_s=2e-3, bytes_per_s=300e6)  # gRPC Fetch stream on loopback
PREFILL_PRIOR_TOKENS_PER_S = 5e3
PREFILL_PRIOR_STEP_S = 5e-3  # a step's fixed cost in the prior (the reference worker's prior too)
MAX_STEP_S = 60.0  # a longer gap between two steps is not a step (the engine waited)
PREFILL_STALE_S = 120.0  # older measurements give way to the prior again


class PrefillMeter:
    """vLLM's own step cost, `seconds = per-step latency + tokens / tokens_per_s`, learned online.

    vLLM calls `build_connector_meta` once per step, right after scheduling it; the time from
    one call to the next is that step's forward (and output processing) plus the next step's
    scheduling. `step(tokens)` closes the previous step's interval and opens this one's; from
    it are taken the time the connector itself spent in the interval (its Lookups, `exclude`)
    and the estimated time of the step's planned loads (the worker copies them inside the
    forward, so they are not vLLM's compute). A gap in which vLLM had no request (`idle`) is
    not a step. The fit is `TransferMeter`'s with "bytes" = scheduled tokens (prefill and
    decode alike: a forward costs per token), so its bandwidth is the marginal tokens per
    second that a hit saves. Not thread-safe: the scheduler's one thread owns it.
    """

    def __init__(self, prior_tokens_per_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._meter = TransferMeter(
            TransferEstimate(PREFILL_PRIOR_STEP_S, prior_tokens_per_s), stale_s=PREFILL_STALE_S, clock=clock
        )
        self._open: tuple[float, int, float] | None = None  # (start, tokens, planned load seconds)
        self._excluded = 0.0
        self.observed = 0  # steps timed so far

    def step(self, tokens: int, load_s: float = 0.0) -> None:
        now = self._clock()
        if self._open is not None:
            started, previous, previous_load_s = self._open
            seconds = now - started - self._excluded - previous_load_s
            if previous > 0 and 0 < seconds < MAX_STEP_S:
                self._meter.observe(previous, seconds)
                self.observed += 1
                if self.observed >= 8 and not self.observed & (self.observed - 1):
                    self.log()  # at 8, 16, 32, ... timed steps
        self._open, self._excluded = ((now, tokens, load_s) if tokens > 0 else None), 0.0

    def exclude(self, seconds: float) -> None:
        """Time inside the open interval that was the connector's, not vLLM's (a Lookup)."""
        self._excluded += seconds

    def idle(self) -> None:
        """vLLM had nothing running: the open interval includes waiting for requests."""
        self._open, self._excluded = None, 0.0

    def estimate(self) -> TransferEstimate:
        return self._meter.estimate()

    @property
    def tokens_per_s(self) -> float:
        return self._meter.estimate().bytes_per_s

    def log(self) -> None:
        """vLLM's step cost as measured so far, at INFO (at 8, 16, 32, ... steps and at shutdown:
        a line survives an engine process killed before its shutdown)."""
        e = self.estimate()
        log.info(
            "prefixcache scheduler: vLLM's measured step cost %.3g ms + %.4g tokens/s (%s)",
            1000 * e.latency_s,
            e.bytes_per_s,
            f"{e.samples} steps" if e.samples else "the prior",
        )


def worth_loading(
    tokens: int, block_size: int, block_bytes: int, mapped: bool, leased_blocks: int, prefill_tokens_per_s: float
) -> bool:
    """The `auto` policy: is copying `tokens` (whole blocks) expected to beat prefilling them?
    A mapped load copies just those blocks; a stream load moves the whole lease."""
    load_s = (
        MAPPED_LOAD.seconds(tokens // block_size * block_bytes)
        if mapped
        else STREAM_LOAD.seconds(leased_blocks * block_bytes)
    )
    return load_s < tokens / prefill_tokens_per_s


@dataclass
class _Request:
    request: Request
    salt: str | None
    hit: Hit | None = None
    attachment: Attachment | None = None
    local_tokens: int = 0  # computed by vLLM's own prefix cache
    external_tokens: int = 0  # promised to vLLM from the cache
    cached_blocks: int = 0  # blocks of this prompt the cache holds (saves start here)
    block_ids: list[int] = field(default_factory=list)
    load_pending: bool = False
    saved: bool = False


class SchedulerSide:
    def __init__(self, link: CacheLink, stats: StatsBox, block_size: int) -> None:
        self.link = link
        self.stats = stats
        self.block_size = block_size
        self.settings = link.settings
        self._requests: dict[str, _Request] = {}
        self.prefill = PrefillMeter(self.settings.prefill_tokens_per_s or PREFILL_PRIOR_TOKENS_PER_S)

    # -- get_num_new_matched_tokens ------------------------------------------------------
    def match(self, request: Request, num_computed_tokens: int) -> int:
        state = self._requests.get(request.request_id)
        if state is None:
            if not self._requests:
                self.prefill.idle()  # no request was running: vLLM waited for this one
            state = _Request(request, self.settings.salt_for(getattr(request, "cache_salt", None)))
            self._requests[request.request_id] = state
        self._drop_lease(state)
        state.local_tokens, state.external_tokens = num_computed_tokens, 0
        prompt = list(request.prompt_token_ids or ())
        usable = (len(prompt) - 1) // self.block_size * self.block_size  # vLLM computes >= 1 token
        if usable <= num_computed_tokens:
            return 0  # nothing to gain; saves still start at vLLM's own local blocks' worth of 0
        self.stats.add(lookups=1)
        recompute = None if self.settings.hit_policy == "always" else 1.0 / self.prefill.tokens_per_s
        started = time.perf_counter()
        try:
            answer = self.link.call(
                lambda client, _: client.lookup(
                    prompt,
                    cache_salt=state.salt,
                    take_lease=True,
                    timeout_s=self.settings.lookup_timeout_s,
                    recompute_s_per_token=recompute,
                )
            )
        except PrefixCacheError as error:
            if service_level(error):
                self.link.failed(error)
            self.stats.add(lookup_errors=1)
            return 0
        finally:
            self.prefill.exclude(time.perf_counter() - started)
        if answer is None:
            self.stats.add(lookup_errors=1)
            return 0
        hit, attachment = answer
        attached = self.link.client()
        client = attached[0] if attached is not None else None
        if not self._valid(hit, attachment, len(prompt), state.salt):
            self._release(client, hit)
            self.link.failed(
                PrefixCacheError(
                    f"invalid Lookup answer for {len(prompt)} tokens: "
                    f"{hit.hit_tokens} hit tokens in {hit.blocks} blocks"
                )
            )
            self.stats.add(lookup_errors=1)
            return 0
        state.cached_blocks = hit.hit_tokens // self.block_size
        external = min(hit.hit_tokens, usable) - num_computed_tokens
        if external > 0 and not self._worth_loading(external, num_computed_tokens, hit, attachment):
            external = 0
        if external <= 0:
            self._release(client, hit)
            self.stats.add(misses=1)
            return 0
        state.hit, state.attachment, state.external_tokens = hit, attachment, external
        self.stats.add(offered_tokens=external)
        return external

    def _valid(self, hit: Hit, attachment: Attachment, prompt_tokens: int, salt: str | None) -> bool:
        # A salted lookup answers in the salted namespace, whose id differs from the attached one.
        return (
            (salt is not None or hit.namespace_id == attachment.namespace_id)
            and hit.prompt_tokens == prompt_tokens
            and 0 <= hit.hit_tokens <= prompt_tokens
            and hit.hit_tokens % self.block_size == 0
            and hit.blocks == hit.hit_tokens // self.block_size
            and (hit.blocks == 0 or hit.lease_id is not None)
            and bool(np.all(np.isin(hit.locations.tiers, (int(TierKind.DEVICE), int(TierKind.HOST)))))
        )

    def _worth_loading(self, external: int, local: int, hit: Hit, attachment: Attachment) -> bool:
        if self.settings.hit_policy == "always":
            return True
        end = (local + external) // self.block_size
        mapped = end <= hit.mapped_blocks  # else the worker's read takes the Fetch stream
        return worth_loading(
            external,
            attachment.layout.block_size,
            attachment.layout.block_bytes,
            mapped,
            hit.blocks,
            self.prefill.tokens_per_s,
        )

    # -- update_state_after_alloc ---------------------------------------------------------
    def allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(block_ids)
        if num_external_tokens > 0 and state.hit is not None:
            if num_external_tokens != state.external_tokens:  # vLLM trimmed it (e.g. a local sub-block tail)
                log.debug(
                    "request %s: vLLM loads %d of %d offered tokens",
                    request.request_id,
                    num_external_tokens,
                    state.external_tokens,
                )
                state.external_tokens = num_external_tokens // self.block_size * self.block_size
            state.load_pending = state.external_tokens > 0
            self.stats.add(hits=1, external_tokens=state.external_tokens)
        elif state.hit is not None:
            self._drop_lease(state)

    # -- build_connector_meta -------------------------------------------------------------
    def build(self, scheduler_output: SchedulerOutput) -> PrefixCacheMetadata:
        meta = PrefixCacheMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(state, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                state.block_ids = list(new_ids[0]) if req_id in resumed else state.block_ids + list(new_ids[0])
            self._plan(state, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        block_bytes = self.link.layout.block_bytes
        load_s = sum(MAPPED_LOAD.seconds(len(op.block_ids) * block_bytes) for op in meta.loads)
        self.prefill.step(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0), load_s)
        return meta

    def _plan(self, state: _Request, req_id: str, computed_after_step: int, meta: PrefixCacheMetadata) -> None:
        bs = self.block_size
        if state.load_pending and state.hit is not None and state.attachment is not None:
            hit, first = state.hit, state.local_tokens // bs
            end = first + state.external_tokens // bs
            meta.loads.append(
                LoadOp(req_id, hit, state.attachment.host_segment, first, tuple(state.block_ids[first:end]))
            )
            state.load_pending, state.hit = False, None  # the worker owns the lease now
            state.cached_blocks = max(state.cached_blocks, end)
        prompt = state.request.prompt_token_ids or ()
        if not state.saved and computed_after_step >= len(prompt):
            state.saved = True
            full = len(prompt) // bs
            start = state.cached_blocks
            if full > start and len(state.block_ids) >= full:
                meta.saves.append(
                    SaveOp(req_id, tuple(prompt[: full * bs]), start, tuple(state.block_ids[start:full]), state.salt)
                )

    # -- request_finished -----------------------------------------------------------------
    def finished(self, request: Request) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_lease(state)

    def _drop_lease(self, state: _Request) -> None:
        if state.hit is not None and state.hit.lease_id:
            attached = self.link.client()
            if attached is not None:
                self._release(attached[0], state.hit)
        state.hit, state.load_pending = None, False

    def _release(self, client: CacheClient | None, hit: Hit) -> None:
        if client is None:
            return
        try:
            client.release(hit)
        except PrefixCacheError as error:
            self.link.failed(error)
