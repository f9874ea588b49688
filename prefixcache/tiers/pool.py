"""A slot pool over one tensor: the storage shared by the device and host tiers.

Slots are bytes: every copy into or out of a slot moves the block's raw bytes
(through uint8 views), never converts elements, so a float8 block keeps its
exact bit patterns (NaN payloads included) and formats whose element ops torch
lacks on a device (index_copy_ of float8 on CPU) still move. The storage tensor
is a typed view `[num_slots, *layout.block_shape]` in `layout.dtype.torch`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import KVLayout
from ..errors import LayoutMismatch
from .base import TierKind


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (last dimension scaled by the element size); copies only
    when `tensor` is not contiguous."""
    return tensor.contiguous().view(torch.uint8)


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

    def read(self, slots: list[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        return self._bytes.index_select(0, index).view(self.storage.dtype)

    def write(self, slot: int, block: torch.Tensor) -> None:
        self._check_dtype(block)
        self._bytes[slot].copy_(as_bytes(block), non_blocking=False)

    def write_many(self, slots: list[int], blocks: torch.Tensor) -> None:
        """`blocks[i]` into `slots[i]` in one copy (a torch call per block costs more than the copy)."""
        if not slots:
            return
        self._check_dtype(blocks)
        index = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        self._bytes.index_copy_(0, index, as_bytes(blocks).to(self.storage.device))

    @property
    def _bytes(self) -> torch.Tensor:
        return self.storage.view(torch.uint8)

    def _check_dtype(self, blocks: torch.Tensor) -> None:
        # A byte copy would reinterpret another format's bits instead of failing: refuse it.
        if blocks.dtype != self.storage.dtype:
            raise LayoutMismatch(f"kv dtype {blocks.dtype} differs from the tier's {self.storage.dtype}")

    def write_bytes(self, slot: int, payload: memoryview | bytes) -> None:
        """Copy one block's raw bytes (e.g. a verified Redis payload) into a host slot."""
        target = self.storage[slot].view(torch.uint8).reshape(-1).numpy()
        target[:] = np.frombuffer(payload, dtype=np.uint8)

    def view(self, slot: int) -> torch.Tensor:
        return self.storage[slot]

    def close(self) -> None:
        self.storage = torch.empty(0)
