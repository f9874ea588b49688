"""The replay report: numbers computed from run results, as frozen dataclasses and JSON.

Owns: the metric definitions (docs/replay.md is their user-facing copy, report.schema.json
the machine-checkable shape of `Report.to_json()`).

Definitions (over the requests of one run that succeeded):
- token hit rate = sum(cached_tokens) / sum(prompt_tokens), over requests whose server reported
  both (`cached_tokens` None -> excluded and not counted as a miss);
- block hit rate = sum(cached_tokens // block_size) / sum(prompt_tokens // block_size), same
  requests, only when block_size is known (only full blocks are cacheable);
- prefill tokens saved = sum(cached_tokens), computed = sum(prompt_tokens - cached_tokens);
- percentiles interpolate linearly between closest ranks (numpy's default "linear");
  None when there is no sample;
- throughput divides by the run's wall time (start of run to its last completion); in an
  interleaved A/B run, by the time that side had a request in flight (runner.py).
Invariant: `Report` is plain data; `to_json()` output validates against report.schema.json.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .runner import ABResult, Comparison, RequestRecord, RunResult
from .schedule import ScheduleConfig

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation; None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class Throughput:
    requests_per_s: float
    prompt_tokens_per_s: float
    completion_tokens_per_s: float


@dataclass(frozen=True)
class RunSummary:
    """Aggregates of one run (see module definitions)."""

    target: str
    base_url: str
    scheduled: int
    requests: int
    ok: int
    errors: int
    not_sent: int
    error_kinds: Mapping[str, int]
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_tokens_reported: int
    token_hit_rate: float | None
    block_hit_rate: float | None
    request_hit_rate: float | None
    prefill_tokens_computed: int
    prefill_tokens_saved: int
    ttft_s: Percentiles
    ttft_hit_s: Percentiles
    ttft_miss_s: Percentiles
    latency_s: Percentiles
    throughput: Throughput


@dataclass(frozen=True)
class TurnRecord:
    """One turn across both runs (baseline fields None without a baseline run)."""

    conversation_id: str
    turn_index: int
    start_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    latency_s: float | None
    error: str | None
    baseline_ttft_s: float | None
    baseline_latency_s: float | None
    baseline_error: str | None
    output_match: bool | None


@dataclass(frozen=True)
class PairedClass:
    """Medians over the requests of one class, each divided by its no-cache twin's figure."""

    requests: int
    ttft_ratio_p50: float | None
    after_first_token_ratio_p50: float | None  # (latency - TTFT): decode and whatever follows


@dataclass(frozen=True)
class PairedSummary:
    """Each request against its no-cache twin (same conversation turn), by class: robust to
    the mix of hits and misses, which an aggregate over either run is not. A hit is a request
    the cache run served with cached tokens; throughput is the cache run's over the baseline's."""

    hits: PairedClass
    misses: PairedClass
    all: PairedClass
    throughput_ratio: float | None


@dataclass(frozen=True)
class MismatchKey:
    conversation_id: str
    turn_index: int


@dataclass(frozen=True)
class ComparisonSummary:
    compared: int
    mismatches: int
    mismatched: tuple[MismatchKey, ...]
    only_in_cache_run: int
    only_in_baseline_run: int


@dataclass(frozen=True)
class CacheOnlySummary:
    """The service-side figures of a cache-only run (services/replay/cache_only.py); rates are
    over the run's wall time, bytes per second count whole blocks."""

    address: str
    model_size: str
    block_bytes: int
    shared_memory: bool
    verify: bool
    requests: int
    lookups: int
    lookup_s: Percentiles
    read_s: Percentiles
    store_s: Percentiles
    lookups_per_s: float
    blocks_read: int
    blocks_stored: int
    blocks_deduplicated: int
    blocks_rejected: int
    read_bytes_per_s: float
    store_bytes_per_s: float
    verified_blocks: int
    corrupt_blocks: int


@dataclass(frozen=True)
class WorkloadSummary:
    """What was replayed: the transcript source and the caps applied to it."""

    source: str
    source_truncated: bool
    conversations: int
    requests: int
    max_turns: int | None
    max_prompt_tokens: int | None
    max_tokens: int | None  # None in cache-only mode (nothing is generated)
    model: str | None
    system_prompt_tokens: int | None = None  # the shared system prompt's tokens, framing included
    system_prompt_share: float | None = None  # the fraction of conversations that start with it


@dataclass(frozen=True)
class Report:
    """The whole replay report; `service_stats` is filled by the caller (e.g. tier evictions)."""

    schema_version: int
    generated_at: str
    block_size: int | None
    schedule: Mapping[str, Any]
    cache_run: RunSummary
    baseline_run: RunSummary | None
    comparison: ComparisonSummary | None
    turns: tuple[TurnRecord, ...]
    service_stats: Mapping[str, Any] | None = None
    cache_only: CacheOnlySummary | None = None
    workload: WorkloadSummary | None = None
    hit_policy: Mapping[str, Any] | None = None  # the worker's load-or-recompute decisions (worker_metrics.py)
    paired: PairedSummary | None = None  # with a baseline run
    interleaved: bool | None = None  # with a baseline run: each turn sent to both back to back (runner.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def _error_kind(message: str) -> str:
    """Group error messages: drop details after the first colon, cap the length."""
    return message.split(":", 1)[0][:80]


def summarize_run(run: RunResult, block_size: int | None = None) -> RunSummary:
    """Aggregate one run's records into a RunSummary."""
    ok = [r.completion for r in run.records if r.completion.ok]
    errors: dict[str, int] = {}
    for rec in run.records:
        if rec.completion.error is not None:
            kind = _error_kind(rec.completion.error)
            errors[kind] = errors.get(kind, 0) + 1
    usage = [
        (c.prompt_tokens, c.cached_tokens) for c in ok if c.prompt_tokens is not None and c.cached_tokens is not None
    ]
    prompt_reported = sum(c.prompt_tokens or 0 for c in ok)
    prompt_hit = sum(p for p, _ in usage)
    cached = sum(c for _, c in usage)
    blocks = None
    if block_size:
        blocks = _rate(sum(c // block_size for _, c in usage), sum(p // block_size for p, _ in usage))
    completion_tokens = sum(c.completion_tokens or 0 for c in ok)
    wall = run.wall_s if run.wall_s > 0 else float("nan")
    return RunSummary(
        target=run.target.name,
        base_url=run.target.base_url,
        scheduled=run.scheduled,
        requests=len(run.records),
        ok=len(ok),
        errors=len(run.records) - len(ok),
        not_sent=run.not_sent,
        error_kinds=errors,
        wall_s=run.wall_s,
        prompt_tokens=prompt_reported,
        cached_tokens=cached,
        completion_tokens=completion_tokens,
        cached_tokens_reported=len(usage),
        token_hit_rate=_rate(cached, prompt_hit),
        block_hit_rate=blocks,
        request_hit_rate=_rate(sum(1 for _, c in usage if c), len(usage)),
        # Requests that did not report cached_tokens are counted as fully computed.
        prefill_tokens_computed=prompt_reported - cached,
        prefill_tokens_saved=cached,
        ttft_s=Percentiles.of([c.ttft_s for c in ok if c.ttft_s is not None]),
        ttft_hit_s=Percentiles.of([c.ttft_s for c in ok if c.ttft_s is not None and c.cached_tokens]),
        ttft_miss_s=Percentiles.of([c.ttft_s for c in ok if c.ttft_s is not None and c.cached_tokens == 0]),
        latency_s=Percentiles.of([c.latency_s for c in ok if c.latency_s is not None]),
        throughput=Throughput(
            _finite(len(ok) / wall), _finite(prompt_reported / wall), _finite(completion_tokens / wall)
        ),
    )


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _turn_records(cache: RunResult, baseline: RunResult | None) -> tuple[TurnRecord, ...]:
    a = {r.key: r for r in cache.records}
    b = {r.key: r for r in baseline.records} if baseline else {}
    keys = sorted(a.keys() | b.keys(), key=lambda k: (_start(a.get(k), b.get(k)), k))
    out = []
    for key in keys:
        ca = a[key].completion if key in a else None
        cb = b[key].completion if key in b else None
        match = ca.text == cb.text if ca and cb and ca.ok and cb.ok else None
        out.append(
            TurnRecord(
                conversation_id=key[0],
                turn_index=key[1],
                start_s=a[key].start_s if key in a else None,
                prompt_tokens=ca.prompt_tokens if ca else None,
                cached_tokens=ca.cached_tokens if ca else None,
                completion_tokens=ca.completion_tokens if ca else None,
                ttft_s=ca.ttft_s if ca else None,
                latency_s=ca.latency_s if ca else None,
                error=ca.error if ca else "not sent",
                baseline_ttft_s=cb.ttft_s if cb else None,
                baseline_latency_s=cb.latency_s if cb else None,
                baseline_error=(cb.error if cb else "not sent") if baseline else None,
                output_match=match,
            )
        )
    return tuple(out)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired_class(turns: Sequence[TurnRecord]) -> PairedClass:
    ttft = [r for t in turns if (r := _ratio(t.ttft_s, t.baseline_ttft_s)) is not None]
    after = [
        r
        for t in turns
        if t.latency_s is not None
        and t.ttft_s is not None
        and t.baseline_latency_s is not None
        and t.baseline_ttft_s is not None
        and (r := _ratio(t.latency_s - t.ttft_s, t.baseline_latency_s - t.baseline_ttft_s)) is not None
    ]
    return PairedClass(len(turns), percentile(ttft, 50), percentile(after, 50))


def paired_summary(turns: Sequence[TurnRecord], cache: RunSummary, baseline: RunSummary) -> PairedSummary:
    """The paired comparison of the turns both runs served (see PairedSummary)."""
    both = [t for t in turns if t.error is None and t.baseline_error is None and t.baseline_ttft_s is not None]
    return PairedSummary(
        hits=_paired_class([t for t in both if t.cached_tokens]),
        misses=_paired_class([t for t in both if t.cached_tokens == 0]),
        all=_paired_class(both),
        throughput_ratio=_ratio(cache.throughput.requests_per_s, baseline.throughput.requests_per_s),
    )


def _start(ra: RequestRecord | None, rb: RequestRecord | None) -> float:
    rec = ra or rb
    return rec.start_s if rec else math.inf


def _comparison(c: Comparison) -> ComparisonSummary:
    return ComparisonSummary(
        compared=c.compared,
        mismatches=c.mismatches,
        mismatched=tuple(MismatchKey(cid, idx) for cid, idx in c.mismatched),
        only_in_cache_run=c.only_in_cache_run,
        only_in_baseline_run=c.only_in_baseline_run,
    )


def build_report(
    result: ABResult,
    config: ScheduleConfig,
    *,
    block_size: int | None = None,
    service_stats: Mapping[str, Any] | None = None,
    cache_only: CacheOnlySummary | None = None,
    workload: WorkloadSummary | None = None,
    generated_at: dt.datetime | None = None,
    hit_policy: Mapping[str, Any] | None = None,
    interleaved: bool | None = None,
) -> Report:
    """Assemble the Report of an A/B (or single) replay."""
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    when = generated_at or dt.datetime.now(dt.UTC)
    schedule = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    cache_run = summarize_run(result.cache, block_size)
    baseline_run = summarize_run(result.baseline, block_size) if result.baseline else None
    turns = _turn_records(result.cache, result.baseline)
    return Report(
        schema_version=SCHEMA_VERSION,
        generated_at=when.isoformat(),
        block_size=block_size,
        schedule=schedule,
        cache_run=cache_run,
        baseline_run=baseline_run,
        comparison=_comparison(result.comparison) if result.comparison else None,
        turns=turns,
        service_stats=service_stats,
        cache_only=cache_only,
        workload=workload,
        hit_policy=hit_policy,
        paired=paired_summary(turns, cache_run, baseline_run) if baseline_run else None,
        interleaved=interleaved if baseline_run else None,
    )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
