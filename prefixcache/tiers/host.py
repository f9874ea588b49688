"""Host tier: a slot pool in a named POSIX shared-memory segment.

A co-located worker maps the same segment (see `MappedSegment`) and reads or
writes slots directly, so a hit moves no bytes through the service. The
segment is an `OwnedSegment` (tiers/shm.py): created owner-only (mode 0600),
every page reserved before the tier exists (no SIGBUS, here or in a worker),
locked by its owner so a successor can tell a dead owner's segment from a live
one, and unlinked when the owning tier closes. Slots start at offset 0 of the
segment; the owner record after them is never part of the pool. Pinned
(page-locked) memory is used only when CUDA is present.
"""

from __future__ import annotations

import _posixshmem
import logging
import mmap
import os
import secrets

import torch

from ..config import KVLayout
from ..errors import ConfigError
from .base import ShareHandle, TierKind
from .pool import TensorPool
from .shm import OwnedSegment

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
    """Owner of the shared-memory segment; `segment_name` is what workers map.

    `segment` is a segment reserved beforehand (the service claims one at start, sized to its
    byte budget, before any layout is known) or the name of one to create now (random if None).
    """

    def __init__(self, layout: KVLayout, capacity_bytes: int, segment: OwnedSegment | str | None = None) -> None:
        num_slots = slots_for(capacity_bytes, layout, "host_capacity")
        if not isinstance(segment, OwnedSegment):
            segment = OwnedSegment(segment or f"prefixcache-{secrets.token_hex(6)}", num_slots * layout.block_bytes)
        elif segment.data_bytes < num_slots * layout.block_bytes:
            raise ConfigError(
                "host_capacity",
                f"segment {segment.name} holds {segment.data_bytes} bytes, fewer than {num_slots} slots",
            )
        self._segment: OwnedSegment | None = segment
        self.segment_name = segment.name
        storage = _tensor_over(segment.buf, layout, num_slots)
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes, 0)
        super().__init__(TierKind.HOST, layout, storage)
        log.info("host tier: %d slots of %d bytes in shm %s", num_slots, layout.block_bytes, self.segment_name)

    def share_handle(self) -> ShareHandle:
        return ShareHandle(TierKind.HOST, self.num_slots, self.layout.block_bytes, segment=self.segment_name)

    def close(self) -> None:
        """Unmap and unlink the segment; a segment file already removed (by an operator) is logged, not fatal."""
        if self._segment is None:
            return
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
        super().close()
        self._segment.close()
        self._segment = None

    def unlink(self) -> None:
        """Remove the segment's name but keep it mapped (for a close that cannot unmap yet)."""
        if self._segment is not None:
            self._segment.unlink()


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
