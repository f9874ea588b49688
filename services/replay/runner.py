"""Replays a `Schedule` against an OpenAI-compatible target, and A/B against a baseline.

Owns: following the plan in real time with asyncio — one task per conversation, sleeping to
its start offset, sending its turns one after another (turn k+1 `think_times_s[k]` after turn
k completes), with at most `config.concurrency` requests in flight across the run. How a turn
is sent is a `SendTurn` coroutine: the streaming chat client (`run_schedule`), or the cache
service driven directly (`cache_only`, through `run_schedule_with`).

Invariants:
- bounded in count by the plan (`Schedule.request_count`) and in time: no request starts at or
  after `duration_s`, and every in-flight request is cut at `duration_s + drain_s` (recorded
  as an error), so a run lasts at most `duration_s + drain_s` past its start;
- nothing raised by a request escapes: failures are `RequestRecord`s with an error;
- an A/B replay sends identical prompts to both targets (prompts come from the transcript only),
  either sequentially (the whole schedule against A, then against B: each run has the machine
  to itself) or interleaved (`run_ab(..., interleave=True)`: each turn goes to both targets
  back to back, inside one concurrency slot, so machine noise hits a request and its twin
  alike; which target goes first alternates turn by turn). An interleaved side's `wall_s` is
  the time it had a request in flight (the union of its requests' intervals), so its
  throughput is over its own serving time, not over the twin's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .openai_client import ChatClient, Completion
from .schedule import Schedule, ScheduledConversation
from .turns import Turn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible server to replay against."""

    name: str
    base_url: str
    model: str
    api_key: str | None = None


@dataclass(frozen=True)
class RunOptions:
    """Per-request knobs shared by both sides of an A/B run."""

    max_tokens: int = 64
    request_timeout_s: float = 300.0
    drain_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.request_timeout_s > 0 or not self.drain_s >= 0:
            raise ValueError("request_timeout_s must be > 0 and drain_s >= 0")


@dataclass(frozen=True)
class RequestRecord:
    """One sent request: which turn, when it started (s from run start), what came back."""

    conversation_id: str
    turn_index: int
    start_s: float
    completion: Completion

    @property
    def key(self) -> tuple[str, int]:
        return (self.conversation_id, self.turn_index)


@dataclass(frozen=True)
class RunResult:
    """All requests of one run, in completion order; `not_sent` were cut by the duration cap."""

    target: Target
    records: tuple[RequestRecord, ...]
    wall_s: float
    scheduled: int
    not_sent: int


@dataclass(frozen=True)
class Comparison:
    """Per-request output comparison of two runs over requests that succeeded in both."""

    compared: int
    mismatches: int
    mismatched: tuple[tuple[str, int], ...]
    only_in_cache_run: int
    only_in_baseline_run: int


@dataclass(frozen=True)
class ABResult:
    cache: RunResult
    baseline: RunResult | None
    comparison: Comparison | None


SendTurn = Callable[[Turn], Awaitable[Completion]]
"""Sends one turn and returns its outcome; must not raise for server or network failures."""

Settle = Callable[[], Awaitable[None]]
"""Awaited before a send (interleaved runs), e.g. until the other target's background work is done."""


class _Run:
    """State of one run in progress; owned by the event loop task running it.

    With one `send` it is a plain run; with two, an interleaved A/B run: each turn is sent to
    both, back to back in one slot, the first one alternating with the turn's parity."""

    def __init__(
        self,
        schedule: Schedule,
        sends: Sequence[SendTurn],
        options: RunOptions,
        on_done: Callable[[], None],
        before: Sequence[Settle | None] = (),
    ) -> None:
        self.schedule = schedule
        self.sends = tuple(sends)
        self.before = tuple(before) or (None,) * len(self.sends)
        self.options = options
        self.on_done = on_done
        self.slots = asyncio.Semaphore(schedule.config.concurrency)
        self.records: tuple[list[RequestRecord], ...] = tuple([] for _ in self.sends)
        self.intervals: tuple[list[tuple[float, float]], ...] = tuple([] for _ in self.sends)
        self.not_sent = 0
        self.t0 = time.perf_counter()
        duration = schedule.config.duration_s
        self.stop_at = None if duration is None else self.t0 + duration
        self.hard_stop_at = None if duration is None else self.t0 + duration + options.drain_s

    def _expired(self) -> bool:
        return self.stop_at is not None and time.perf_counter() >= self.stop_at

    async def _sleep_until(self, when: float) -> None:
        # Never sleep past the duration cap: a long think time must not stretch the run.
        if self.stop_at is not None:
            when = min(when, self.stop_at)
        delay = when - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def conversation(self, position: int, conv: ScheduledConversation) -> None:
        await self._sleep_until(self.t0 + conv.start_s)
        for k, turn in enumerate(conv.turns):
            if k > 0:
                await self._sleep_until(time.perf_counter() + conv.think_times_s[k - 1])
            async with self.slots:
                # Checked after getting a slot: the wait for one may outlast the duration cap.
                if self._expired():
                    self._skip(len(conv.turns) - k)
                    return
                order = range(len(self.sends))
                for side in order if (position + k) % 2 == 0 else reversed(order):
                    settle = self.before[side]
                    if settle is not None:
                        await settle()  # not part of the request's time
                    start = time.perf_counter()
                    completion = await self._send(self.sends[side], turn)
                    end = time.perf_counter()
                    self.records[side].append(
                        RequestRecord(conv.conversation_id, turn.index, start - self.t0, completion)
                    )
                    self.intervals[side].append((start, end))
            self.on_done()

    def _skip(self, count: int) -> None:
        self.not_sent += count
        for _ in range(count):
            self.on_done()

    async def _send(self, send: SendTurn, turn: Turn) -> Completion:
        if self.hard_stop_at is None:
            return await send(turn)
        try:
            async with asyncio.timeout_at(_loop_time_at(self.hard_stop_at)):
                return await send(turn)
        except TimeoutError:
            return Completion(error="cut at run deadline (duration_s + drain_s)")

    async def run(self) -> None:
        await asyncio.gather(*(self.conversation(i, c) for i, c in enumerate(self.schedule.conversations)))


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one was in progress."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _loop_time_at(perf_deadline: float) -> float:
    """Translate a perf_counter deadline to the running loop's clock."""
    return asyncio.get_running_loop().time() + (perf_deadline - time.perf_counter())


async def run_schedule(
    schedule: Schedule, target: Target, options: RunOptions = RunOptions(), console: Console | None = None
) -> RunResult:
    """Replay `schedule` against `target`; a rich progress bar is drawn on `console` if given."""
    async with ChatClient(
        target.base_url, target.model, api_key=target.api_key, timeout_s=options.request_timeout_s
    ) as client:

        async def send(turn: Turn) -> Completion:
            return await client.complete(turn.openai_messages(), options.max_tokens)

        return await run_schedule_with(schedule, target, send, options, console)


async def run_schedule_with(
    schedule: Schedule,
    target: Target,
    send: SendTurn,
    options: RunOptions = RunOptions(),
    console: Console | None = None,
) -> RunResult:
    """Replay `schedule` in real time through `send` (any transport); `target` only labels it."""
    total = schedule.request_count
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )
    with progress:
        task_id = progress.add_task(f"replay -> {target.name}", total=total)
        run = _Run(schedule, (send,), options, lambda: progress.advance(task_id))
        await run.run()
    wall = time.perf_counter() - run.t0
    return _result(target, run.records[0], wall, total, run.not_sent)


def _result(target: Target, records: Sequence[RequestRecord], wall: float, total: int, not_sent: int) -> RunResult:
    errors = sum(1 for r in records if not r.completion.ok)
    log.info(
        "run %s: %d requests (%d errors, %d not sent) in %.1fs",
        target.name,
        len(records),
        errors,
        not_sent,
        wall,
    )
    return RunResult(target, tuple(records), wall, total, not_sent)


def compare_runs(cache: RunResult, baseline: RunResult) -> Comparison:
    """Compare outputs request by request (matched on conversation id and turn index)."""
    a = {r.key: r.completion for r in cache.records if r.completion.ok}
    b = {r.key: r.completion for r in baseline.records if r.completion.ok}
    both = sorted(a.keys() & b.keys())
    mismatched = tuple(k for k in both if a[k].text != b[k].text)
    return Comparison(
        compared=len(both),
        mismatches=len(mismatched),
        mismatched=mismatched,
        only_in_cache_run=len(a.keys() - b.keys()),
        only_in_baseline_run=len(b.keys() - a.keys()),
    )


async def run_interleaved(
    schedule: Schedule,
    cache: Target,
    baseline: Target,
    options: RunOptions = RunOptions(),
    console: Console | None = None,
    settle: Settle | None = None,
) -> tuple[RunResult, RunResult]:
    """Replay `schedule` once, each turn sent to `cache` and `baseline` back to back (the first
    alternating); each side's `wall_s` is its own serving time (see module invariants).
    `settle` is awaited before each `baseline` request (worker_metrics.StoreSettle)."""
    total = schedule.request_count
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )
    async with (
        ChatClient(cache.base_url, cache.model, api_key=cache.api_key, timeout_s=options.request_timeout_s) as a,
        ChatClient(
            baseline.base_url, baseline.model, api_key=baseline.api_key, timeout_s=options.request_timeout_s
        ) as b,
    ):

        async def send_a(turn: Turn) -> Completion:
            return await a.complete(turn.openai_messages(), options.max_tokens)

        async def send_b(turn: Turn) -> Completion:
            return await b.complete(turn.openai_messages(), options.max_tokens)

        with progress:
            task_id = progress.add_task(f"replay -> {cache.name} + {baseline.name}, interleaved", total=total)
            run = _Run(schedule, (send_a, send_b), options, lambda: progress.advance(task_id), (None, settle))
            await run.run()
    return (
        _result(cache, run.records[0], busy_time(run.intervals[0]), total, run.not_sent),
        _result(baseline, run.records[1], busy_time(run.intervals[1]), total, run.not_sent),
    )


async def run_ab(
    schedule: Schedule,
    cache: Target,
    baseline: Target | None,
    options: RunOptions = RunOptions(),
    console: Console | None = None,
    interleave: bool = False,
    settle: Settle | None = None,
) -> ABResult:
    """Replay against `cache`, then (if given) the same schedule against `baseline`, or both
    interleaved turn by turn (`interleave`, with `settle` before each baseline request); compare
    the outputs."""
    if baseline is not None and interleave:
        cache_run, base_run = await run_interleaved(schedule, cache, baseline, options, console, settle)
    else:
        cache_run = await run_schedule(schedule, cache, options, console)
        if baseline is None:
            return ABResult(cache_run, None, None)
        base_run = await run_schedule(schedule, baseline, options, console)
    comparison = compare_runs(cache_run, base_run)
    if comparison.mismatches:
        log.warning(
            "A/B: %d of %d outputs differ between %s and %s",
            comparison.mismatches,
            comparison.compared,
            cache.name,
            baseline.name,
        )
    return ABResult(cache_run, base_run, comparison)
