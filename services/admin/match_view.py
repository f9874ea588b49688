"""`prefixcache match`: the JSON document of one Match answer and its one-table view.

Match is what a router asks (docs/deploy.md "Many engines"): how many leading blocks of a
prompt each tier holds, without a lease or a TTL refresh. The document has the same keys
whether or not anything is cached.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from prefixcache.client import MatchReport

from .document import SCHEMA_VERSION, ratio
from .prompt import WorkerIdentity

TIER_ORDER = ("device", "host")


def match_document(
    address: str,
    namespace_id: str | None,
    identity: WorkerIdentity | None,
    report: MatchReport | None,
    prompt_tokens: int,
    block_size: int,
) -> dict:
    hit_tokens = report.hit_tokens if report is not None else 0
    blocks = {} if report is None else report.blocks
    miss = None if report is None or report.miss_reason is None else report.miss_reason.value
    return {
        "schema_version": SCHEMA_VERSION,
        "address": address,
        "ready": report is not None,
        "namespace_id": report.namespace_id if report is not None else namespace_id,
        "identity": None if identity is None else {"model": identity.model_id, "revision": identity.revision},
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "hit_blocks": hit_tokens // block_size,
        "hit_tokens": hit_tokens,
        "cached_fraction": ratio(hit_tokens, prompt_tokens),
        "tiers": {tier: blocks.get(tier, 0) for tier in TIER_ORDER},
        "redis_blocks": 0 if report is None else report.remote_blocks,
        "disk_blocks": 0 if report is None else report.disk_blocks,
        "miss_reason": "not_cached" if report is None and prompt_tokens >= block_size else miss,
    }


def match_view(doc: dict) -> RenderableType:
    table = Table(title="matched blocks", title_justify="left")
    for name in ("device", "host", "redis (believed)", "disk (past them)", "hit tokens", "of prompt", "stopped by"):
        table.add_column(name, justify="right")
    table.add_row(
        str(doc["tiers"]["device"]),
        str(doc["tiers"]["host"]),
        str(doc["redis_blocks"]),
        str(doc["disk_blocks"]),
        f"{doc['hit_tokens']:,}",
        f"{doc['prompt_tokens']:,}",
        doc["miss_reason"] or "-",
    )
    summary = Text.assemble(("namespace ", "bold"), str(doc["namespace_id"]), f"  at {doc['address']}")
    return Group(summary, table)
