"""The scheduler half: ask the service what vLLM may load, plan loads and saves per step.

Nothing here waits for the service on vLLM's scheduler thread while vLLM has work running.
Per request: `started` (vLLM's on_new_request) sends the Lookup, with a lease, to a small
thread pool as the request arrives; where a same-host service publishes its presence table
(prefixcache/presence.py, read from shared memory) it reads that instead, and `match` answers 0
at once, sending no Lookup, when the table shows nothing cached past vLLM's own prefix (known
only there), else sends the Lookup then; `match` (get_num_new_matched_tokens) answers None ("ask
again next step") while it is in flight and vLLM is running other requests (after a grace of
at most `lookup_grace_s` per step, so a Lookup that is about to answer does not cost its
request a whole step) if a hit could repay that wait and that step (`worth_waiting`, with the
odds that a Lookup brings anything, `HitOdds`, learned from every answer: else the request
prefills now without it), waits for it when vLLM is idle (nothing to stall; unless at those
odds a hit would not repay even a grace's wait), and gives up at
`lookup_timeout_s` (the request then prefills in full). With the answer it offers the cached tokens beyond vLLM's own prefix cache,
copied within the step when that is cheap (`(n, False)`: the blocks are in this host's mapped
memory and the copy is estimated shorter than a step's fixed cost, so the request prefills its
suffix in the same step), else asynchronously (`(n, True)`: vLLM parks the request until the
worker reports the copy done, one or two steps later, and keeps stepping the others). `allocated` records the blocks vLLM gave it, one list per
KV cache group; `build` turns that into a `LoadOp` the same step, and into a `SaveOp` each step
that completes prompt blocks (sliding-window groups free blocks that leave the window in later
steps, so blocks are saved while vLLM holds them); `finished` forgets the request and releases
a lease no worker took, also one whose Lookup is still in flight.

Invariants:
- External tokens are a whole number of vLLM blocks, never reach the prompt's last token
  (vLLM must compute >= 1 token) and never exceed the leased hit.
- A lease is either handed to the worker in a `LoadOp` (the worker releases it) or released
  here, never by an RPC on vLLM's thread: a lease of the KV namespace goes back with the next
  Lookup (`LeaseReturns`; by a Release of its own when none comes within half a second), a
  state lease by a Release on a lookup thread; re-asking about a request first releases the
  previous lease (the call is side-effect free as vLLM requires).
- Saves start at the block the cache already holds for this prompt (the hit's end) and follow
  each other in prompt order, so the service's "commit after a cached prefix" rule holds; the
  service verifies tokens itself.
- Any service failure or a Lookup past its deadline means 0 external tokens: the request
  prefills normally.
- Models with state layers (Mamba, GDN; states.py): the Lookup thread also probes the states
  at the hit's last boundaries; vLLM is offered tokens up to the longest boundary whose state
  is stored (none: a miss, never a wrong state), and the states vLLM commits at prompt
  boundaries (`boundary_state_offloads`) are saved the step it offers them.
- Load or recompute is the library's one hit rule (prefixcache/client/hit_policy.py: `choose`
  on vLLM's fixed load priors, `UNTIMED_LOADS`); the `auto` policy's prefill rate is vLLM's
  own, measured by the library's `PrefillMeter` from the steps this side sees (the prior only
  until a few steps were timed, and again once they are stale).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ...client.api import Attachment, CacheClient, Hit
from ...client.hit_policy import MAPPED_LOAD, UNTIMED_LOADS, HitOdds, PrefillMeter, choose, worth_waiting
from ...client.link import CacheLink, LeaseReturns
from ...errors import InvalidArgument, PrefixCacheError
from ...kinds import TierKind
from ...retention import StoreHints, store_hints
from ...threads import name_os_thread
from ...transfer import TransferEstimate
from . import states
from .link import LOGGER, ConnectorLink
from .metadata import LoadOp, PrefixCacheMetadata, SaveOp, StateSaveOp
from .paged import NULL_BLOCK
from .stats import StatsBox

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)

PREFILL_STALE_S = 120.0  # older step timings give way to the prior again
LOOKUP_THREADS = 4  # Lookups in flight at once (a call waits without the GIL)
GRACE_SHARE = 0.25  # a step's Lookup waits stay under this share of the last step's length


@dataclass(frozen=True)
class Answer:
    hit: Hit
    attachment: Attachment
    state_blocks: int = 0  # models with state layers: the boundary whose state was found
    state: Hit | None = None  # ... and that state, leased


@dataclass
class _Request:
    request: Request
    salt: str | None
    pending: Future[Answer | None] | None = None  # the Lookup in flight
    held: int | None = None  # prompt tokens the service's index holds, by its presence table (None: unknown)
    held_fresh: bool = False  # `held` was read as the request arrived and not yet used by `match`
    deadline: float = 0.0  # time.monotonic() past which the request goes ahead without it
    hit: Hit | None = None
    attachment: Attachment | None = None
    state: Hit | None = None  # models with state layers: the leased state at state_blocks
    state_blocks: int = 0
    states_saved: set[int] = field(default_factory=set)  # boundaries (tokens) whose state was saved
    local_tokens: int = 0  # computed by vLLM's own prefix cache
    external_tokens: int = 0  # promised to vLLM from the cache
    cached_blocks: int = 0  # blocks of this prompt the cache holds (saves start here)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    load_pending: bool = False
    in_step: bool = False  # the load is copied within the step (start_load_kv), not by the loader thread
    saved_blocks: int = -1  # prompt blocks saved or held by the cache (-1: saving not started)
    saves_stopped: bool = False  # a block to save was already freed by vLLM: the chain ends here
    asked_again: bool = False  # the first answer's lease had ended before vLLM asked for it
    load_failed: bool = False  # its load failed: vLLM recomputes it, and is offered nothing again
    hints: StoreHints = StoreHints()  # its kv_transfer_params' retention hint and store bound


class SchedulerSide:
    def __init__(
        self,
        link: ConnectorLink,
        stats: StatsBox,
        block_size: int,
        loads: bool = True,
        state_link: ConnectorLink | None = None,
        state_groups: tuple[int, ...] = (),
        in_step_loads: bool = True,
        saves: bool = True,
    ) -> None:
        """`loads` False: save only (vLLM's kv_role kv_producer, or an engine that cannot prefill on
        top of loaded KV; see connector.py); `saves` False: load only (kv_role kv_consumer).
        `in_step_loads` False: every load is asynchronous (see `_load_in_step`).
        `state_link`, `state_groups`: the state namespace and KV cache groups of a model with state layers."""
        self.link = link
        self.state_link = state_link
        self.state_groups = tuple(sorted(set(state_groups)))
        self.in_step_loads = in_step_loads
        self.stats = stats
        self.block_size = block_size
        self.loads = loads
        self.saves = saves
        self.settings = link.settings
        self._requests: dict[str, _Request] = {}
        self._lookups = ThreadPoolExecutor(
            LOOKUP_THREADS,
            thread_name_prefix="prefixcache-lookup",
            initializer=name_os_thread,
            initargs=("pfx-lookup",),
        )
        self._returns = LeaseReturns(link)  # leases not needed, handed back with the next Lookup
        self._step_tokens = 0  # vLLM's last step computed this many tokens (> 0: a wait would stall it)
        self._last_build = time.perf_counter()  # build_connector_meta's last call: one per step
        self._last_step_s = 0.0  # from the call before it to that one
        self._grace_left = self.settings.lookup_grace_s  # this step's Lookup waits left (`_grace`)
        self.hit_odds = HitOdds()  # how often an answer reaches beyond vLLM's own prefix
        prior = UNTIMED_LOADS.prefill
        if self.settings.prefill_tokens_per_s:
            prior = TransferEstimate(prior.latency_s, self.settings.prefill_tokens_per_s)
        self.prefill = PrefillMeter(
            prior,
            stale_s=PREFILL_STALE_S,
            clock=time.perf_counter,
            name="prefixcache scheduler: vLLM's measured step cost",
            unit="steps",
            logger=log,
        )

    # -- on_new_request / get_num_new_matched_tokens --------------------------------------
    def started(self, request: Request) -> _Request:
        """Send the request's Lookup in the background as it arrives (vLLM's on_new_request); where
        the service's presence table is read instead, `match` sends it, and only when the cache
        holds more of the prompt than vLLM's own prefix cache (known only then)."""
        state = self._requests.get(request.request_id)
        if state is None:
            if not self._requests:
                self.prefill.idle()  # no request was running: vLLM waited for this one
            state = _Request(request, self.settings.salt_for(getattr(request, "cache_salt", None)))
            state.hints = _hints(request)
            self._requests[request.request_id] = state
        if state.pending is None and self.loads and self._usable(request) > 0:
            state.held = self._held(request.prompt_token_ids or [], state.salt)  # read now: no copy
            state.held_fresh = state.held is not None
            if state.held is None:
                self._send(state)
        return state

    def _send(self, state: _Request) -> None:
        state.deadline = time.monotonic() + self.settings.lookup_timeout_s
        state.pending = self._lookups.submit(self._lookup, list(state.request.prompt_token_ids or ()), state.salt)

    def _held(self, prompt: list[int], salt: str | None) -> int | None:
        """Tokens of `prompt` whose blocks the service's index holds, in whole blocks of vLLM's, by
        the presence table a same-host service publishes (prefixcache/presence.py: a read of shared
        memory, no call; a salted request's under its salt's root); None where there is none to
        read (or `presence_table` is off)."""
        held = self.link.held_tokens(prompt, salt) if self.settings.presence_table else None
        return None if held is None else held // self.block_size * self.block_size

    def _usable(self, request: Request) -> int:
        """Prompt tokens the cache could provide: whole blocks, never the last token."""
        return (len(request.prompt_token_ids or ()) - 1) // self.block_size * self.block_size

    def _lookup(self, prompt: list[int], salt: str | None) -> Answer | None:
        """One Lookup with a lease (a lookup thread); None when the service is unusable."""
        with self.stats.background():
            return self._lookup_answer(prompt, salt)

    def _lookup_answer(self, prompt: list[int], salt: str | None) -> Answer | None:
        recompute = None if self.settings.hit_policy == "always" else self.prefill.s_per_token
        self.stats.add(lookups=1)
        try:
            answer = self.link.call(lambda client, _: self._lookup_returning(client, prompt, salt, recompute))
        except PrefixCacheError:
            return None  # the link dropped a client that failed as a service
        if answer is None:
            return None
        hit, attachment = answer
        if self.state_link is None or not hit.blocks:
            return Answer(hit, attachment)
        usable = min(hit.blocks, (len(prompt) - 1) // self.block_size)
        try:
            found = self.state_link.call(lambda client, _: states.probe(client, prompt, usable, self.block_size, salt))
        except PrefixCacheError:
            found = None
        blocks, state = found[0] if found is not None else (0, None)
        if state is None:
            self.stats.add(state_misses=1)
            return Answer(hit, attachment)
        return Answer(hit, attachment, blocks, state)

    def _lookup_returning(
        self, client: CacheClient, prompt: list[int], salt: str | None, recompute: float | None
    ) -> Hit:
        """The Lookup, carrying the leases waiting to go back to its service (`LeaseReturns`)."""
        returns = self._returns.take(client)
        try:
            return client.lookup(
                prompt,
                cache_salt=salt,
                take_lease=True,
                timeout_s=self.settings.lookup_timeout_s,
                recompute_s_per_token=recompute,
                release=returns,
            )
        except PrefixCacheError:
            self._returns.release(returns, client)  # the failed Lookup may not have carried them
            raise

    def match(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id) or self.started(request)
        self._drop_lease(state)
        state.local_tokens, state.external_tokens = num_computed_tokens, 0
        usable = self._usable(request)
        if usable <= num_computed_tokens or not self.loads or state.load_failed:
            self._go_ahead(state, counted=False)
            return 0, False  # nothing to gain
        if state.pending is None and not state.held_fresh:  # answered before and dropped: ask anew
            self.started(request)
        state.held_fresh = False
        if state.held is not None:  # the presence table was read
            if min(state.held, usable) <= num_computed_tokens:
                return self._nothing_held(state)
            if state.pending is None:
                self._send(state)  # the cache holds more than vLLM: worth a Lookup
        pending = state.pending
        assert pending is not None
        if not pending.done():
            remaining, gain = state.deadline - time.monotonic(), usable - num_computed_tokens
            if remaining > 0 and self._step_tokens > 0:
                self._grace(pending, remaining, gain)
                if not pending.done():
                    if self._worth_a_step(gain):
                        self.stats.add(lookup_deferrals=1)
                        return None, False  # vLLM steps its running requests; ask again next step
                    return self._not_awaited(state)  # no hit could repay the step it would cost
            elif remaining > 0 and not self._worth(gain, self.settings.lookup_grace_s):
                return self._not_awaited(state)  # vLLM is idle, but the odds do not repay even a grace's wait
            if remaining > 0 and not pending.done():
                waited = time.perf_counter()
                try:
                    pending.result(timeout=remaining)  # vLLM is idle: waiting stalls nobody...
                except TimeoutError:
                    pass
                spent = time.perf_counter() - waited
                self.prefill.exclude(spent)
                self.stats.add(lookup_idle_waits=1, lookup_idle_seconds=spent)  # ...but adds to its TTFT
            if not pending.done():
                self._go_ahead(state)
                self.stats.add(lookup_errors=1)
                return 0, False  # past the deadline: prefill in full
        state.pending = None
        answer = pending.result()
        if answer is None:
            self.stats.add(lookup_errors=1)
            state.saved_blocks = max(state.saved_blocks, 0)
            return 0, False
        hit, attachment = answer.hit, answer.attachment
        attached = self.link.client()
        client = attached[0] if attached is not None else None
        prompt_tokens = len(request.prompt_token_ids or ())
        if not self._valid(hit, attachment, prompt_tokens, state.salt):
            self._release_state(answer.state)
            self._release(client, hit)
            self.link.failed(
                PrefixCacheError(
                    f"invalid Lookup answer for {prompt_tokens} tokens: "
                    f"{hit.hit_tokens} hit tokens in {hit.blocks} blocks"
                ),
                client,
            )
            self.stats.add(lookup_errors=1)
            state.saved_blocks = max(state.saved_blocks, 0)
            return 0, False
        if not state.asked_again and hit.lease_deadline is not None and hit.lease_deadline < time.monotonic():
            self._release(client, hit)  # the request waited past its lease: ask once more
            self._release_state(answer.state)
            state.asked_again = True
            self.started(request)
            return self.match(request, num_computed_tokens)
        self.hit_odds.observe(min(hit.hit_tokens, usable) > num_computed_tokens)
        state.cached_blocks = hit.hit_tokens // self.block_size
        state.saved_blocks = max(state.saved_blocks, state.cached_blocks)
        reach = min(hit.hit_tokens, usable)
        if self.state_link is not None:  # a hybrid model resumes only where its state is stored
            reach = answer.state_blocks * self.block_size if answer.state_blocks * self.block_size <= reach else 0
        external = reach - num_computed_tokens
        if external > 0 and not self._worth_loading(external, num_computed_tokens, hit, attachment):
            external = 0
        if external <= 0:
            self._release(client, hit)
            self._release_state(answer.state)
            self.stats.add(misses=1)
            return 0, False
        state.hit, state.attachment, state.external_tokens = hit, attachment, external
        state.state, state.state_blocks = answer.state, answer.state_blocks
        state.in_step = self._load_in_step(external, num_computed_tokens, hit, attachment)
        self.stats.add(offered_tokens=external, in_step_loads=int(state.in_step))
        return external, not state.in_step

    def _grace(self, pending: Future[Answer | None], remaining: float, tokens: int) -> None:
        """Wait a little for a Lookup in flight while vLLM has others running: answering None
        costs the request a whole step (vLLM skips it until the next), which is long when that
        step prefills others, whereas a Lookup on loopback takes about a millisecond. The
        waits of one step add up to at most `lookup_grace_s`, and to at most a quarter of the
        last step's length, so running requests' steps grow by that at worst; and only when the
        `tokens` the Lookup could bring, at the odds that it brings any, could repay the wait."""
        grace = min(self._grace_left, GRACE_SHARE * self._last_step_s, remaining)
        if grace <= 0 or not self._worth(tokens, grace):
            return
        waited = time.perf_counter()
        try:
            pending.result(timeout=grace)
        except (TimeoutError, CancelledError):
            pass
        spent = time.perf_counter() - waited
        self._grace_left -= spent
        self.prefill.exclude(spent)
        self.stats.add(lookup_grace_waits=1, lookup_grace_seconds=spent)

    def _worth_a_step(self, tokens: int) -> bool:
        """Is the Lookup in flight worth skipping its request this step? The wait is the next
        step, estimated as one like the last (its scheduled tokens at vLLM's measured cost)."""
        return self._worth(tokens, self.prefill.estimate().seconds(self._step_tokens))

    def _worth(self, tokens: int, wait_s: float) -> bool:
        """The hit rule's `worth_waiting` at vLLM's measured prefill cost and the odds of a hit;
        the `always` policy waits for every hit."""
        if self.settings.hit_policy == "always":
            return True
        return worth_waiting(tokens, self.prefill.estimate(), wait_s, self.hit_odds.value)

    def _nothing_held(self, state: _Request) -> tuple[int, bool]:
        """The service holds nothing past vLLM's own prefix (its presence table): the request
        prefills now, without a Lookup (one still in flight, from an earlier ask, is forgotten
        and not counted in the hit odds), and its saves start where the cache's copy of the
        prompt ends, which may be before vLLM's prefix (the previous turn's reply, say, which
        vLLM cached as it decoded it and the cache never got)."""
        held = state.held or 0
        self._abandon(state)
        state.saved_blocks = max(state.saved_blocks, held // self.block_size)
        self.stats.add(lookups_skipped=1)
        return 0, False

    def _not_awaited(self, state: _Request) -> tuple[int, bool]:
        """The request prefills now, without the answer of its Lookup in flight."""
        self._go_ahead(state)
        self.stats.add(lookups_not_awaited=1)
        return 0, False

    def _go_ahead(self, state: _Request, counted: bool = True) -> None:
        """The request goes ahead without the cache: forget its Lookup (`counted`: its answer
        still counts in the hit odds); its saves start after vLLM's own prefix, which the cache
        holds (this engine saved it, or loaded it from there), or after the cache's copy of the
        prompt where its presence table shows a longer one, so those blocks are not copied out
        again. Where the cache has lost some of them, the service indexes nothing of the save (it
        extends only a cached prefix)."""
        self._abandon(state, state.local_tokens if counted else None)
        cached = state.local_tokens if state.held is None else max(state.held, state.local_tokens)
        state.saved_blocks = max(state.saved_blocks, cached // self.block_size)

    def _abandon(self, state: _Request, beyond: int | None = None) -> None:
        """Forget the Lookup in flight; its lease, if any, is released when it answers, and the
        answer counts in the hit odds (`beyond`: as a hit when it reaches past that many tokens)."""
        pending, state.pending = state.pending, None
        if pending is not None:
            usable = self._usable(state.request)
            pending.add_done_callback(lambda done: self._release_answer(done, beyond, usable))

    def _release_answer(self, pending: Future[Answer | None], beyond: int | None, usable: int) -> None:
        answer = None if pending.cancelled() or pending.exception() else pending.result()
        if answer is None:
            return
        if beyond is not None:
            self.hit_odds.observe(min(answer.hit.hit_tokens, usable) > beyond)
        self._release_state(answer.state)
        if answer.hit.lease_id:
            attached = self.link.client()
            self._release(attached[0] if attached is not None else None, answer.hit)

    def _release_state(self, hit: Hit | None) -> None:
        if hit is None or not hit.lease_id or self.state_link is None:
            return
        attached = self.state_link.client()
        if attached is not None:
            self._release(attached[0], hit, self.state_link)

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
        """The hit rule on the blocks vLLM would load: all by mapped memory when every one is
        mapped, else the worker's read takes the Fetch stream (the whole lease); never a part."""
        if self.settings.hit_policy == "always":
            return True
        estimates = replace(UNTIMED_LOADS, prefill=self.prefill.estimate())
        first, end = local // self.block_size, (local + external) // self.block_size
        return choose(hit, attachment.layout, estimates, first=first, end=end, partial=False).blocks > 0

    def _load_in_step(self, external: int, local: int, hit: Hit, attachment: Attachment) -> bool:
        """Copy within the step rather than asynchronously? Yes when every block is in this host's
        mapped memory and the copy is estimated shorter than a step's fixed cost: the request then
        prefills in this step instead of waiting the one or two steps an asynchronous load spans.
        The connector allows it (`in_step_loads`) only for one KV cache group (vLLM maps block-level
        load errors back to requests only then) and one tensor-parallel rank (other ranks' own
        Lookups would run inside their step)."""
        if not self.in_step_loads:
            return False
        if (local + external) // self.block_size > hit.mapped_blocks:
            return False
        copy_s = MAPPED_LOAD.seconds(external // self.block_size * attachment.layout.block_bytes)
        return copy_s < self.prefill.estimate().latency_s

    # -- update_state_after_alloc ---------------------------------------------------------
    def allocated(self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = [list(ids) for ids in block_ids]
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
        for req_id, parked in self._requests.items():  # loads vLLM allocated blocks for (and parked, if async)
            if parked.load_pending:
                self._plan_load(parked, req_id, meta)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_saves(state, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    state.block_ids = [list(ids) for ids in new_ids]
                else:
                    state.block_ids = [old + list(ids) for old, ids in zip(state.block_ids, new_ids, strict=True)]
            self._plan_saves(state, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        self._plan_state_saves(scheduler_output, meta)
        block_bytes = self.link.layout.block_bytes
        load_s = sum(MAPPED_LOAD.seconds(op.blocks * block_bytes) for op in meta.loads)
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        self._step_tokens = tokens
        now = time.perf_counter()
        self._last_step_s, self._last_build = now - self._last_build, now
        self._grace_left = self.settings.lookup_grace_s
        self.prefill.step(tokens, load_s)
        return meta

    def _plan_load(self, state: _Request, req_id: str, meta: PrefixCacheMetadata) -> None:
        hit, attachment = state.hit, state.attachment
        state.load_pending = False
        if hit is None or attachment is None:
            return
        bs = self.block_size
        first = state.local_tokens // bs
        end = first + state.external_tokens // bs
        prompt = tuple(state.request.prompt_token_ids or ())
        state_block_ids = tuple(
            (group, state.block_ids[group][end - 1] if len(state.block_ids[group]) >= end else NULL_BLOCK)
            for group in self.state_groups
        )
        meta.loads.append(
            LoadOp(
                req_id,
                hit,
                attachment.host_segment,
                first,
                tuple(tuple(ids[first:end]) for ids in state.block_ids),
                prompt[: end * bs],
                state.salt,
                state.state,
                state.state_blocks,
                state_block_ids,
                state.in_step,
            )
        )
        state.hit, state.state = None, None  # the worker owns the leases now
        state.cached_blocks = max(state.cached_blocks, end)
        state.saved_blocks = max(state.saved_blocks, end)

    def _plan_saves(self, state: _Request, req_id: str, computed_after_step: int, meta: PrefixCacheMetadata) -> None:
        """Save the prompt blocks this step completes, from where the cache's copy of the prompt ends."""
        if not self.saves or state.saves_stopped or state.saved_blocks < 0:
            return
        bs = self.block_size
        prompt = state.request.prompt_token_ids or ()
        full = min(computed_after_step, len(prompt)) // bs
        if state.hints.max_tokens is not None:  # prompt_cache_max_tokens: whole blocks within it
            full = min(full, state.hints.max_tokens // bs)
        start = state.saved_blocks
        attention = [ids for group, ids in enumerate(state.block_ids) if group not in self.state_groups]
        if full <= start or any(len(ids) < full for ids in attention):
            return
        block_ids = tuple(tuple(ids[start:full]) for ids in state.block_ids)  # state groups' are not read
        if any(NULL_BLOCK in ids[start:full] for ids in attention):
            state.saves_stopped = True  # vLLM freed them (outside a window) before the cache held them
            self.stats.add(saves_dropped=1)
            return
        state.saved_blocks = full
        meta.saves.append(
            SaveOp(req_id, tuple(prompt[: full * bs]), start, block_ids, state.salt, state.hints.retention_s)
        )

    def _plan_state_saves(self, scheduler_output: SchedulerOutput, meta: PrefixCacheMetadata) -> None:
        """Save the states vLLM committed this step at the prompts' block boundaries: they are
        written by this step's forward and the worker copies them out right after it."""
        if self.state_link is None or not self.saves:
            return
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads: dict[str, list[tuple[int, int, int]]] = getattr(block_state, "boundary_state_offloads", None) or {}
        for req_id, entries in offloads.items():
            state = self._requests.get(req_id)
            if state is None or state.saves_stopped:
                continue
            prompt = state.request.prompt_token_ids or ()
            at: dict[int, dict[int, int]] = {}
            for group, block_id, boundary in entries:
                if group in self.state_groups and boundary % self.block_size == 0 and 0 < boundary <= len(prompt):
                    at.setdefault(boundary, {})[group] = block_id
            for boundary, ids in sorted(at.items()):
                if boundary in state.states_saved or len(ids) != len(self.state_groups):
                    continue
                state.states_saved.add(boundary)
                meta.state_saves.append(
                    StateSaveOp(req_id, tuple(prompt[:boundary]), tuple(sorted(ids.items())), state.salt)
                )

    # -- update_connector_output --------------------------------------------------------------
    def receives_failed(self, request_ids: set[str]) -> None:
        """The workers' failed loads: vLLM puts those requests back to recompute from scratch and
        asks again; offering them the same (failing) hit again would loop."""
        for req_id in request_ids:
            state = self._requests.get(req_id)
            if state is not None:
                state.load_failed = True

    # -- request_finished -----------------------------------------------------------------
    def finished(self, request: Request) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._abandon(state)
            self._drop_lease(state)

    def _drop_lease(self, state: _Request) -> None:
        if state.hit is not None and state.hit.lease_id:
            attached = self.link.client()
            if attached is not None:
                self._release(attached[0], state.hit)
        self._release_state(state.state)
        state.hit, state.state, state.load_pending = None, None, False

    def _release(self, client: CacheClient | None, hit: Hit, link: CacheLink | None = None) -> None:
        """Release a lease off vLLM's scheduler thread: the KV namespace's go back with the next
        Lookup (`LeaseReturns`), the state namespace's by a Release on a lookup thread."""
        if client is None or not hit.lease_id:
            return
        if link is None or link is self.link:
            self._returns.add(hit, client)
            return
        try:
            self._lookups.submit(self._release_now, client, hit, link)
        except RuntimeError:  # the pool is shut down (vLLM is stopping): release here
            self._release_now(client, hit, link)

    def _release_now(self, client: CacheClient, hit: Hit, link: CacheLink) -> None:
        with self.stats.background():
            link.release(hit, client)  # never raises; a service-level failure drops the client

    def close(self) -> None:
        self._returns.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)


def _hints(request: Request) -> StoreHints:
    """A request's store hints from its `kv_transfer_params` (retention.store_hints). A bad one is
    logged, naming the key, and ignored: the connector never fails a request over a hint."""
    try:
        return store_hints(getattr(request, "kv_transfer_params", None))
    except InvalidArgument as error:
        log.warning("prefixcache: request %s: kv_transfer_params %s; hint ignored", request.request_id, error)
        return StoreHints()
