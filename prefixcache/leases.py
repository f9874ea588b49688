"""Leases (timed pins on a matched path) and reservations (slots being written).

Ids are random 63-bit numbers, so a client cannot guess another's lease.
Both expire, so a crashed worker cannot hold memory forever.

Invariant: every node of a live lease's path carries one pin for that lease;
every reserved slot is out of its tier's free list and owned by nobody else.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    id: int
    namespace: int
    nodes: tuple[int, ...]
    expires_at: float


@dataclass(frozen=True)
class Reservation:
    id: int
    tier: int
    slots: tuple[int, ...]
    expires_at: float
    namespace: int = -1  # row of the namespace it was reserved for (its tenant's quota); -1: none given


def new_id(taken: dict) -> int:
    while True:
        candidate = secrets.randbits(63) or 1
        if candidate not in taken:
            return candidate


def expired(table: dict, now: float) -> list:
    """Pop and return the entries of `table` whose `expires_at` has passed."""
    gone = [key for key, entry in table.items() if entry.expires_at <= now]
    return [table.pop(key) for key in gone]
