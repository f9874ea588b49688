"""The chaos soak's verdict: pure functions over what the run recorded (benchmarks/chaos_soak.py).

Inputs are plain values: the requests of the cached and the no-cache run (`Request`), the
faults as they were injected (`Fault`, seconds from the start of the run) and the periodic
`Sample`s of the processes. Every check returns a `Check` with the figures it judged.

Definitions:
- hit rate: cached / prompt tokens over the *eligible* requests in a window — succeeded,
  and a later turn of a conversation (turn >= 1), whose prefix a hit could hold;
- baseline: the hit rate of the whole run after warm-up (faults included: it is the bar a
  window after a fault must reach a fraction of, and a quiet stretch before the first fault
  is too short to measure on its own);
- recovered: the first window of `window_s` (stepping `step_s`) after a fault ends with at
  least `min_requests` eligible requests and a hit rate >= `recovery_fraction` x baseline;
  it must come before the next fault starts (or the load ends);
- memory flat: the median RSS over the first third of the warm run is within `tolerance`
  of the median over its last third, per role (a restarted service is the same role; samples
  from a process's own first `warm_s` after it started do not count: it is not warm yet);
- queue bounded: the Redis tier's queue never passed its byte bound, and drained afterwards.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    conversation: str
    turn: int
    start_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str
    error: str | None


@dataclass(frozen=True)
class Fault:
    kind: str  # redis_kill, redis_pause, service_restart, service_kill
    start_s: float
    end_s: float  # when the faulty part was back (Redis answering, service ready)


@dataclass(frozen=True)
class Sample:
    t_s: float
    service_rss: int | None  # bytes
    worker_rss: int | None  # the cached worker
    queue_bytes: float | None  # the service's Redis tier queue
    active_leases: int | None
    service_age_s: float = 0.0  # since this service process became ready
    reference_rss: int | None = None


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def hit_rate(requests: Sequence[Request], lo: float, hi: float) -> tuple[float | None, int]:
    """(token hit rate, eligible requests) of requests started in [lo, hi)."""
    eligible = [r for r in requests if r.error is None and r.turn >= 1 and lo <= r.start_s < hi]
    prompt = sum(r.prompt_tokens for r in eligible)
    return (sum(r.cached_tokens for r in eligible) / prompt if prompt else None), len(eligible)


def recovery_times(
    requests: Sequence[Request],
    faults: Sequence[Fault],
    baseline: float,
    load_end_s: float,
    *,
    window_s: float = 6.0,
    step_s: float = 1.0,
    min_requests: int = 3,
    recovery_fraction: float = 0.5,
) -> list[float | None]:
    """Per fault: seconds from its end to the end of the first recovered window, or None."""
    out: list[float | None] = []
    for i, fault in enumerate(faults):
        limit = faults[i + 1].start_s if i + 1 < len(faults) else load_end_s
        found, start = None, fault.end_s
        while start + window_s <= limit + 1e-9:
            rate, count = hit_rate(requests, start, start + window_s)
            if count >= min_requests and rate is not None and rate >= recovery_fraction * baseline:
                found = start + window_s - fault.end_s
                break
            start += step_s
        out.append(found)
    return out


def thirds(
    samples: Sequence[Sample], field: Callable[[Sample], int | None], warm_s: float, end_s: float
) -> tuple[float | None, float | None]:
    """Median of `field` over the first and over the last third of [warm_s, end_s]."""
    third = (end_s - warm_s) / 3
    first = [v for s in samples if warm_s <= s.t_s <= warm_s + third and (v := field(s)) is not None]
    last = [v for s in samples if end_s - third <= s.t_s <= end_s and (v := field(s)) is not None]
    return (statistics.median(first) if first else None, statistics.median(last) if last else None)


def check_failures(cached: Sequence[Request], reference: Sequence[Request]) -> Check:
    failed = [r for r in (*cached, *reference) if r.error is not None]
    kinds = sorted({r.error.split(":", 1)[0][:60] for r in failed})
    return Check(
        "no failed requests",
        not failed and bool(cached),
        f"{len(cached)} cached + {len(reference)} no-cache requests, {len(failed)} failed {kinds}",
    )


def check_outputs(cached: Sequence[Request], reference: Sequence[Request]) -> Check:
    ref = {(r.conversation, r.turn): r.text for r in reference if r.error is None}
    both = [r for r in cached if r.error is None and (r.conversation, r.turn) in ref]
    differ = [(r.conversation, r.turn) for r in both if r.text != ref[(r.conversation, r.turn)]]
    return Check(
        "outputs identical to the no-cache worker",
        not differ and bool(both),
        f"{len(both)} compared, {len(differ)} differ {differ[:3]}",
    )


def check_recovery(
    cached: Sequence[Request], faults: Sequence[Fault], warm_s: float, load_end_s: float, **options
) -> tuple[Check, float | None, list[float | None]]:
    if not faults:
        return Check("hit rate recovers after each fault", False, "no fault was injected"), None, []
    baseline, count = hit_rate(cached, warm_s, load_end_s)
    if not baseline:
        return (
            Check(
                "hit rate recovers after each fault",
                False,
                f"no baseline: hit rate {baseline} over {count} requests after warm-up",
            ),
            baseline,
            [],
        )
    times = recovery_times(cached, faults, baseline, load_end_s, **options)
    shown = ", ".join(
        f"{f.kind}@{f.start_s:.0f}s: " + (f"{t:.0f}s" if t is not None else "NOT recovered")
        for f, t in zip(faults, times)
    )
    return (
        Check(
            "hit rate recovers after each fault",
            all(t is not None for t in times),
            f"baseline {baseline:.1%} over {count} requests; recovered within {shown}",
        ),
        baseline,
        times,
    )


def check_memory(samples: Sequence[Sample], warm_s: float, end_s: float, tolerance: float = 0.05) -> list[Check]:
    checks = []
    for role, field in (
        ("service", lambda s: s.service_rss if s.service_age_s >= warm_s else None),
        ("worker", lambda s: s.worker_rss),
    ):
        first, last = thirds(samples, field, warm_s, end_s)
        ok = first is not None and last is not None and abs(last / first - 1) <= tolerance
        detail = (
            f"median RSS {first / 2**20:.1f} MiB -> {last / 2**20:.1f} MiB ({last / first - 1:+.1%})"
            if first and last
            else "not enough samples"
        )
        checks.append(Check(f"{role} memory flat (within {tolerance:.0%})", ok, detail))
    return checks


def check_queue(samples: Sequence[Sample], bound_bytes: int, final_bytes: float | None) -> Check:
    seen = [s.queue_bytes for s in samples if s.queue_bytes is not None]
    peak = max(seen, default=0.0)
    ok = bool(seen) and peak <= bound_bytes and final_bytes == 0
    return Check(
        "Redis queue bounded and drained",
        ok,
        f"peak {peak / 2**20:.2f} MiB of {bound_bytes / 2**20:.0f} MiB, {len(seen)} samples, at the end {final_bytes}",
    )


def check_leases(final_leases: int | None) -> Check:
    return Check("no lease left at the end", final_leases == 0, f"active_leases {final_leases}")
