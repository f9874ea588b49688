"""Terminal rendering of a replay `Report` with rich: one table, cache run beside baseline.

Owns presentation only; every number comes from the Report unchanged (rates as percentages,
seconds as milliseconds).
"""

from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.table import Table

from services.replay.report import Percentiles, Report, RunSummary


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


def print_report(report: Report, console: Console) -> None:
    console.print(report_table(report))
    for kind, count in sorted(report.cache_run.error_kinds.items()):
        console.print(f"[red]cache run error[/red] {kind}: {count}")
    if report.service_stats:
        console.print("service stats:", dict(report.service_stats))
