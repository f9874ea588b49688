"""`prefixcache namespaces`: the JSON document of one ListNamespaces answer, and its table.

Tiers appear under their labels ("device", "host"); a namespace holding nothing resident
has empty `blocks`. `tenant` is null unless an admin of a multi-tenant service asked (whose
answer covers every tenant). `engine_block_sizes` are the block sizes (tokens) its engines
attached with; `refused` lists the Attach calls the service refused lately, newest first (an
engine refused runs without the cache), e.g. a block size that is not a multiple of the service's.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table

from prefixcache.kinds import TierKind
from prefixcache.wire import NamespaceInfo, RefusedAttach

from .document import SCHEMA_VERSION
from .stats_view import human_bytes


def namespaces_document(
    address: str, entries: list[NamespaceInfo], block_bytes: int, refused: Sequence[RefusedAttach] = ()
) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "address": address,
        "block_bytes": block_bytes,
        "namespaces": [
            {
                "namespace_id": e.namespace_id,
                "model": e.model,
                "revision": e.revision,
                "salted": e.salted,
                "tenant": e.tenant or None,
                "kv_scale": e.kv_scale,
                "engine_block_sizes": list(e.engine_block_sizes),
                "blocks": {kind.label: n for kind, n in sorted(e.blocks.items())},
                "bytes": e.resident_bytes(block_bytes),
            }
            for e in entries
        ],
        "refused": [
            {
                "model": r.model,
                "revision": r.revision,
                "tenant": r.tenant or None,
                "field": r.field,
                "reason": r.reason,
                "count": r.count,
                "seconds_since_last": round(r.seconds_since_last, 3),
            }
            for r in refused
        ],
    }


def namespaces_view(doc: dict) -> RenderableType:
    refused = _refused_view(doc["refused"])
    listed = _namespaces_table(doc)
    return listed if refused is None else Group(listed, refused)


def _refused_view(refused: list[dict]) -> RenderableType | None:
    if not refused:
        return None
    table = Table(title="refused attaches (these engines run without the cache)", title_justify="left")
    for name in ("model", "revision", "field", "count", "last", "reason"):
        table.add_column(name, justify="right" if name in ("count", "last") else "left")
    for entry in refused:
        table.add_row(
            entry["model"] + (f" ({entry['tenant']})" if entry["tenant"] else ""),
            entry["revision"][:12] or "-",
            entry["field"],
            f"{entry['count']:,}",
            f"{entry['seconds_since_last']:.0f}s ago",
            entry["reason"],
        )
    return table


def _namespaces_table(doc: dict) -> RenderableType:
    namespaces = doc["namespaces"]
    if not namespaces:
        return "no namespaces: no worker has attached with this credential's tenant"
    admin = any(entry["tenant"] for entry in namespaces)
    scaled = any(entry["kv_scale"] for entry in namespaces)  # the column only where an engine quantizes
    table = Table(title=f"namespaces at {doc['address']}", title_justify="left")
    columns = [
        "namespace",
        *(["tenant"] if admin else []),
        "model",
        "revision",
        "salted",
        *(["kv scale"] if scaled else []),
        "engine blocks",
        *(kind.label for kind in TierKind if kind is not TierKind.REDIS),
        "bytes",
    ]
    for name in columns:
        table.add_column(name, justify="right" if name in ("device", "host", "bytes") else "left")
    for entry in namespaces:
        table.add_row(
            entry["namespace_id"],
            *([entry["tenant"] or ""] if admin else []),
            entry["model"],
            entry["revision"][:12] or "-",
            "yes" if entry["salted"] else "",
            *([entry["kv_scale"]] if scaled else []),
            ",".join(map(str, entry["engine_block_sizes"])) or "-",
            *(f"{entry['blocks'].get(kind.label, 0):,}" for kind in TierKind if kind is not TierKind.REDIS),
            human_bytes(entry["bytes"]),
        )
    return table
