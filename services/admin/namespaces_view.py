"""`prefixcache namespaces`: the JSON document of one ListNamespaces answer, and its table.

Tiers appear under their labels ("device", "host"); a namespace holding nothing resident
has empty `blocks`. `tenant` is null unless an admin of a multi-tenant service asked (whose
answer covers every tenant).
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table

from prefixcache.kinds import TierKind
from prefixcache.wire import NamespaceInfo

from .document import SCHEMA_VERSION
from .stats_view import human_bytes


def namespaces_document(address: str, entries: list[NamespaceInfo], block_bytes: int) -> dict:
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
                "blocks": {kind.label: n for kind, n in sorted(e.blocks.items())},
                "bytes": e.resident_bytes(block_bytes),
            }
            for e in entries
        ],
    }


def namespaces_view(doc: dict) -> RenderableType:
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
            *(f"{entry['blocks'].get(kind.label, 0):,}" for kind in TierKind if kind is not TierKind.REDIS),
            human_bytes(entry["bytes"]),
        )
    return table
