"""Host tier: a slot pool in a named POSIX shared-memory segment.

A co-located worker maps the same segment (see `MappedSegment`) and reads or
writes slots directly, so a hit moves no bytes through the service. The
segment is an `OwnedSegment` (tiers/shm.py): created owner-only (mode 0600),
every page reserved before the tier exists (no SIGBUS, here or in a worker),
locked by its owner so a successor can tell a dead owner's segment from a live
one, and unlinked when the owning tier closes. The arena's chunks start at offset
0 of the segment; the owner record after them is never part of the pool. Pinned
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
from ..kinds import TierKind
from .arena import Arena, chunk_bytes_for
from .pool import TensorPool, addressing
from .shm import SHM_DIR, OwnedSegment, read_record

log = logging.getLogger(__name__)


def slots_for(capacity_bytes: int, layout: KVLayout, field_name: str) -> int:
    """Whole blocks that fit in an exact byte budget; a budget below one block is an error."""
    slots = capacity_bytes // layout.block_bytes
    if slots < 1:
        raise ConfigError(field_name, f"{capacity_bytes} bytes is less than one block ({layout.block_bytes} bytes)")
    return slots


class HostTier(TensorPool):
    """Owner of the shared-memory segment; `segment_name` is what workers map.

    The tier is the pool of its first layout over an `Arena` (tiers/arena.py) that other layouts
    join (`arena.add_layout`). `segment` is a segment reserved beforehand (the service claims one
    at start, sized to its byte budget, before any layout is known) or the name of one to create
    now (random if None). `chunk_bytes` and `min_block_bytes` size the arena (`chunk_bytes_for`;
    default minimum block: this layout's).
    """

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        segment: OwnedSegment | str | None = None,
        chunk_bytes: int | None = None,
        min_block_bytes: int | None = None,
        prefault: bool = False,
    ) -> None:
        num_slots = slots_for(capacity_bytes, layout, "host_capacity")
        size = num_slots * layout.block_bytes
        if not isinstance(segment, OwnedSegment):
            segment = OwnedSegment(segment or f"prefixcache-{secrets.token_hex(6)}", size, prefault=prefault)
        elif segment.data_bytes < size:
            raise ConfigError(
                "host_capacity",
                f"segment {segment.name} holds {segment.data_bytes} bytes, fewer than {num_slots} slots",
            )
        self._segment: OwnedSegment | None = segment
        self.segment_name = segment.name
        data = torch.frombuffer(segment.buf, dtype=torch.uint8, count=size)  # slots are bytes
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.nbytes, 0)
        self.arena = Arena(
            TierKind.HOST,
            data,
            chunk_bytes_for(size, layout.block_bytes, chunk_bytes),
            min(min_block_bytes or layout.block_bytes, layout.block_bytes),  # larger would only waste
        )
        self.arena.segment = segment.name
        super().__init__(TierKind.HOST, layout, data, self.arena.chunk_bytes, self.arena.per_chunk(layout))
        self.arena.adopt(self)
        log.info(
            "host tier: %d slots of %d bytes in shm %s (chunks of %d bytes)",
            num_slots,
            layout.block_bytes,
            self.segment_name,
            self.arena.chunk_bytes,
        )

    def close(self) -> None:
        """Unmap and unlink the segment; a segment file already removed (by an operator) is logged, not fatal."""
        if self._segment is None:
            return
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self.arena.data.data_ptr())
        self.arena.close()
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

    def __init__(
        self, segment_name: str, layout: KVLayout, num_slots: int, chunk_bytes: int = 0, per_chunk: int = 0
    ) -> None:
        """`num_slots` of `layout`, `per_chunk` in each chunk of `chunk_bytes` (0: one chunk, as a
        service from before arenas lays them out)."""
        chunk_bytes, per_chunk, need = addressing(num_slots, layout.block_bytes, chunk_bytes, per_chunk)
        fd = _posixshmem.shm_open("/" + segment_name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self._path = SHM_DIR / segment_name.lstrip("/")
            self._inode = os.fstat(fd).st_ino
            self._owner = read_record(fd)
            size = os.fstat(fd).st_size
            if size < need:
                raise ConfigError("segment", f"shared memory {segment_name!r} is smaller than {num_slots} slots")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        data = torch.frombuffer(memoryview(self._map), dtype=torch.uint8, count=need)
        self.pool = TensorPool(TierKind.HOST, layout, data, chunk_bytes, per_chunk)

    def current(self) -> bool:
        """Whether the segment's name still names the file mapped here. A restarted service
        creates a new file (under the same name when `--shm-name` fixes it): slots it hands out
        then live there, not in this mapping, whose bytes must be neither read nor written."""
        try:
            return os.stat(self._path).st_ino == self._inode
        except FileNotFoundError:
            # The name alone was removed (`rm` while serving: the service goes on from its mapping),
            # or the service is gone with it: current while the recorded owner process lives.
            return self._owner is None or self._owner.pid_matches()
        except OSError:
            return False

    def close(self) -> None:
        self.pool.close()
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor handed out still views the mapping; it is unmapped when that goes
