"""Device tier: one preallocated paged pool on the accelerator.

Configured only where CUDA exists (the service refuses a device capacity
without it); tests run the same code with `device="cpu"`.
"""

from __future__ import annotations

import torch

from ..config import KVLayout
from .base import TierKind
from .host import slots_for
from .pool import TensorPool


class DeviceTier(TensorPool):
    def __init__(self, layout: KVLayout, capacity_bytes: int, device: str | torch.device = "cuda") -> None:
        num_slots = slots_for(capacity_bytes, layout, "device_capacity")
        storage = torch.empty((num_slots, *layout.block_shape), dtype=layout.dtype.torch, device=device)
        super().__init__(TierKind.DEVICE, layout, storage)
