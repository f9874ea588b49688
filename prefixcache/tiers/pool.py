"""A slot pool over one tensor: the storage shared by the device and host tiers.

Slots are bytes: every copy into or out of a slot moves the block's raw bytes as
rows of machine words (the widest integer type dividing the block size), never
converting elements, so a float8 block keeps its exact bit patterns (NaN payloads
included), formats whose element ops torch lacks still move (no CPU index_copy_
for float8), and a copy costs per word, not per element (int64 rows index_copy_
ran >= the typed bf16 one on a 2 MiB block, uint8 rows ~3x slower). The storage
tensor is a typed view `[num_slots, *layout.block_shape]` in `layout.dtype.torch`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import KVLayout
from ..errors import LayoutMismatch
from .base import ShareHandle, TierKind


def _word(nbytes: int) -> torch.dtype:
    """The widest integer type whose size divides `nbytes`."""
    return next(word for word in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % word.itemsize == 0)


def as_rows(blocks: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """`[n, ...]` blocks as `[n, block bytes / word size]` words of the same memory (a copy only
    when `blocks` is not contiguous)."""
    return blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1).view(word)


class TensorPool:
    """`num_slots` blocks in one tensor `[num_slots, *layout.block_shape]`.

    Reads gather with `index_select` (one copy); writes copy into the slot.
    """

    def __init__(self, kind: TierKind, layout: KVLayout, storage: torch.Tensor) -> None:
        self.kind = kind
        self.layout = layout
        self.num_slots = storage.shape[0]
        self.capacity_bytes = self.num_slots * layout.block_bytes
        self.storage = storage
        self._word = _word(layout.block_bytes)
        self._rows = as_rows(storage, self._word)
        self._bytes: np.ndarray | None = None  # the CPU storage as [num_slots, block_bytes] u8, made on first use

    def read(self, slots: list[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        words = self._rows.index_select(0, index)
        return words.view(torch.uint8).view(self.storage.dtype).view(len(slots), *self.layout.block_shape)

    def write(self, slot: int, block: torch.Tensor) -> None:
        self._check_dtype(block)
        self._rows[slot].copy_(as_rows(block.unsqueeze(0), self._word)[0], non_blocking=False)

    def write_many(self, slots: list[int], blocks: torch.Tensor) -> None:
        """`blocks[i]` into `slots[i]` in one copy (a torch call per block costs more than the copy)."""
        if not slots:
            return
        self._check_dtype(blocks)
        if self.storage.device.type == "cpu" and blocks.device.type == "cpu":
            # A numpy gather-assign of the raw bytes: torch's index_copy_ costs ~50 µs of dispatch
            # (and far more when its thread pool wakes on a busy machine) for a few small blocks.
            if self._bytes is None:
                self._bytes = self.storage.view(self.num_slots, -1).view(torch.uint8).numpy()
            source = blocks.reshape(len(slots), -1).contiguous().view(torch.uint8).numpy()
            self._bytes[np.asarray(slots, dtype=np.int64)] = source
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        self._rows.index_copy_(0, index, as_rows(blocks, self._word).to(self.storage.device))

    def _check_dtype(self, blocks: torch.Tensor) -> None:
        # A byte copy would reinterpret another format's bits instead of failing: refuse it.
        if blocks.dtype != self.storage.dtype:
            raise LayoutMismatch(f"kv dtype {blocks.dtype} differs from the tier's {self.storage.dtype}")

    def write_bytes(self, slot: int, payload: memoryview | bytes) -> None:
        """Copy one block's raw bytes (e.g. a verified Redis payload) into a host slot."""
        target = self.storage[slot].view(torch.uint8).reshape(-1).numpy()
        target[:] = np.frombuffer(payload, dtype=np.uint8)

    def block_bytes(self, slot: int) -> memoryview:
        block = self.storage[slot]
        if block.device.type != "cpu":
            block = block.cpu()
        return block.view(torch.uint8).reshape(-1).numpy().data

    def share_handle(self) -> ShareHandle | None:
        """A CUDA pool is shared by CUDA IPC; a CPU pool (tests' device stand-in) cannot be."""
        if self.storage.device.type != "cuda":
            return None
        return ShareHandle(
            self.kind, self.num_slots, self.layout.block_bytes, cuda_ipc=self.storage.untyped_storage()._share_cuda_()
        )

    def view(self, slot: int) -> torch.Tensor:
        return self.storage[slot]

    def close(self) -> None:
        self.storage = torch.empty(0)
        self._rows = self.storage
        self._bytes = None
