"""What `prefixcache top` shows, computed from a ring buffer of stats documents.

Owns the arithmetic: rates per second between the last two snapshots, hit
rates over a sliding window (default one minute), and the recent evictions
(counter increases by tier and reason, newest first). No I/O, no terminal.

Invariants:
- The ring holds snapshots in arrival order, all of one service incarnation:
  a snapshot whose uptime went backwards (the cache was re-created) clears it,
  so a rate is never computed across a counter reset.
- The window keeps the newest snapshot older than `window_s` as its base, so
  "last minute" covers a full minute once a minute of history exists.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from .document import ratio

RATE_FIELDS = (  # (label, path in the document)
    ("lookups/s", ("requests", "lookups")),
    ("tokens looked up/s", ("tokens", "looked_up")),
    ("tokens saved/s", ("tokens", "saved")),
    ("blocks committed/s", ("blocks", "committed")),
    ("evictions/s", ("evictions", "total")),
)


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic() when the answer arrived
    doc: dict


@dataclass(frozen=True)
class EvictionEvent:
    wall_time: float
    tier: str
    reason: str
    blocks: int


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> float:
    *parents, leaf = path
    for key in parents:
        doc = doc[key]
    return float(doc[leaf])


def _sum_map(mapping: dict) -> int:
    return sum(int(v) for v in mapping.values())


class TopModel:
    def __init__(self, window_s: float = 60.0, max_events: int = 8) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[Sample] = deque()
        self.events: deque[EvictionEvent] = deque(maxlen=max_events)
        self.refreshes = 0

    def add(self, doc: dict, at: float | None = None, wall_time: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        previous = self._samples[-1] if self._samples else None
        if previous is not None and doc["uptime_seconds"] < previous.doc["uptime_seconds"]:
            self._samples.clear()  # the cache was re-created: counters restarted from zero
            previous = None
        if previous is not None:
            self._record_evictions(previous.doc, doc, time.time() if wall_time is None else wall_time)
        self._samples.append(Sample(at, doc))
        while len(self._samples) > 2 and at - self._samples[1].at >= self.window_s:
            self._samples.popleft()
        self.refreshes += 1

    def _record_evictions(self, old: dict, new: dict, wall_time: float) -> None:
        before = old["evictions"]["by_tier"]
        for tier, reasons in new["evictions"]["by_tier"].items():
            for reason, count in reasons.items():
                grown = count - before.get(tier, {}).get(reason, 0)
                if grown > 0:
                    self.events.appendleft(EvictionEvent(wall_time, tier, reason, grown))

    @property
    def latest(self) -> dict | None:
        return self._samples[-1].doc if self._samples else None

    def rates(self) -> dict[str, float | None]:
        """Per-second rates between the last two snapshots (None before the second)."""
        if len(self._samples) < 2:
            unknown: dict[str, float | None] = {label: None for label, _ in RATE_FIELDS}
            return unknown | {"spills/s": None, "promotions/s": None}
        old, new = self._samples[-2], self._samples[-1]
        elapsed = max(new.at - old.at, 1e-9)
        rates: dict[str, float | None] = {
            label: (_get(new.doc, path) - _get(old.doc, path)) / elapsed for label, path in RATE_FIELDS
        }
        spills = _sum_map(new.doc["spills"]["by_tier"]) - _sum_map(old.doc["spills"]["by_tier"])
        promotions = _sum_map(new.doc["promotions"]) - _sum_map(old.doc["promotions"])
        return rates | {"spills/s": spills / elapsed, "promotions/s": promotions / elapsed}

    def window(self) -> dict[str, float | None]:
        """Hit rates and span over the window: from its oldest snapshot to the newest."""
        if len(self._samples) < 2:
            return {"seconds": 0.0, "request_hit_rate": None, "token_hit_rate": None, "tokens_saved": 0.0}
        old, new = self._samples[0], self._samples[-1]

        def delta(*path: str) -> float:
            return _get(new.doc, path) - _get(old.doc, path)

        return {
            "seconds": new.at - old.at,
            "request_hit_rate": ratio(delta("requests", "hits"), delta("requests", "lookups")),
            "token_hit_rate": ratio(delta("tokens", "hits"), delta("tokens", "looked_up")),
            "tokens_saved": delta("tokens", "saved"),
        }
