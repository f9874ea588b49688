"""`prefixcache stats` as rich tables, rendered from the JSON document (document.py).

Owns only presentation: number formatting and the table layout. It reads the
document, never the service, so the table and `--json` always agree.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .document import EVICTION_REASONS

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    value = float(n)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pairs(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table


def overview_table(doc: dict) -> Table:
    layout = doc["layout"]
    shape = (
        "-"
        if layout is None
        else (
            f"{layout['layers']} layers x {layout['kv_heads']} kv heads x {layout['head_dim']} "
            f"({layout['dtype']}), {layout['block_size']} tokens/block = {human_bytes(layout['block_bytes'])}, "
            f"{human_bytes(layout['bytes_per_token'])}/token"
        )
    )
    req, blk, tok = doc["requests"], doc["blocks"], doc["tokens"]
    return _pairs(
        f"prefixcache at {doc['address']}",
        [
            ("uptime", human_duration(doc["uptime_seconds"])),
            ("layout", shape),
            ("lookups", f"{req['lookups']:,}"),
            ("hit rate: requests", f"{percent(req['hit_rate'])}  ({req['hits']:,} hit / {req['misses']:,} miss)"),
            ("hit rate: blocks", f"{percent(blk['hit_rate'])}  ({blk['hits']:,} hit / {blk['misses']:,} miss)"),
            ("hit rate: tokens", f"{percent(tok['hit_rate'])}  ({tok['hits']:,} of {tok['looked_up']:,})"),
            ("tokens saved", f"{tok['saved']:,}"),
            ("blocks committed", f"{blk['committed']:,}  ({blk['deduplicated']:,} already cached)"),
            ("active leases", f"{doc['active_leases']:,}"),
            *(
                [("refused attaches", ", ".join(f"{n:,} ({field})" for field, n in refused.items()))]
                if (refused := doc["attach_refusals"])
                else []
            ),
        ],
    )


def tiers_table(doc: dict) -> Table:
    table = Table(title="tiers", title_justify="left")
    for name in ("tier", "blocks", "used", "capacity", "full", "spilled down", "promoted in"):
        table.add_column(name, justify="left" if name == "tier" else "right")
    for tier, row in doc["tiers"].items():
        table.add_row(
            tier,
            f"{row['blocks']:,}",
            human_bytes(row["bytes_used"]),
            human_bytes(row["capacity_bytes"]),
            percent(row["utilization"]),
            f"{doc['spills']['by_tier'].get(tier, 0):,}",
            f"{doc['promotions'].get(tier, 0):,}",
        )
    disk = doc["disk"]
    if disk["configured"]:
        figures = disk["stats"]
        used, capacity = figures.get("used_bytes", 0), figures.get("capacity_bytes", 0)
        table.add_row(
            "disk",
            f"{int(figures.get('blocks', 0)):,}",
            human_bytes(used),
            human_bytes(capacity),
            percent(used / capacity if capacity else None),
            "-",
            "-",
        )
    redis = doc["redis"]
    if redis["configured"]:
        table.add_row("redis", "-", "-", "-", "-", "-", f"{doc['promotions'].get('redis', 0):,}")
    return table


def evictions_table(doc: dict) -> Table:
    evictions = doc["evictions"]
    table = Table(title=f"evictions ({evictions['total']:,} blocks)", title_justify="left")
    table.add_column("tier")
    for reason in EVICTION_REASONS:
        table.add_column(reason, justify="right")
    for tier, counts in evictions["by_tier"].items():
        table.add_row(tier, *(f"{counts[reason]:,}" for reason in EVICTION_REASONS))
    table.add_row("all", *(f"{evictions['by_reason'][reason]:,}" for reason in EVICTION_REASONS), style="bold")
    return table


def misses_table(doc: dict) -> Table:
    rows = [(reason.replace("_", " "), f"{count:,}") for reason, count in doc["miss_reasons"].items()]
    rows.append(("spills dropped", f"{doc['spills']['dropped']:,}"))
    return _pairs("why lookups stopped short (requests)", rows)


def tier_state_table(name: str, doc: dict) -> RenderableType:
    """A tier reported beside `tiers` ("redis", "disk"): its state, then its own figures."""
    section = doc[name]
    if not section["configured"]:
        return Text(f"{name} tier: not configured", style="dim")
    style = "green" if section["up"] else "bold red"
    rows = [("state", f"[{style}]{section['state']}[/]")]
    rows += [(figure.replace("_", " "), _number(value)) for figure, value in section["stats"].items()]
    return _pairs(f"{name} tier", rows)


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:.4g}"


def stats_view(doc: dict) -> RenderableType:
    if not doc["ready"]:
        return Group(
            overview_table(doc),
            Text(
                "\nthe cache is not created yet: no worker has attached (the first Attach creates the cache)",
                style="yellow",
            ),
        )
    return Group(
        overview_table(doc),
        Text(""),
        tiers_table(doc),
        Text(""),
        evictions_table(doc),
        Text(""),
        misses_table(doc),
        Text(""),
        tier_state_table("disk", doc),
        Text(""),
        tier_state_table("redis", doc),
    )
