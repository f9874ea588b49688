"""The pin book: operator pins written down beside the disk tier, so a restart restores them.

A pin lives in memory (a lease marked `operator`, leases.py) over blocks of the host tier; both
are gone after a restart. With a disk tier, the cache writes every live pin here (its namespace
id, its tokens, its blocks' hashes, when it ends in wall time, its priority) whenever the set of
pins changes, and the disk tier keeps those blocks out of its LRU and TTL eviction. At the next
start the disk tier reads the book back; each pin is made again (same id, priority and end) when
its namespace is attached, from the blocks on disk (PrefixCache.attach).

The file is JSON, replaced whole (written beside, flushed, renamed over), so a kill leaves the
old book or the new one, never half of either.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

FILE_NAME = "prefixcache-pins.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PinRecord:
    pin_id: int
    namespace_id: str
    tokens: tuple[int, ...]  # the pinned prefix: whole blocks of the namespace
    block_hashes: tuple[bytes, ...]  # its blocks' chained hashes (the disk tier's keys)
    expires_unix: float | None  # wall time; None: no TTL
    priority: int

    def live(self, now_unix: float) -> bool:
        return self.expires_unix is None or self.expires_unix > now_unix


def write(path: str, records: list[PinRecord]) -> None:
    """Replace the book at `path` with `records` (atomically; OSError on failure)."""
    body = {
        "schema_version": SCHEMA_VERSION,
        "pins": [
            {
                "pin_id": r.pin_id,
                "namespace_id": r.namespace_id,
                "tokens": list(r.tokens),
                "block_hashes": [h.hex() for h in r.block_hashes],
                "expires_unix": r.expires_unix,
                "priority": r.priority,
            }
            for r in records
        ],
    }
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(body, out, separators=(",", ":"))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def read(path: str) -> list[PinRecord]:
    """The records of the book at `path` ([] when there is none); ValueError naming what is wrong
    when it cannot be read as one."""
    try:
        with open(path, encoding="utf-8") as source:
            body = json.load(source)
    except FileNotFoundError:
        return []
    if not isinstance(body, dict) or body.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version: expected {SCHEMA_VERSION}")
    pins = body.get("pins")
    if not isinstance(pins, list):
        raise ValueError("pins: expected a list")
    records = []
    for i, pin in enumerate(pins):
        try:
            for field in ("tokens", "block_hashes"):  # (a string would iterate as characters)
                if not isinstance(pin[field], list):
                    raise TypeError(f"{field}: expected a list")
            expires = pin["expires_unix"]
            records.append(
                PinRecord(
                    pin_id=int(pin["pin_id"]),
                    namespace_id=str(pin["namespace_id"]),
                    tokens=tuple(int(t) for t in pin["tokens"]),
                    block_hashes=tuple(bytes.fromhex(h) for h in pin["block_hashes"]),
                    expires_unix=None if expires is None else float(expires),
                    priority=int(pin["priority"]),
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"pins[{i}]: {error!r}") from error
    return records
