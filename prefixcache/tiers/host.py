"""Host tier: a slot pool in a named POSIX shared-memory segment.

A co-located worker maps the same segment (see `MappedSegment`) and reads or
writes slots directly, so a hit moves no bytes through the service. The
segment is created owner-only (mode 0600) and is unlinked when the owning
tier closes. Pinned (page-locked) memory is used only when CUDA is present.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from multiprocessing import resource_tracker, shared_memory

import _posixshmem
import torch

from ..config import KVLayout
from ..errors import ConfigError
from .base import TierKind
from .pool import TensorPool, torch_dtype

log = logging.getLogger(__name__)


def slots_for(capacity_bytes: int, layout: KVLayout, field_name: str) -> int:
    """Whole blocks that fit in an exact byte budget; a budget below one block is an error."""
    slots = capacity_bytes // layout.block_bytes
    if slots < 1:
        raise ConfigError(field_name, f"{capacity_bytes} bytes is less than one block ({layout.block_bytes} bytes)")
    return slots


def _tensor_over(buffer: memoryview, layout: KVLayout, num_slots: int) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch_dtype(layout), count=num_slots * layout.block_bytes // layout.dtype.itemsize)
    return flat.view(num_slots, *layout.block_shape)


class HostTier(TensorPool):
    """Owner of the shared-memory segment; `segment_name` is what workers map."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, segment_name: str | None = None) -> None:
        num_slots = slots_for(capacity_bytes, layout, "host_capacity")
        self.segment_name = segment_name or f"prefixcache-{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(self.segment_name, create=True, size=num_slots * layout.block_bytes)
        self._unlinked = False
        storage = _tensor_over(self._shm.buf, layout, num_slots)
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes, 0)
        super().__init__(TierKind.HOST, layout, storage)
        log.info("host tier: %d slots of %d bytes in shm %s", num_slots, layout.block_bytes, self.segment_name)

    def close(self) -> None:
        if self._shm is None:
            return
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
        super().close()
        self._shm.close()
        self.unlink()
        self._shm = None

    def unlink(self) -> None:
        """Remove the segment's name (idempotent); one already removed, e.g. by hand, is logged once."""
        if self._shm is None or self._unlinked:
            return
        self._unlinked = True
        try:
            self._shm.unlink()
        except FileNotFoundError:
            log.warning("host tier: shared memory %s was already removed; nothing to unlink", self.segment_name)
            resource_tracker.unregister(self._shm._name, "shared_memory")  # else it warns at exit


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
