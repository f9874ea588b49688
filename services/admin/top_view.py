"""One frame of `prefixcache top`, rendered with rich from a `TopModel`.

Owns only presentation: the header (address, uptime, refresh counter, status),
rates, hit rates over the window and since start, tier occupancy bars with the
Redis state, and the recent evictions.
"""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .stats_view import human_bytes, human_duration, percent
from .top_model import TopModel


def _rates(model: TopModel) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, value in model.rates().items():
        table.add_row(label, "-" if value is None else f"{value:,.1f}")
    return Panel(table, title="rates", title_align="left")


def _hit_rates(model: TopModel, doc: dict) -> Panel:
    window = model.window()
    table = Table(box=None, padding=(0, 2))
    table.add_column("hit rate", style="bold")
    table.add_column(f"last {window['seconds']:.0f}s", justify="right")
    table.add_column("since start", justify="right")
    table.add_row("requests", percent(window["request_hit_rate"]), percent(doc["requests"]["hit_rate"]))
    table.add_row("tokens", percent(window["token_hit_rate"]), percent(doc["tokens"]["hit_rate"]))
    table.add_row("blocks", "", percent(doc["blocks"]["hit_rate"]))
    table.add_row("tokens saved", f"{window['tokens_saved']:,.0f}", f"{doc['tokens']['saved']:,}")
    table.add_row("active leases", "", f"{doc['active_leases']:,}")
    return Panel(table, title="hit rates", title_align="left")


def _tiers(doc: dict) -> Panel:
    table = Table.grid(padding=(0, 1))
    for _ in range(3):
        table.add_column()
    for tier, row in doc["tiers"].items():
        capacity = max(row["capacity_bytes"], 1)
        table.add_row(
            Text(tier, style="bold"),
            ProgressBar(total=capacity, completed=row["bytes_used"], width=24),
            f"{human_bytes(row['bytes_used'])} / {human_bytes(row['capacity_bytes'])} "
            f"({percent(row['utilization'])}, {row['blocks']:,} blocks)",
        )
    disk = doc["disk"]
    if disk["configured"]:
        used, capacity = disk["stats"].get("used_bytes", 0), disk["stats"].get("capacity_bytes", 0)
        table.add_row(
            Text("disk", style="bold"),
            ProgressBar(total=max(capacity, 1), completed=used, width=24),
            f"{human_bytes(used)} / {human_bytes(capacity)} ({percent(used / capacity if capacity else None)}, "
            f"{int(disk['stats'].get('blocks', 0)):,} blocks, {disk['state']})",
        )
    redis = doc["redis"]
    state = Text(redis["state"], style={"up": "green", "down": "bold red"}.get(redis["state"], "dim"))
    table.add_row(Text("redis", style="bold"), state, f"spills dropped {doc['spills']['dropped']:,}")
    return Panel(table, title="tier occupancy", title_align="left")


def _evictions(model: TopModel) -> Panel:
    if not model.events:
        return Panel(Text("none since top started", style="dim"), title="recent evictions", title_align="left")
    table = Table(box=None, padding=(0, 2))
    for name in ("time", "tier", "reason", "blocks"):
        table.add_column(name, justify="right" if name == "blocks" else "left")
    for event in model.events:
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(event.wall_time)), event.tier, event.reason, f"+{event.blocks:,}"
        )
    return Panel(table, title="recent evictions", title_align="left")


def _side_by_side(left: RenderableType, right: RenderableType) -> Table:
    grid = Table.grid(expand=True)
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(left, right)
    return grid


def top_frame(model: TopModel, address: str, interval_s: float, status: str | None, interactive: bool) -> Group:
    doc = model.latest
    assert doc is not None, "top_frame needs at least one snapshot"
    header = Text.assemble(
        ("prefixcache top", "bold"),
        f"  {address}  uptime {human_duration(doc['uptime_seconds'])}  ",
        f"refresh #{model.refreshes} every {interval_s:g}s",
        ("  (q or Ctrl-C quits)" if interactive else ""),
    )
    parts: list[RenderableType] = [header]
    if status:
        parts.append(Text(status, style="bold red"))
    if not doc["ready"]:
        parts.append(Text("the cache is not created yet: no worker has attached", style="yellow"))
        return Group(*parts)
    parts += [_side_by_side(_rates(model), _hit_rates(model, doc)), _side_by_side(_tiers(doc), _evictions(model))]
    return Group(*parts)
