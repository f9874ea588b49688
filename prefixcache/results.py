"""What cache calls return: block locations, lookup and commit results (frozen values).

`BlockLocations` is the sequence of where each hit block lives. It is backed
by two small arrays rather than one Python object per block, so a lookup of
a 512-block prompt builds two array slices instead of 512 objects (that alone
was ~0.5 ms per lookup); `BlockLocation`s are made only when iterated or
indexed, and callers that want bulk numbers read `.tiers` / `.slots`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from .kinds import MissReason, TierKind


@dataclass(frozen=True)
class BlockLocation:
    tier: TierKind
    slot: int


class BlockLocations(Sequence[BlockLocation]):
    """Immutable, root-first sequence of `BlockLocation`s over `tiers` (int8) and `slots` (int32)."""

    __slots__ = ("tiers", "slots")

    def __init__(self, tiers: np.ndarray | Sequence[int], slots: np.ndarray | Sequence[int]) -> None:
        tier_array = np.array(tiers, dtype=np.int8)
        slot_array = np.array(slots, dtype=np.int32)
        if tier_array.ndim != 1 or tier_array.shape != slot_array.shape:
            raise ValueError(f"tiers {tier_array.shape} and slots {slot_array.shape} must be equal-length 1-d")
        tier_array.flags.writeable = False
        slot_array.flags.writeable = False
        self.tiers = tier_array
        self.slots = slot_array

    @classmethod
    def adopt(cls, tiers: np.ndarray, slots: np.ndarray) -> BlockLocations:
        """Wrap fresh arrays (int8 tiers, int32 slots) that nobody else holds, without copying."""
        locations = cls.__new__(cls)
        tiers.flags.writeable = False
        slots.flags.writeable = False
        locations.tiers, locations.slots = tiers, slots
        return locations

    @classmethod
    def of(cls, locations: Iterable[BlockLocation]) -> BlockLocations:
        if isinstance(locations, BlockLocations):
            return locations
        pairs = [(int(loc.tier), int(loc.slot)) for loc in locations]
        return cls([t for t, _ in pairs], [s for _, s in pairs])

    def __len__(self) -> int:
        return len(self.slots)

    def __reduce__(self) -> tuple[type[BlockLocations], tuple[np.ndarray, np.ndarray]]:
        return BlockLocations, (self.tiers, self.slots)  # unpickled read-only, like the original

    @overload
    def __getitem__(self, item: int) -> BlockLocation: ...
    @overload
    def __getitem__(self, item: slice) -> BlockLocations: ...

    def __getitem__(self, item: int | slice) -> BlockLocation | BlockLocations:
        if isinstance(item, slice):
            return BlockLocations(self.tiers[item], self.slots[item])
        return BlockLocation(TierKind(int(self.tiers[item])), int(self.slots[item]))

    def __iter__(self) -> Iterator[BlockLocation]:
        for tier, slot in zip(self.tiers.tolist(), self.slots.tolist()):
            yield BlockLocation(TierKind(tier), slot)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockLocations):
            return bool(np.array_equal(self.tiers, other.tiers) and np.array_equal(self.slots, other.slots))
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.tiers.tobytes(), self.slots.tobytes()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{TierKind(t).label}:{s}" for t, s in zip(self.tiers[:8].tolist(), self.slots[:8].tolist()))
        more = f", ... ({len(self)} blocks)" if len(self) > 8 else ""
        return f"BlockLocations([{shown}{more}])"


@dataclass(frozen=True)
class LookupResult:
    namespace_id: str
    prompt_tokens: int
    hit_tokens: int  # a multiple of block_size
    locations: BlockLocations
    miss_reason: MissReason | None  # why the first uncached full block missed
    lease_id: int | None = None
    lease_expires_at: float | None = None
    remote_blocks_declined: int = 0  # blocks past the hit Redis was not asked for: slower than recomputing


@dataclass(frozen=True)
class CommitResult:
    stored: int  # new blocks now in the cache
    deduplicated: int  # blocks someone had already stored (their slots were freed)
    rejected: int  # blocks not stored: their prefix is no longer cached, or a collision
    retention_s: float = 0.0  # the retention hint applied (after the tenant's bound); 0: none given
    retention_clamped: bool = False  # the hint was longer than the tenant's bound and cut to it


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt's longest cached prefix as a router sees it (`PrefixCache.match`): no lease,
    no touch, no count, no Redis I/O. `blocks` counts matched blocks per local tier holding any;
    `remote_blocks` is how many leading ones the cache believes Redis still holds; `disk_blocks`
    how many past the local hit the disk tier holds, in a row (a lookup would promote them)."""

    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    blocks: dict[TierKind, int]
    remote_blocks: int
    miss_reason: MissReason | None
    disk_blocks: int = 0
