"""A slot pool over one tensor: the storage shared by the device and host tiers."""

from __future__ import annotations

import numpy as np
import torch

from ..config import KVLayout
from .base import TierKind

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype.value]


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
        self._bytes: np.ndarray | None = None  # the CPU storage as [num_slots, block_bytes] u8, made on first use

    def read(self, slots: list[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        return self.storage.index_select(0, index)

    def write(self, slot: int, block: torch.Tensor) -> None:
        self.storage[slot].copy_(block, non_blocking=False)

    def write_many(self, slots: list[int], blocks: torch.Tensor) -> None:
        """`blocks[i]` into `slots[i]` in one copy (a torch call per block costs more than the copy)."""
        if not slots:
            return
        if self.storage.device.type == "cpu" and blocks.device.type == "cpu":
            # A numpy gather-assign of the raw bytes: torch's index_copy_ costs ~50 µs of dispatch
            # (and far more when its thread pool wakes on a busy machine) for a few small blocks.
            if self._bytes is None:
                self._bytes = self.storage.view(self.num_slots, -1).view(torch.uint8).numpy()
            source = blocks.reshape(len(slots), -1).contiguous().view(torch.uint8).numpy()
            self._bytes[np.asarray(slots, dtype=np.int64)] = source
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        self.storage.index_copy_(0, index, blocks.to(self.storage.device))

    def write_bytes(self, slot: int, payload: memoryview | bytes) -> None:
        """Copy one block's raw bytes (e.g. a verified Redis payload) into a host slot."""
        target = self.storage[slot].view(torch.uint8).reshape(-1).numpy()
        target[:] = np.frombuffer(payload, dtype=np.uint8)

    def view(self, slot: int) -> torch.Tensor:
        return self.storage[slot]

    def close(self) -> None:
        self.storage = torch.empty(0)
        self._bytes = None
