"""Terminal rendering of a replay `Report` with rich: one table, cache run beside baseline.

Owns presentation only; every number comes from the Report unchanged (rates as percentages,
seconds as milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from .report import CacheOnlySummary, PairedSummary, Percentiles, Report, RunSummary, percentile


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def _pcts(p: Percentiles) -> str:
    return f"{_ms(p.p50)} / {_ms(p.p90)} / {_ms(p.p99)}"


_ROWS: tuple[tuple[str, Callable[[RunSummary], str]], ...] = (
    ("requests ok / sent / scheduled", lambda s: f"{s.ok} / {s.requests} / {s.scheduled}"),
    ("errors", lambda s: str(s.errors)),
    ("token hit rate", lambda s: _pct(s.token_hit_rate)),
    ("block hit rate", lambda s: _pct(s.block_hit_rate)),
    ("requests with a hit", lambda s: _pct(s.request_hit_rate)),
    ("prefill tokens computed", lambda s: f"{s.prefill_tokens_computed:,}"),
    ("prefill tokens saved", lambda s: f"{s.prefill_tokens_saved:,}"),
    ("TTFT p50 / p90 / p99", lambda s: _pcts(s.ttft_s)),
    ("TTFT on hits p50 / p90 / p99", lambda s: _pcts(s.ttft_hit_s)),
    ("TTFT on misses p50 / p90 / p99", lambda s: _pcts(s.ttft_miss_s)),
    ("latency p50 / p90 / p99", lambda s: _pcts(s.latency_s)),
    ("throughput req/s", lambda s: f"{s.throughput.requests_per_s:.2f}"),
    ("prompt tokens/s", lambda s: f"{s.throughput.prompt_tokens_per_s:,.0f}"),
    ("output tokens/s", lambda s: f"{s.throughput.completion_tokens_per_s:,.1f}"),
    ("wall time", lambda s: f"{s.wall_s:.1f} s"),
)


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**20:,.1f} MiB/s"


_CACHE_ONLY_ROWS: tuple[tuple[str, Callable[[CacheOnlySummary], str]], ...] = (
    ("model size (block bytes)", lambda c: f"{c.model_size} ({c.block_bytes:,} B)"),
    ("data plane", lambda c: "shared memory" if c.shared_memory else "gRPC streams"),
    ("lookups", lambda c: f"{c.lookups:,}"),
    ("lookups/s", lambda c: f"{c.lookups_per_s:,.1f}"),
    ("lookup p50 / p90 / p99", lambda c: _pcts(c.lookup_s)),
    ("read p50 / p90 / p99", lambda c: _pcts(c.read_s)),
    ("store p50 / p90 / p99", lambda c: _pcts(c.store_s)),
    ("blocks read / stored", lambda c: f"{c.blocks_read:,} / {c.blocks_stored:,}"),
    ("blocks deduplicated / rejected", lambda c: f"{c.blocks_deduplicated:,} / {c.blocks_rejected:,}"),
    ("read / store throughput", lambda c: f"{_rate(c.read_bytes_per_s)} / {_rate(c.store_bytes_per_s)}"),
    (
        "blocks verified / corrupt",
        lambda c: f"{c.verified_blocks:,} / {c.corrupt_blocks}" if c.verify else "not verified",
    ),
)
# Rows of the chat table that mean something without a model (no TTFT, no output tokens).
_CACHE_ONLY_RUN_ROWS = frozenset(
    {
        "requests ok / sent / scheduled",
        "errors",
        "token hit rate",
        "block hit rate",
        "requests with a hit",
        "prefill tokens computed",
        "prefill tokens saved",
        "latency p50 / p90 / p99",
        "wall time",
    }
)


def cache_only_table(report: Report) -> Table:
    """The summary table of a cache-only run (`report.cache_only` must be set)."""
    summary = report.cache_only
    if summary is None:
        raise ValueError("not a cache-only report")
    table = Table(title=f"prefixcache replay: cache-only against {summary.address}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, cell in _ROWS:
        if label in _CACHE_ONLY_RUN_ROWS:
            table.add_row(label.replace("latency", "request latency"), cell(report.cache_run))
    for label, summary_cell in _CACHE_ONLY_ROWS:
        table.add_row(label, summary_cell(summary))
    return table


def evictions_by_tier(section: Mapping[str, Any]) -> dict[str, int]:
    """Blocks evicted per tier (all reasons) during the run, or since start when unknown."""
    counters = section.get("during_run") or section.get("at_end") or {}
    return {tier: sum(reasons.values()) for tier, reasons in counters.get("evictions", {}).items()}


def service_lines(stats: Mapping[str, Any]) -> list[str]:
    """A few lines on the cache service's own counters (from `Report.service_stats`)."""
    if "at_end" not in stats:  # filled by some other caller: show it as it is
        return [f"service stats: {dict(stats)}"]
    run = stats.get("during_run") or stats.get("at_end")
    if not run:
        return [f"service {stats.get('address')}: no cache yet (nothing attached)"]
    scope = "during the run" if stats.get("during_run") else "since start"
    evictions = evictions_by_tier(stats)
    evicted = ", ".join(f"{tier} {n:,}" for tier, n in sorted(evictions.items()) if n) or "none"
    hit_rate = run.get("token_hit_rate")
    lines = [
        f"service {stats.get('address')} {scope}: {run['lookups']:,} lookups, "
        f"token hit rate {_pct(hit_rate)}, {run['tokens_saved']:,} tokens saved, "
        f"{run['blocks_committed']:,} blocks committed; evictions: {evicted}"
    ]
    tiers = (stats.get("at_end") or {}).get("tiers", {})
    if tiers:
        lines.append(
            "service tiers now: "
            + ", ".join(
                f"{name} {t['blocks']:,} blocks ({t['bytes_used'] / 2**20:,.1f} of "
                f"{t['capacity_bytes'] / 2**20:,.0f} MiB)"
                for name, t in sorted(tiers.items())
            )
        )
    return lines


def report_table(report: Report) -> Table:
    """The summary table of `report` (one column per run)."""
    table = Table(title="prefixcache replay", show_lines=False)
    table.add_column("metric")
    table.add_column(f"cache: {report.cache_run.target}", justify="right")
    if report.baseline_run is not None:
        table.add_column(f"baseline: {report.baseline_run.target}", justify="right")
    for label, cell in _ROWS:
        row = [label, cell(report.cache_run)]
        if report.baseline_run is not None:
            row.append(cell(report.baseline_run))
        table.add_row(*row)
    if report.comparison is not None:
        c = report.comparison
        row = ["output mismatches / compared", f"{c.mismatches} / {c.compared}"]
        table.add_row(*(row + [""] if report.baseline_run is not None else row))
    return table


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def paired_headline(paired: PairedSummary) -> str:
    """The headline: each request against its no-cache twin, by class (medians of the ratios)."""
    h, m, a = paired.hits, paired.misses, paired.all
    return (
        f"paired with no-cache twins (median ratio, <1 is faster): TTFT {_x(h.ttft_ratio_p50)} on {h.requests} hits, "
        f"{_x(m.ttft_ratio_p50)} on {m.requests} misses, {_x(a.ttft_ratio_p50)} on all {a.requests}; "
        f"after the first token {_x(h.after_first_token_ratio_p50)} hits, {_x(m.after_first_token_ratio_p50)} misses; "
        f"throughput {_x(paired.throughput_ratio)} of no-cache's"
    )


def savings_lines(report: Report) -> list[str]:
    """One-line verdicts: prefill saved, TTFT p50 with vs without the cache, the output check."""
    run, base = report.cache_run, report.baseline_run
    lines = []
    if run.prompt_tokens:
        lines.append(
            f"prefill saved: {run.prefill_tokens_saved:,} of {run.prompt_tokens:,} prompt tokens "
            f"({_pct(run.prefill_tokens_saved / run.prompt_tokens)}) came from the cache"
        )
    if report.paired is not None:
        lines.append(paired_headline(report.paired))
    if base is not None and run.ttft_s.p50 and base.ttft_s.p50:
        change = run.ttft_s.p50 / base.ttft_s.p50 - 1
        lines.append(
            f"TTFT p50: {_ms(run.ttft_s.p50)} with the cache vs {_ms(base.ttft_s.p50)} without ({100 * change:+.0f}%)"
        )
    paired = [
        (t.ttft_s, t.baseline_ttft_s)
        for t in report.turns
        if t.cached_tokens
        and t.ttft_s is not None
        and t.baseline_ttft_s is not None
        and t.error is None
        and t.baseline_error is None
    ]
    if paired:
        # The same requests on both sides: robust to the share of misses and to noise between them.
        lines.append(
            f"TTFT p50 of the {len(paired)} requests with a hit: "
            f"{_ms(percentile([a for a, _ in paired], 50))} with the cache vs "
            f"{_ms(percentile([b for _, b in paired], 50))} without"
        )
    if report.comparison is not None:
        c = report.comparison
        verdict = "PASS" if c.mismatches == 0 and c.compared else "FAIL"
        lines.append(f"output check: {c.mismatches} mismatches in {c.compared} compared greedy outputs [{verdict}]")
    if report.cache_only is not None and report.cache_only.verify:
        only = report.cache_only
        verdict = "PASS" if only.corrupt_blocks == 0 else "FAIL"
        lines.append(
            f"KV check: {only.corrupt_blocks} corrupt of {only.verified_blocks:,} hit blocks compared "
            f"byte for byte [{verdict}]"
        )
    return lines


def print_report(report: Report, console: Console) -> None:
    console.print(cache_only_table(report) if report.cache_only else report_table(report))
    for kind, count in sorted(report.cache_run.error_kinds.items()):
        console.print(f"[red]cache run error[/red] {kind}: {count}")
    if report.baseline_run is not None:
        for kind, count in sorted(report.baseline_run.error_kinds.items()):
            console.print(f"[red]baseline run error[/red] {kind}: {count}")
    if report.service_stats:
        for line in service_lines(report.service_stats):
            console.print(line, highlight=False)
    for line in savings_lines(report):
        console.print(line, highlight=False)
