"""PNG plots of a replay `Report`: TTFT CDF with and without the cache, hit rate over time.

Owns drawing only, from the Report's per-turn records (so plots can be redrawn from a saved
report). Uses matplotlib's object API with the Agg canvas directly, never pyplot: no global
figure state, no display needed. Every function writes one PNG and returns its path; with no
data it still writes a PNG that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .report import Report, TurnRecord


def _new_figure() -> Figure:
    fig = Figure(figsize=(7, 4.5), dpi=100, layout="tight")
    FigureCanvasAgg(fig)
    return fig


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def ttft_series(report: Report) -> dict[str, list[float]]:
    """TTFT samples (ms) per curve: the cache run and the baseline run, or, without a baseline,
    the cache run's hits and misses."""
    ok = [(t, ttft) for t in report.turns if t.error is None and (ttft := t.ttft_s) is not None]
    series = {"with cache": [1000 * ttft for _, ttft in ok]}
    if report.baseline_run is not None:
        series["without cache (baseline)"] = [
            1000 * t.baseline_ttft_s for t in report.turns if t.baseline_error is None and t.baseline_ttft_s is not None
        ]
    else:
        series["cache misses only"] = [1000 * ttft for t, ttft in ok if t.cached_tokens == 0]
    return series


def plot_ttft_cdf(report: Report, path: Path) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    drawn = False
    for label, values in ttft_series(report).items():
        if values:
            xs, ys = _cdf(values)
            ax.step(xs, ys, where="post", label=f"{label} (n={len(values)})")
            drawn = True
    if drawn:
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", transform=ax.transAxes)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("TTFT CDF")
    fig.savefig(path, format="png")
    return path


def hit_rate_points(turns: Sequence[TurnRecord]) -> list[tuple[float, float]]:
    """(completion time s, cumulative token hit rate) for successful turns that reported usage."""
    done = sorted(
        (t.start_s + t.latency_s, t.prompt_tokens, t.cached_tokens)
        for t in turns
        if t.error is None
        and t.start_s is not None
        and t.latency_s is not None
        and t.prompt_tokens
        and t.cached_tokens is not None
    )
    points, prompt, cached = [], 0, 0
    for when, p, c in done:
        prompt += p
        cached += c
        points.append((when, cached / prompt))
    return points


def plot_hit_rate_over_time(report: Report, path: Path) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    points = hit_rate_points(report.turns)
    if points:
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker=".", label="cumulative token hit rate")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no usage reported", ha="center", transform=ax.transAxes)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title("Prefix-cache hit rate over time (cache run)")
    fig.savefig(path, format="png")
    return path


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    """Write both plots into `out_dir` (created if needed); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_ttft_cdf(report, out_dir / "ttft_cdf.png"),
        plot_hit_rate_over_time(report, out_dir / "hit_rate_over_time.png"),
    ]
