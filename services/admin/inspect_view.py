"""`prefixcache inspect`: the JSON document of one Inspect answer, its table, and the miss explanation.

Owns the words that explain why a prompt's first uncached block missed, and
the per-block view (tier, slot, TTL left, last access, leased).

Invariants: the document has the same keys whether or not anything is cached
("first_miss" is null only when every full block is cached); block token
ranges are half-open [first_token, end_token).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from prefixcache.client import InspectReport

from .document import SCHEMA_VERSION, ratio
from .prompt import WorkerIdentity
from .stats_view import human_duration, percent

EXPLANATIONS = {
    "not_cached": "no stored prompt has this exact prefix up to here: it was never stored in this namespace, "
    "or was evicted, or the prompt differs from every cached one within this block",
    "expired": "this prefix was cached but its sliding TTL ran out (no hit or store refreshed it in time); "
    "it is a miss and will be reclaimed",
    "verification_failed": "a cached block has this block's hash but different token ids (a hash collision): "
    "served as a miss, never as wrong KV",
    "shorter_than_block": "the prompt is shorter than one block; only full blocks are cached",
}
NOT_READY = "the service holds nothing yet: no worker has attached"
NAMESPACE_HINT = (
    "nothing of this prompt is cached: check that --model/--dtype/--block-size/--cache-salt (or "
    "--namespace) and --chat match how the worker built the prompt"
)


def _first_miss(report: InspectReport | None, prompt_tokens: int, block_size: int) -> dict | None:
    hit_blocks = len(report.blocks) if report is not None else 0
    full_blocks = prompt_tokens // block_size
    if report is None:
        reason = "shorter_than_block" if full_blocks == 0 and prompt_tokens else "not_cached"
        explanation = EXPLANATIONS[reason] if reason == "shorter_than_block" else NOT_READY
    elif report.miss_reason is None:
        return None
    else:
        reason = report.miss_reason.value
        explanation = EXPLANATIONS.get(reason, reason)
        if reason == "not_cached" and hit_blocks == 0:
            explanation = f"{explanation}; {NAMESPACE_HINT}"
    start = hit_blocks * block_size
    return {
        "block": hit_blocks,
        "first_token": start,
        "end_token": min(start + block_size, prompt_tokens),
        "reason": reason,
        "explanation": explanation,
    }


def inspect_document(
    address: str,
    namespace_id: str | None,
    identity: WorkerIdentity | None,
    report: InspectReport | None,
    prompt_tokens: int,
    block_size: int,
) -> dict:
    blocks = (
        []
        if report is None
        else [
            {
                "block": b.block,
                "first_token": b.block * block_size,
                "end_token": (b.block + 1) * block_size,
                "tier": b.tier,
                "slot": b.slot,
                "ttl_left_seconds": b.ttl_left_s,
                "last_access_age_seconds": b.last_access_age_s,
                "leased": b.leased,
            }
            for b in report.blocks
        ]
    )
    hit_tokens = report.hit_tokens if report is not None else 0
    return {
        "schema_version": SCHEMA_VERSION,
        "address": address,
        "ready": report is not None,
        "namespace_id": report.namespace_id if report is not None else namespace_id,
        "identity": None if identity is None else {"model": identity.model_id, "revision": identity.revision},
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "full_blocks": prompt_tokens // block_size,
        "trailing_tokens": prompt_tokens % block_size,
        "hit_blocks": len(blocks),
        "hit_tokens": hit_tokens,
        "cached_fraction": ratio(hit_tokens, prompt_tokens),
        "blocks": blocks,
        "disk_blocks": 0 if report is None else report.disk_blocks,
        "first_miss": _first_miss(report, prompt_tokens, block_size),
    }


def _block_rows(doc: dict, max_rows: int) -> Table:
    table = Table(title="cached blocks", title_justify="left")
    for name in ("block", "tokens", "tier", "slot", "TTL left", "last access", "leased"):
        table.add_column(name, justify="left" if name in ("tier", "leased") else "right")
    blocks = doc["blocks"]
    shown = blocks if len(blocks) <= max_rows else blocks[: max_rows // 2] + [None] + blocks[-(max_rows // 2) :]
    for block in shown:
        if block is None:
            table.add_row("...", f"{len(blocks) - 2 * (max_rows // 2):,} more", "", "", "", "", "", style="dim")
            continue
        table.add_row(
            str(block["block"]),
            f"{block['first_token']}-{block['end_token'] - 1}",
            block["tier"],
            str(block["slot"]),
            human_duration(block["ttl_left_seconds"]),
            f"{human_duration(block['last_access_age_seconds'])} ago",
            "yes" if block["leased"] else "",
        )
    return table


def inspect_view(doc: dict, max_rows: int) -> RenderableType:
    summary = Text.assemble(
        ("namespace ", "bold"),
        str(doc["namespace_id"] or "-"),
        *(
            (("  model ", "bold"), f"{doc['identity']['model']}@{doc['identity']['revision'][:12]}")
            if doc["identity"]
            else ()
        ),
        "\n",
        ("prompt ", "bold"),
        f"{doc['prompt_tokens']:,} tokens = {doc['full_blocks']:,} full blocks of {doc['block_size']}"
        f" + {doc['trailing_tokens']} trailing",
        "\n",
        ("cached ", "bold"),
        f"{doc['hit_blocks']:,} blocks = {doc['hit_tokens']:,} tokens ({percent(doc['cached_fraction'])})",
        *(
            ("\n", ("on disk ", "bold"), f"{doc['disk_blocks']:,} more blocks past them (a lookup promotes them)")
            if doc["disk_blocks"]
            else ()
        ),
    )
    parts: list[RenderableType] = [summary]
    if doc["blocks"]:
        parts.append(_block_rows(doc, max_rows))
    miss = doc["first_miss"]
    if miss is not None:
        parts.append(
            Text.assemble(
                ("first miss: ", "bold yellow"),
                f"block {miss['block']} (tokens {miss['first_token']}-{miss['end_token'] - 1}): ",
                (miss["reason"], "bold"),
                f" - {miss['explanation']}",
            )
        )
    elif doc["trailing_tokens"]:
        parts.append(
            Text(
                f"every full block is cached; the trailing {doc['trailing_tokens']} tokens do not "
                "fill a block and are always recomputed",
                style="green",
            )
        )
    else:
        parts.append(Text("every block of the prompt is cached", style="green"))
    return Group(*parts)
