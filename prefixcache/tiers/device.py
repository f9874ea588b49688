"""Device tier: one preallocated paged pool on the accelerator, an arena of chunks (tiers/arena.py).

Configured only where CUDA exists (the service refuses a device capacity
without it); tests run the same code with `device="cpu"`.
"""

from __future__ import annotations

import torch

from ..config import KVLayout
from ..kinds import TierKind
from .arena import Arena, chunk_bytes_for
from .host import slots_for
from .pool import TensorPool


class DeviceTier(TensorPool):
    """The pool of its first layout over the device arena that other layouts join (`arena.add_layout`)."""

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        device: str | torch.device = "cuda",
        chunk_bytes: int | None = None,
        min_block_bytes: int | None = None,
    ) -> None:
        size = slots_for(capacity_bytes, layout, "device_capacity") * layout.block_bytes
        data = torch.empty(size, dtype=torch.uint8, device=device)
        self.arena = Arena(
            TierKind.DEVICE,
            data,
            chunk_bytes_for(size, layout.block_bytes, chunk_bytes),
            min(min_block_bytes or layout.block_bytes, layout.block_bytes),  # larger would only waste
        )
        super().__init__(TierKind.DEVICE, layout, data, self.arena.chunk_bytes, self.arena.per_chunk(layout))
        self.arena.adopt(self)

    def close(self) -> None:
        self.arena.close()
