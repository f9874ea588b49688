"""The tier interface: where a block's payload can live.

A *slot tier* (device, host) is a preallocated pool of equal-sized slots, each
holding one block in the namespace layout `[layers, 2, kv_heads, block_size,
head_dim]`. The cache owns which slots are used (free list here, metadata in
the index); a tier only stores bytes. The Redis tier is keyed by block hash
instead of slot and lives in `tiers/redis.py`.
"""

from __future__ import annotations

import array
import enum
from typing import Protocol

import numpy as np
import torch


class TierKind(enum.IntEnum):
    """Tiers from fastest to slowest; a block spills to the next one."""

    DEVICE = 0
    HOST = 1
    REDIS = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class SlotTier(Protocol):
    """A fixed pool of block slots (one tensor, no allocation per block)."""

    kind: TierKind
    num_slots: int
    capacity_bytes: int

    def read(self, slots: list[int]) -> torch.Tensor:
        """Copy of the blocks in `slots`, shape `[len(slots), *block_shape]`."""

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Store one block (already validated for shape and dtype) in `slot`."""

    def write_many(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Store `blocks[i]` (validated, `[len(slots), *block_shape]`) in `slots[i]`."""

    def view(self, slot: int) -> torch.Tensor:
        """The slot's storage itself (no copy), shape `block_shape`."""

    def close(self) -> None:
        """Release the pool's memory."""


class FreeSlots:
    """LIFO free list of slot numbers (4 bytes + 1 flag byte per slot, no Python int per slot).

    Invariant: a slot is either in this list or owned by exactly one index
    node or reservation; never both, never neither.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = array.array("i", range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def give(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} is outside [0, {self.num_slots})")
        if self._is_free[slot]:
            raise RuntimeError(f"slot {slot} freed twice")
        self._is_free[slot] = 1
        self._free.append(slot)

    def take_many(self, count: int) -> tuple[int, ...]:
        """Up to `count` slots, the same ones (in the same order) as `count` calls of `take`."""
        count = min(count, len(self._free))
        if count <= 0:
            return ()
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        np.frombuffer(self._is_free, dtype=np.uint8)[np.frombuffer(taken, dtype=np.int32)] = 0
        return tuple(taken[::-1])

    def give_many(self, slots: np.ndarray) -> None:
        """`give` of each of `slots` (distinct), checked before any change."""
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        ordered = np.sort(slots)
        if ordered[0] < 0 or ordered[-1] >= self.num_slots:
            raise RuntimeError(f"a slot is outside [0, {self.num_slots})")
        flags = np.frombuffer(self._is_free, dtype=np.uint8)
        if flags[slots].any() or (ordered[1:] == ordered[:-1]).any():
            raise RuntimeError("a slot freed twice")
        flags[slots] = 1
        self._free.frombytes(slots.astype(np.int32).tobytes())

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
