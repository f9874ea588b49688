"""Host tier: a slot pool in a named POSIX shared-memory segment.

A co-located worker maps the same segment (see `MappedSegment`) and reads or
writes slots directly, so a hit moves no bytes through the service. The
segment is created owner-only (mode 0600) and is unlinked when the owning
tier closes. Pinned (page-locked) memory is used only when CUDA is present.
"""

from __future__ import annotations

import _posixshmem
import logging
import mmap
import os
import secrets
from multiprocessing import shared_memory

import torch

from ..config import KVLayout
from ..errors import ConfigError
from .base import ShareHandle, TierKind
from .pool import TensorPool

log = logging.getLogger(__name__)


def slots_for(capacity_bytes: int, layout: KVLayout, field_name: str) -> int:
    """Whole blocks that fit in an exact byte budget; a budget below one block is an error."""
    slots = capacity_bytes // layout.block_bytes
    if slots < 1:
        raise ConfigError(field_name, f"{capacity_bytes} bytes is less than one block ({layout.block_bytes} bytes)")
    return slots


def _tensor_over(buffer: memoryview, layout: KVLayout, num_slots: int) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=num_slots * layout.block_bytes)  # slots are bytes
    return flat.view(layout.dtype.torch).view(num_slots, *layout.block_shape)


class HostTier(TensorPool):
    """Owner of the shared-memory segment; `segment_name` is what workers map."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, segment_name: str | None = None) -> None:
        num_slots = slots_for(capacity_bytes, layout, "host_capacity")
        self.segment_name = segment_name or f"prefixcache-{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(self.segment_name, create=True, size=num_slots * layout.block_bytes)
        self._shm: shared_memory.SharedMemory | None = shm
        assert shm.buf is not None  # None only after close()
        storage = _tensor_over(shm.buf, layout, num_slots)
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes, 0)
        super().__init__(TierKind.HOST, layout, storage)
        log.info("host tier: %d slots of %d bytes in shm %s", num_slots, layout.block_bytes, self.segment_name)

    def share_handle(self) -> ShareHandle:
        return ShareHandle(TierKind.HOST, self.num_slots, self.layout.block_bytes, segment=self.segment_name)

    def close(self) -> None:
        if self._shm is None:
            return
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
        super().close()
        self._shm.close()
        self._shm.unlink()
        self._shm = None


class MappedSegment:
    """A worker's mapping of the service's host tier (no copy, no ownership).

    Maps the segment with shm_open + mmap rather than `SharedMemory`: before
    Python 3.13 an attached `SharedMemory` is registered with the resource
    tracker, which would unlink the service's segment when this process exits.
    """

    def __init__(self, segment_name: str, layout: KVLayout, num_slots: int) -> None:
        fd = _posixshmem.shm_open("/" + segment_name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < num_slots * layout.block_bytes:
                raise ConfigError("segment", f"shared memory {segment_name!r} is smaller than {num_slots} slots")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.pool = TensorPool(TierKind.HOST, layout, _tensor_over(memoryview(self._map), layout, num_slots))

    def close(self) -> None:
        self.pool.close()
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor handed out still views the mapping; it is unmapped when that goes
