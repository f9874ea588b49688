"""One replay from start to report: the steps `prefixcache replay` and `prefixcache demo` share.

Owns the order of a replay: build the workload (worker tokenizer caps) -> plan the schedule ->
read the service's stats -> run (A/B over HTTP, or cache-only over gRPC) -> read the stats
again -> assemble the `Report`; then write JSON and plots, and turn the checks into an exit
code.

Invariants:
- a replay is bounded: the plan fixes the request count and the schedule's `duration_s` plus
  `RunOptions.drain_s` bounds its time;
- a stats read that fails AFTER the run never loses the run's report (the failure is recorded
  in `service_stats.error`); one that fails before it stops the replay early (wrong address);
- `exit_code` is 0 only when something succeeded and every check passed: no output mismatch
  (A/B) and no corrupt block (cache-only).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from prefixcache.client import ServiceStats
from prefixcache.errors import PrefixCacheError

from . import worker_metrics
from .cache_only import CacheOnlyOptions, run_cache_only
from .prompt_tokens import ChatTokens
from .report import Report, WorkloadSummary, build_report
from .runner import ABResult, RunOptions, Target, run_ab
from .schedule import Schedule, ScheduleConfig, build_schedule
from .service_stats import fetch_stats, stats_section
from .transcripts import Role
from .workload import Workload, WorkloadSpec, load_workload

log = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    """The replay cannot start (no model at the target, nothing to replay, ...)."""


@dataclass(frozen=True)
class ReplayOptions:
    workload: WorkloadSpec
    schedule: ScheduleConfig
    run: RunOptions
    block_size: int = 16
    interleave: bool = False  # A/B: each turn to both targets back to back (runner.run_interleaved)


@dataclass(frozen=True)
class Plan:
    workload: Workload
    schedule: Schedule
    tokens: ChatTokens


def plan(options: ReplayOptions) -> Plan:
    """Load the workload with the worker's token counts and plan its schedule."""
    tokens = ChatTokens()
    workload = load_workload(options.workload, tokens.count)
    schedule = build_schedule(workload.turns, options.schedule)
    if schedule.request_count == 0:
        raise ReplayError(
            f"nothing to replay from {options.workload.source}: no conversation has a "
            f"turn under --max-prompt-tokens {options.workload.max_prompt_tokens}"
        )
    loaded = workload.loaded
    log.info(
        "replaying %d requests from %d conversations (%s: %d records read%s)",
        schedule.request_count,
        len(schedule.conversations),
        options.workload.source,
        loaded.records_read,
        ", file truncated" if loaded.truncated else "",
    )
    return Plan(workload, schedule, tokens)


def _workload_record(options: ReplayOptions, p: Plan, max_tokens: int | None, model: str) -> WorkloadSummary:
    w = options.workload
    return WorkloadSummary(
        source=w.source,
        source_truncated=p.workload.loaded.truncated,
        conversations=len(p.schedule.conversations),
        requests=p.schedule.request_count,
        max_turns=w.max_turns,
        max_prompt_tokens=w.max_prompt_tokens,
        max_tokens=max_tokens,
        model=model,
        system_prompt_tokens=None
        if w.system_prompt is None
        else p.tokens.message_count((Role.SYSTEM, w.system_prompt)),
        system_prompt_share=None if w.system_prompt is None else w.system_prompt_share,
    )


def models_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/models" if base.endswith("/v1") else "/v1/models")


async def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id that `GET /v1/models` lists at `base_url`."""
    url = models_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url, headers=headers) as response:
                response.raise_for_status()
                body = await response.json()
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ReplayError(
            f"cannot list the models at {url} ({type(error).__name__}: {error}); "
            "is the server up? pass --model NAME to skip this"
        ) from None


class _Stats:
    """GetStats before and after a run, for the report's `service_stats`."""

    def __init__(self, address: str | None, auth_token: str | None) -> None:
        self.address = address
        self.auth_token = auth_token
        self.before: ServiceStats | None = None

    def start(self) -> None:
        if self.address is not None:
            self.before = fetch_stats(self.address, self.auth_token)  # fails fast on a wrong address

    def section(self) -> dict[str, Any] | None:
        if self.address is None:
            return None
        try:
            return stats_section(self.address, self.before, fetch_stats(self.address, self.auth_token))
        except PrefixCacheError as error:
            log.warning("cannot read the cache service's stats after the run: %s", error)
            return {"address": self.address, "error": str(error)}


def run_chat(
    options: ReplayOptions,
    target: Target,
    baseline: Target | None,
    stats_address: str | None = None,
    auth_token: str | None = None,
    console: Console | None = None,
    prepared: Plan | None = None,
) -> Report:
    """Replay against an OpenAI-compatible `target` (and `baseline` after it, for A/B)."""
    p = prepared or plan(options)
    stats = _Stats(stats_address, auth_token)
    stats.start()
    decisions = worker_metrics.scrape(target.base_url)  # the reference worker's hit decisions, if it is one
    # Interleaved one request at a time against the reference worker: its background stores
    # finish before each twin. (With more in flight the cached worker is rarely idle: waiting for
    # that would hold the twins back while the cached worker keeps serving.)
    one_at_a_time = options.schedule.concurrency == 1
    settle = (
        worker_metrics.StoreSettle(target.base_url)
        if options.interleave and one_at_a_time and decisions is not None
        else None
    )
    result: ABResult = asyncio.run(
        run_ab(p.schedule, target, baseline, options.run, console, interleave=options.interleave, settle=settle)
    )
    if settle is not None:
        log.info("waited %.2fs in all for the cached worker's stores before %d twins", settle.waited_s, settle.waits)
    return build_report(
        result,
        options.schedule,
        block_size=options.block_size,
        service_stats=stats.section(),
        workload=_workload_record(options, p, options.run.max_tokens, target.model),
        hit_policy=worker_metrics.section(target.base_url, decisions, worker_metrics.scrape(target.base_url)),
        interleaved=options.interleave if baseline is not None else None,
    )


def run_cache(
    options: ReplayOptions, cache: CacheOnlyOptions, stats_address: str | None = None, console: Console | None = None
) -> Report:
    """Cache-only replay: the service at `cache.address` driven as a worker would, synthetic KV."""
    p = plan(options)
    token_ids = {(t.conversation_id, t.index): p.tokens.tokens(t.messages) for t in p.schedule.requests()}
    p.tokens.forget()
    stats = _Stats(stats_address or cache.address, cache.auth_token)
    stats.start()
    run, summary = asyncio.run(run_cache_only(p.schedule, token_ids, cache, options.run, console))
    return build_report(
        ABResult(run, None, None),
        options.schedule,
        block_size=options.block_size,
        service_stats=stats.section(),
        cache_only=summary,
        workload=_workload_record(options, p, None, cache.preset.name),
    )


def write_outputs(
    report: Report, json_path: Path | None, plots_dir: Path | None, console: Console | None = None
) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report.to_json() + "\n", encoding="utf-8")
        if console is not None:
            console.print(f"report JSON: {json_path}", highlight=False)
    if plots_dir is not None:
        from . import plots  # deferred: matplotlib (the `replay` extra) only for --plots

        paths = plots.write_plots(report, plots_dir)
        if console is not None:
            console.print("plots: " + ", ".join(str(p) for p in paths), highlight=False)


def exit_code(report: Report) -> int:
    """0: something succeeded and every check passed; 1 otherwise."""
    if report.cache_run.ok == 0:
        return 1
    if report.comparison is not None and (report.comparison.mismatches or not report.comparison.compared):
        return 1
    if report.cache_only is not None and report.cache_only.corrupt_blocks:
        return 1
    return 0
