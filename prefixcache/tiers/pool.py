"""A slot pool of one KV layout over a tier's bytes: the storage view shared by every slot tier.

The tier's bytes are an arena of chunks (tiers/arena.py); this pool addresses one layout's slots
in it: slot `s` is block `s % per_chunk` of chunk `s // per_chunk`, at byte offset
`(s // per_chunk) * chunk_bytes + (s % per_chunk) * block_bytes`. A worker mapping the same bytes
computes the same offsets (`client/dataplane.py`). When `per_chunk * block_bytes == chunk_bytes`
(every layout whose blocks tile the chunk, always the arena's first) slot `s` is simply at
`s * block_bytes` and the pool is one tensor `[slots, *layout.block_shape]`; otherwise each slot is
a view of its own bytes.

Slots are bytes: every copy into or out of a slot moves the block's raw bytes as rows of machine
words (the widest integer type dividing the block size), never converting elements, so a float8
block keeps its exact bit patterns (NaN payloads included), formats whose element ops torch lacks
still move (no CPU index_copy_ for float8), and a copy costs per word, not per element (int64 rows
index_copy_ ran >= the typed bf16 one on a 2 MiB block, uint8 rows ~3x slower).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..config import KVLayout
from ..errors import LayoutMismatch
from ..kinds import TierKind
from ..native import core
from .base import ShareHandle


def _word(nbytes: int) -> torch.dtype:
    """The widest integer type whose size divides `nbytes`."""
    return next(word for word in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % word.itemsize == 0)


def as_rows(blocks: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """`[n, ...]` blocks as `[n, block bytes / word size]` words of the same memory (a copy only
    when `blocks` is not contiguous)."""
    return blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1).view(word)


def addressing(num_slots: int, block_bytes: int, chunk_bytes: int, per_chunk: int) -> tuple[int, int, int]:
    """(chunk_bytes, per_chunk, bytes spanned) of `num_slots` slots as a service announces them;
    chunk_bytes 0 (a service from before arenas) is one chunk holding every slot."""
    if not chunk_bytes or not per_chunk:
        chunk_bytes, per_chunk = max(1, num_slots) * block_bytes, max(1, num_slots)
    last = num_slots - 1
    span = (last // per_chunk) * chunk_bytes + (last % per_chunk + 1) * block_bytes if num_slots else 0
    return chunk_bytes, per_chunk, span


class TensorPool:
    """One layout's slots over `data` (flat uint8: the tier's whole arena), `per_chunk` slots in
    each chunk of `chunk_bytes` (the last chunk may be shorter and hold fewer).

    Reads gather with `index_select` (one copy) where slots tile the chunks; writes copy into the slot.
    """

    def __init__(
        self,
        kind: TierKind,
        layout: KVLayout,
        data: torch.Tensor,
        chunk_bytes: int | None = None,
        per_chunk: int | None = None,
    ) -> None:
        block = layout.block_bytes
        self.kind = kind
        self.layout = layout
        self.data = data
        self.capacity_bytes = data.numel()
        self.chunk_bytes = chunk_bytes or max(block, self.capacity_bytes // block * block)
        self.per_chunk = per_chunk or self.chunk_bytes // block
        if self.per_chunk < 1 or self.per_chunk * block > self.chunk_bytes:
            raise LayoutMismatch(f"{self.per_chunk} blocks of {block} bytes exceed a chunk of {self.chunk_bytes}")
        self.num_chunks = -(-self.capacity_bytes // self.chunk_bytes)
        self.id_space = self.num_chunks * self.per_chunk  # slot numbers; the last chunk's tail may be unusable
        self.num_slots = sum(self.slots_in(c) for c in range(self.num_chunks))
        self.tiled = self.per_chunk * block == self.chunk_bytes
        self._dtype = layout.dtype.torch
        self._word = _word(block)
        if self.tiled:
            rows = self.capacity_bytes // block
            self.storage = data[: rows * block].view(self._dtype).view(rows, *layout.block_shape)
            self._rows = data[: rows * block].view(rows, block).view(self._word)
        self._bytes: np.ndarray | None = None  # the CPU rows as [rows, block_bytes] u8, made on first use
        self.segment: str | None = None  # the shared-memory name of `data`, where another process can map it

    def slots_in(self, chunk: int) -> int:
        """How many of this layout's blocks chunk `chunk` holds (the last may be short)."""
        span = min(self.chunk_bytes, self.capacity_bytes - chunk * self.chunk_bytes)
        return min(self.per_chunk, span // self.layout.block_bytes)

    def chunk_slots(self, chunk: int) -> range:
        first = chunk * self.per_chunk
        return range(first, first + self.slots_in(chunk))

    def offset(self, slot: int) -> int:
        chunk, index = divmod(slot, self.per_chunk)
        return chunk * self.chunk_bytes + index * self.layout.block_bytes

    def run(self, first: int, count: int) -> torch.Tensor:
        """Slots `first..first+count` (all in one chunk) as one `[count, *block_shape]` view."""
        start = self.offset(first)
        flat = self.data[start : start + count * self.layout.block_bytes]
        return flat.view(self._dtype).view(count, *self.layout.block_shape)

    def view(self, slot: int) -> torch.Tensor:
        return self.storage[slot] if self.tiled else self.run(slot, 1)[0]

    def read(self, slots: list[int]) -> torch.Tensor:
        if not self.tiled:
            return torch.stack([self.view(slot) for slot in slots]) if slots else self.run(0, 0).clone()
        index = torch.tensor(slots, dtype=torch.long, device=self.data.device)
        words = self._rows.index_select(0, index)
        return words.view(torch.uint8).view(self._dtype).view(len(slots), *self.layout.block_shape)

    def write(self, slot: int, block: torch.Tensor) -> None:
        self._check_dtype(block)
        target = self._rows[slot] if self.tiled else self._slot_bytes(slot).view(self._word)
        target.copy_(as_rows(block.unsqueeze(0), self._word)[0], non_blocking=False)

    def write_many(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """`blocks[i]` into `slots[i]` in one copy (a torch call per block costs more than the copy)."""
        if not slots:
            return
        self._check_dtype(blocks)
        if not self.tiled:
            for slot, block in zip(slots, blocks):
                self.write(slot, block)
            return
        if self.data.device.type == "cpu" and blocks.device.type == "cpu":
            # One memcpy per block in the compiled core: torch's index_copy_ costs ~50 µs of
            # dispatch (far more when its thread pool wakes on a busy machine) for a few small
            # blocks, and a numpy fancy-index scatter ~10 µs.
            core.copy_rows(self._cpu_rows(), slots, blocks.contiguous().view(torch.uint8).numpy())
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.data.device)
        self._rows.index_copy_(0, index, as_rows(blocks, self._word).to(self.data.device))

    def _check_dtype(self, blocks: torch.Tensor) -> None:
        # A byte copy would reinterpret another format's bits instead of failing: refuse it.
        if blocks.dtype != self._dtype:
            raise LayoutMismatch(f"kv dtype {blocks.dtype} differs from the tier's {self._dtype}")

    def _slot_bytes(self, slot: int) -> torch.Tensor:
        start = self.offset(slot)
        return self.data[start : start + self.layout.block_bytes]

    def write_bytes(self, slot: int, payload: memoryview | bytes) -> None:
        """Copy one block's raw bytes (e.g. a verified Redis payload) into a host slot."""
        self._slot_bytes(slot).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)

    def _cpu_rows(self) -> np.ndarray:
        """A tiled CPU pool's rows as `[rows, block_bytes]` u8 (numpy indexing costs ~0.2 µs a
        slot, torch's slicing and `.numpy()` ~20)."""
        if self._bytes is None:
            self._bytes = self._rows.view(torch.uint8).numpy()
        return self._bytes

    def block_bytes(self, slot: int) -> memoryview:
        if self.tiled and self.data.device.type == "cpu":
            return memoryview(self._cpu_rows()[slot])
        block = self._slot_bytes(slot)
        if block.device.type != "cpu":
            block = block.cpu()
        return block.numpy().data

    def share_handle(self) -> ShareHandle | None:
        """How another process maps this pool: the shared-memory segment (host), CUDA IPC (a CUDA
        pool); None for a CPU pool outside shared memory (tests' device stand-in)."""
        if self.segment is None and self.data.device.type != "cuda":
            return None
        return ShareHandle(
            self.kind,
            self.num_slots,
            self.layout.block_bytes,
            segment=self.segment,
            cuda_ipc=self.data.untyped_storage()._share_cuda_() if self.segment is None else None,
            chunk_bytes=self.chunk_bytes,
            slots_per_chunk=self.per_chunk,
        )

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        if self.tiled:
            self.storage = torch.empty(0, dtype=self._dtype)
            self._rows = self.data
        self._bytes = None
