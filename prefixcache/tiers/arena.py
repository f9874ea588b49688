"""An arena: one slot tier's byte budget cut into chunks, each serving one KV layout at a time.

Namespaces of different models (layers, kv heads, head dim, dtype) hold blocks of different
sizes but share one byte budget per tier. The budget is cut into chunks of `chunk_bytes` (the
last one may be shorter); a chunk belongs to one layout at a time and holds
`chunk_bytes // block_bytes` of its blocks. Each layout has its own slot numbers, pool
(`TensorPool`, the addressing) and free list (`FreeSlots`): slot `s` of a layout is block
`s % per_chunk` of chunk `s // per_chunk`, so a worker that maps the tier computes any slot's
address from three constants, and a run of consecutive slots is contiguous within one chunk.

Invariants:
- A chunk is owned by at most one layout; exactly the slots of the chunks a layout owns are in
  its free list or held (by a block or a reservation), never both.
- A chunk changes hands only while it holds nothing (`give_chunk`): memory under a pinned block
  or a reservation never changes meaning. Emptying a chunk (eviction) is the placement's job.
- The arena's first layout owns every chunk at the start, so a cache of one layout is exactly
  one pool over the whole budget.
- No layout gets more slots per chunk than `chunk_bytes // min_block_bytes`, so the index,
  sized once for `max_slots`, can always hold a block per slot.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import KVLayout
from ..errors import ConfigError, LayoutMismatch
from ..kinds import TierKind
from .base import FreeSlots
from .pool import TensorPool

DEFAULT_CHUNK_BYTES = 64 << 20
MIN_CHUNKS = 4  # a budget cut in fewer could serve fewer layouts than a small deployment runs
CHUNK_ALIGN = 16  # every dtype's element size divides it, so a slot is a typed view in any chunk


def chunk_bytes_for(capacity_bytes: int, first_block_bytes: int, wanted: int | None = None) -> int:
    """The chunk size of a budget: `wanted` if given, else DEFAULT_CHUNK_BYTES, at most a quarter of
    the budget, rounded down to whole blocks of the first layout (at least one)."""
    if wanted is not None:
        if wanted < first_block_bytes or wanted % CHUNK_ALIGN:
            raise ConfigError(
                "chunk_bytes",
                f"{wanted} must be a multiple of {CHUNK_ALIGN} and hold one block ({first_block_bytes} bytes)",
            )
        return wanted
    target = min(DEFAULT_CHUNK_BYTES, capacity_bytes // MIN_CHUNKS)
    return max(1, target // first_block_bytes) * first_block_bytes


class Arena:
    """The chunks of one slot tier over `data` (flat uint8), and the layouts they serve."""

    def __init__(self, kind: TierKind, data: torch.Tensor, chunk_bytes: int, min_block_bytes: int) -> None:
        self.kind = kind
        self.data = data
        self.capacity_bytes = data.numel()
        self.chunk_bytes = chunk_bytes
        self.min_block_bytes = min_block_bytes
        self.num_chunks = -(-self.capacity_bytes // chunk_bytes)
        self.owner = np.full(self.num_chunks, -1, dtype=np.int16)  # layout id per chunk; -1: none yet
        spans = np.minimum(chunk_bytes, self.capacity_bytes - np.arange(self.num_chunks) * chunk_bytes)
        self.max_slots = int((spans // min_block_bytes).sum())
        self.pools: list[TensorPool] = []
        self.free: list[FreeSlots] = []
        self.owned: list[int] = []  # slots of the chunks each layout owns
        self.segment: str | None = None  # the shared-memory name workers map (host tier)

    def per_chunk(self, layout: KVLayout) -> int:
        """Slots of `layout` in one chunk; raises LayoutMismatch when its block cannot live in one."""
        block = layout.block_bytes
        if block > self.chunk_bytes:
            raise LayoutMismatch(
                f"a block of this layout is {block} bytes, more than the {self.kind.label} tier's chunk of "
                f"{self.chunk_bytes} (--chunk-bytes)"
            )
        if self.chunk_bytes % layout.dtype.itemsize:
            raise LayoutMismatch(f"the chunk of {self.chunk_bytes} bytes is not whole {layout.dtype.value} elements")
        return self.chunk_bytes // max(block, self.min_block_bytes)

    def add_layout(self, layout: KVLayout) -> TensorPool:
        """A pool for a new layout (its id is its position); the first one owns every chunk."""
        return self.adopt(TensorPool(self.kind, layout, self.data, self.chunk_bytes, self.per_chunk(layout)))

    def adopt(self, pool: TensorPool) -> TensorPool:
        """Take `pool` (made over this arena's bytes, `per_chunk` slots a chunk) as the next layout."""
        pool.segment = self.segment
        self.pools.append(pool)
        self.owned.append(0)
        if len(self.pools) == 1:  # every chunk; a short last chunk's tail is no slot
            self.free.append(FreeSlots(pool.id_space, np.arange(pool.num_slots)))
            self.owner[:] = 0
            self.owned[0] = pool.num_slots
        else:
            self.free.append(FreeSlots(pool.id_space, np.zeros(0, dtype=np.int64)))
        return pool

    def used(self, layout_id: int) -> int:
        """Slots of the layout held by blocks or reservations."""
        return self.owned[layout_id] - len(self.free[layout_id])

    def used_bytes(self) -> int:
        return sum(self.used(i) * pool.layout.block_bytes for i, pool in enumerate(self.pools))

    def chunks_of(self, layout_id: int, slots: np.ndarray) -> np.ndarray:
        return np.asarray(slots, dtype=np.int64) // self.pools[layout_id].per_chunk

    def empty_chunk(self, layout_id: int) -> int | None:
        """A chunk that holds nothing and does not serve `layout_id` (unowned, or all free)."""
        unowned = np.flatnonzero(self.owner < 0)
        if unowned.size:
            return int(unowned[0])
        for other, (pool, free) in enumerate(zip(self.pools, self.free)):
            if other == layout_id or not self.owned[other]:
                continue
            full = self.capacity_bytes // self.chunk_bytes  # whole chunks, then the short last one
            counts = free.flags()[: full * pool.per_chunk].reshape(full, pool.per_chunk).sum(axis=1)
            empty = np.flatnonzero((self.owner[:full] == other) & (counts == pool.per_chunk))
            if empty.size:
                return int(empty[0])
            if full < self.num_chunks and self.owner[full] == other and self.holds_nothing(full):
                return full
        return None

    def holds_nothing(self, chunk: int) -> bool:
        owner = int(self.owner[chunk])
        if owner < 0:
            return True
        slots = self.pools[owner].chunk_slots(chunk)
        return bool(self.free[owner].flags()[slots.start : slots.stop].all())

    def give_chunk(self, chunk: int, layout_id: int) -> None:
        """Hand an empty chunk to `layout_id`: its slots leave the old owner's free list, join the new's."""
        owner = int(self.owner[chunk])
        if owner == layout_id:
            return
        if owner >= 0:
            slots = self.pools[owner].chunk_slots(chunk)
            self.free[owner].remove(slots)  # raises, changing nothing, if anything is held there
            self.owned[owner] -= len(slots)
        slots = self.pools[layout_id].chunk_slots(chunk)
        self.free[layout_id].add(slots)
        self.owned[layout_id] += len(slots)
        self.owner[chunk] = layout_id

    def take_empty_chunk(self, layout_id: int) -> bool:
        """Give `layout_id` one more chunk if one holds nothing; False when none does."""
        chunk = self.empty_chunk(layout_id)
        if chunk is None:
            return False
        self.give_chunk(chunk, layout_id)
        return True

    def close(self) -> None:
        for pool in self.pools:
            TensorPool.close(pool)  # the views only: a tier that is also a pool closes the arena
        self.data = torch.empty(0, dtype=torch.uint8)
