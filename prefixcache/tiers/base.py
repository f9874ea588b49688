"""The tier interface: where a block's payload can live.

A *slot tier* (device, host) is a preallocated pool of equal-sized slots, each
holding one block in the namespace layout `[layers, 2, kv_heads, block_size,
head_dim]`. The cache owns which slots are used (free list here, metadata in
the index); a tier only stores bytes. Callers go through `SlotTier` only: raw
bytes in and out (`write_bytes`, `block_bytes`) and the handle another process
maps the pool by (`share_handle`).

The *remote tier* (`RemoteTier`, implemented by `tiers/redis.py`) is keyed by
namespace and block hash instead of slot; it holds framed blocks (codec.py) and
its writes are asynchronous. Only `remote_link.RemoteLink` talks to it. Its signatures name
no Redis type: options come down to `ttl_s` and `hmac_key`, stats to a `RemoteStats`.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..kinds import TierKind
from ..native import core
from ..presence import RemoteHeld
from ..transfer import ProbeBudget, TransferEstimate


class SlotTier(Protocol):
    """A fixed pool of block slots (one tensor, no allocation per block)."""

    kind: TierKind
    num_slots: int
    capacity_bytes: int

    def read(self, slots: list[int]) -> torch.Tensor:
        """Copy of the blocks in `slots`, shape `[len(slots), *block_shape]`."""

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Store one block (already validated for shape and dtype) in `slot`."""

    def write_many(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Store `blocks[i]` (validated, `[len(slots), *block_shape]`) in `slots[i]`."""

    def view(self, slot: int) -> torch.Tensor:
        """The slot's storage itself (no copy), shape `block_shape`."""

    def write_bytes(self, slot: int, payload: memoryview | bytes) -> None:
        """Copy one block's raw bytes (e.g. a verified Redis payload) into `slot`."""

    def block_bytes(self, slot: int) -> memoryview:
        """One block's raw bytes: a view of the slot in host memory, a copy from a device."""

    def share_handle(self) -> ShareHandle | None:
        """How another process maps this pool, or None where it cannot (a CPU stand-in device)."""

    def close(self) -> None:
        """Release the pool's memory."""


@dataclass(frozen=True)
class ShareHandle:
    """What a co-located process needs to map a slot tier without copying.

    Host: the POSIX shared-memory `segment` name. Device: `cuda_ipc`, the pool storage's
    `_share_cuda_()` tuple (CUDA IPC). Exactly one of the two is set.
    """

    kind: TierKind
    num_slots: int
    slot_bytes: int
    segment: str | None = None
    cuda_ipc: tuple[Any, ...] | None = None
    chunk_bytes: int = 0  # slot s is at (s // slots_per_chunk) * chunk_bytes + (s % slots_per_chunk) * slot_bytes
    slots_per_chunk: int = 0


# A frame as a remote tier sends it: one buffer, or a tuple of parts that join into it (a header
# and a view of the payload where it lies, so the block is never copied to be written).
Frame = bytes | tuple[bytes | memoryview, ...]


class RemoteStats(Protocol):
    """What the cache reads of any remote tier's stats snapshot (a frozen dataclass): whether
    reads go through, and its numeric fields, which GetStats reports by name. Each tier's own
    type says more (tiers/redis_stats.RedisStats, which the service's metrics export)."""

    @property
    def up(self) -> bool: ...


class RemoteTier(Protocol):
    """A shared store of framed blocks keyed by (namespace id, block hash), e.g. Redis.

    Reads are synchronous round trips, writes are queued (`submit` returns False when
    the write was dropped); a tier that is down answers misses rather than raising.
    """

    @property
    def ttl_s(self) -> float:
        """How long a written block stays (the link believes it there until then)."""

    @property
    def hmac_key(self) -> bytes | None:
        """The key frames are MAC-bound with (None: checksum and key binding only)."""

    def key(self, namespace_id: str, block_hash: bytes) -> str:
        """The storage key of a block (frames are MAC-bound to it)."""

    def fetch(
        self,
        namespace_id: str,
        hashes: Sequence[bytes],
        ttl_s: float | None = None,
        *,
        frame_bytes: int | None = None,
        prefix_only: bool = False,
        budget: ProbeBudget | None = None,
        verify: TransferEstimate | None = None,
        max_frame_bytes: int | None = None,
    ) -> list[bytes | memoryview | None]:
        """Frames for `hashes` (None: a miss, or not asked within the budget); a value longer than
        `max_frame_bytes` is never allocated (the fetch fails as a fault)."""

    def submit(
        self,
        namespace_id: str,
        block_hash: bytes,
        frame: Frame,
        ttl_s: float | None = None,
        *,
        done: Callable[[], None] | None = None,
    ) -> bool:
        """Queue a write; False when it was dropped (full, down or closing). The frame's buffers
        are read, not copied, until `done` is called (once, when the write is over, whatever its
        outcome; never after False)."""

    @property
    def presence_blocks(self) -> int:
        """Blocks a presence table's remote cells should hold for this tier (0: it follows none)."""

    def follow_presence(self, held: RemoteHeld) -> None:
        """Keep `held` (a presence table's remote cells, prefixcache/presence.py) holding the blocks
        the tier holds, whoever wrote them (only where `presence_blocks`)."""

    def delete(self, namespace_id: str, block_hash: bytes) -> None: ...

    def expire(self, namespace_id: str, hashes: Sequence[bytes], ttls_s: Sequence[float]) -> None:
        """Queue a TTL change of blocks already written (a pin or a retention hint keeps them
        longer, an unpin gives them their normal TTL back); a block the tier lacks is left so."""

    def delete_namespace(self, namespace_id: str) -> None: ...

    def flush(self) -> None: ...

    def record_integrity_failure(self) -> None: ...

    def is_up(self) -> bool: ...

    def stats(self) -> RemoteStats: ...

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued or in flight (tests, shutdown)."""

    def own_frames(self, timeout_s: float) -> bool:
        """Stop reading the buffers of submitted frames: copy the queued ones (their `done` is called)
        and wait up to `timeout_s` for those in flight; False if some are still in flight."""

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop writing; False if a write is still running (it may still read a frame's buffers)."""


class FreeSlots:
    """LIFO free list of slot numbers (4 bytes + 1 flag byte per slot, no Python int per slot).

    Invariant: a slot is either in this list or owned by exactly one index
    node or reservation; never both, never neither.
    """

    def __init__(self, num_slots: int, initial: np.ndarray | None = None) -> None:
        """Slot numbers in [0, `num_slots`); the free ones are `initial` (ascending; default all),
        taken in that order."""
        self.num_slots = num_slots
        if initial is None:
            self._free = array.array("i", range(num_slots - 1, -1, -1))
            self._is_free = bytearray(b"\x01") * num_slots
        else:
            self._free = array.array("i", np.asarray(initial, dtype=np.int32)[::-1].tobytes())
            self._is_free = bytearray(num_slots)
            self.flags()[np.asarray(initial, dtype=np.int64)] = 1

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
        slots = tuple(self._free[len(self._free) - count :][::-1])
        del self._free[len(self._free) - count :]
        core.flip_flags(self._is_free, slots, 0)  # a numpy scatter of a few flags costs ~3 µs more
        return slots

    def give_many(self, slots: np.ndarray) -> None:
        """`give` of each of `slots` (distinct), checked before any change."""
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.size:
            return
        try:
            core.flip_flags(self._is_free, slots, 1)  # one O(n) pass: ~15 µs less than numpy's for 256
        except ValueError as e:
            raise RuntimeError(f"slots: {e} (outside [0, {self.num_slots}), or freed twice)") from None
        self._free.frombytes(slots.astype(np.int32).tobytes())

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def flags(self) -> np.ndarray:
        """1 where a slot is free (a live view, read-only by convention)."""
        return np.frombuffer(self._is_free, dtype=np.uint8)

    def add(self, slots: range) -> None:
        """Make `slots` (none of them free or owned) free: taken in ascending order, after the slots
        already free (an arena handing this list a chunk; tiers/arena.py)."""
        if not len(slots):
            return
        flags = self.flags()
        if flags[slots.start : slots.stop].any():
            raise RuntimeError(f"slots {slots} are already free")
        flags[slots.start : slots.stop] = 1
        self._free = array.array("i", range(slots.stop - 1, slots.start - 1, -1)) + self._free

    def remove(self, slots: range) -> None:
        """Take `slots`, all free, out of this list for good (their chunk goes to another layout)."""
        if not len(slots):
            return
        flags = self.flags()
        if not flags[slots.start : slots.stop].all():
            raise RuntimeError(f"slots {slots} are not all free")
        flags[slots.start : slots.stop] = 0
        free = np.frombuffer(self._free, dtype=np.int32)
        kept = free[(free < slots.start) | (free >= slots.stop)]
        self._free = array.array("i", kept.tobytes())
