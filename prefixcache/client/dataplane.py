"""The client's local data plane: the service's slot pools mapped into this process.

- Host pool: the host tier's POSIX shared-memory segment, mapped read-write
  (`MappedSegment`); a block in slot s, `[layers, 2, kv_heads, block_size,
  head_dim]`, is at the offset the service's chunk addressing gives (Attach
  answers chunk_bytes and slots_per_chunk; tiers/pool.py). On a CUDA host the
  mapping is page-locked here too (pinning is per process), so a host hit
  copies to the GPU by DMA.
- Device pool (CUDA hosts only): the device tier's storage opened from its
  CUDA IPC handle, so a device-resident hit is a device-to-device copy.

Copies go run by run: consecutive slots of one tier and one chunk move as one
slice, so a prefix stored in order is one memcpy per run, not one per block.

Invariant: this module never decides whether bytes are safe to read; the
caller holds a lease (reads) or a reservation (writes) for every slot it names.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from ..config import KVLayout
from ..errors import ConfigError
from ..kinds import TierKind
from ..results import BlockLocations
from ..rpc import cache_pb2 as pb
from ..tiers.host import MappedSegment
from ..tiers.pool import TensorPool, addressing
from .errors import CacheUnavailable

log = logging.getLogger(__name__)


def runs(
    tiers: np.ndarray, slots: np.ndarray, per_chunk: Mapping[int, int] | None = None
) -> Iterator[tuple[int, int, int, int]]:
    """(start, end, tier, first slot) of each run of consecutive slots within one tier and, with
    `per_chunk` (tier -> slots per chunk), within one chunk: only there are slots adjacent bytes."""
    if len(slots) == 0:
        return
    tiers = np.asarray(tiers, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    cut = (np.diff(slots) != 1) | (np.diff(tiers) != 0)
    if per_chunk:
        table = np.ones(max(per_chunk) + 1, dtype=np.int64)
        for tier, per in per_chunk.items():
            table[tier] = per
        cut |= np.diff(slots // table[np.minimum(tiers, len(table) - 1)]) != 0
    breaks = np.flatnonzero(cut) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(slots)]
    for start, end in zip(starts, ends):
        yield start, end, int(tiers[start]), int(slots[start])


def map_host_segment(segment: pb.SharedMemorySegment, layout: KVLayout) -> MappedSegment | None:
    """The host tier mapped into this process, or None when this process cannot open it."""
    if segment.slot_bytes != layout.block_bytes:
        log.warning(
            "host segment slots are %d bytes, expected %d; using the stream", segment.slot_bytes, layout.block_bytes
        )
        return None
    try:
        return MappedSegment(segment.name, layout, segment.num_slots, segment.chunk_bytes, segment.slots_per_chunk)
    except (OSError, ConfigError) as error:
        # Another host, another user (the segment is 0600) or a container without
        # the service's /dev/shm: the stream still works.
        log.info("cannot map the host tier %r (%s); KV will travel through gRPC", segment.name, error)
        return None


def map_device_pool(pool: pb.CudaIpcPool, layout: KVLayout) -> TensorPool | None:
    """The service's device pool opened from its CUDA IPC handle (this layout's slots), or None."""
    if not torch.cuda.is_available() or not pool.handle:
        return None
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            pool.device_index,
            pool.handle,
            pool.storage_size_bytes,
            pool.storage_offset_bytes,
            pool.ref_counter_handle,
            pool.ref_counter_offset,
            pool.event_handle,
            pool.event_sync_required,
        )
    except RuntimeError as error:
        log.info("cannot open the device pool by CUDA IPC (%s); using the host tier or the stream", error)
        return None
    chunk_bytes, per_chunk, span = addressing(
        pool.num_slots, layout.block_bytes, pool.chunk_bytes, pool.slots_per_chunk
    )
    data = torch.empty(0, dtype=torch.uint8, device=f"cuda:{pool.device_index}")
    data.set_(storage, 0, (span,), (1,))
    return TensorPool(TierKind.DEVICE, layout, data, chunk_bytes, per_chunk)


def _register_pinned(storage: torch.Tensor) -> bool:
    """Page-lock this process's mapping (pinning is per process) so host->GPU copies run at full speed."""
    if not torch.cuda.is_available():
        return False
    code = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.numel() * storage.element_size(), 0)
    if int(code) != 0:
        log.info("cannot pin the mapped host tier (cudaError %d); host->GPU copies will be slower", int(code))
        return False
    return True


class LocalPools:
    """The slot pools this process can address directly, by tier."""

    def __init__(self, host: MappedSegment | None, device: TensorPool | None) -> None:
        self._host = host
        self._pinned = False
        self.pools: dict[int, TensorPool] = {}
        if host is not None:
            self.pools[int(TierKind.HOST)] = host.pool
            self._pinned = _register_pinned(host.pool.data)
        if device is not None:
            self.pools[int(TierKind.DEVICE)] = device
        self._per_chunk = {tier: pool.per_chunk for tier, pool in self.pools.items()}

    @property
    def host(self) -> TensorPool | None:
        return self.pools.get(int(TierKind.HOST))

    def check_current(self) -> None:
        """CacheUnavailable when the mapped host segment is no longer the service's: a restarted
        service (whose namespace ids are the same) hands out slots of its new segment."""
        if self._host is not None and not self._host.current():
            raise CacheUnavailable("the service's shared memory was replaced (it restarted); attach again")

    def covers(self, locations: BlockLocations) -> bool:
        return bool(self.pools) and all(int(t) in self.pools for t in np.unique(locations.tiers).tolist())

    def pieces(self, locations: BlockLocations) -> Iterator[tuple[int, torch.Tensor]]:
        """(i, view): the blocks at locations[i : i + len(view)], one view of mapped slots per run
        (every tier must be mapped). The views alias the service's memory: no copy."""
        for start, end, tier, first in runs(locations.tiers, locations.slots, self._per_chunk):
            yield start, self.pools[tier].run(first, end - start)

    def gather(self, locations: BlockLocations, out: torch.Tensor) -> None:
        """out[i] <- the block at locations[i] (every tier must be mapped)."""
        for start, view in self.pieces(locations):
            out[start : start + len(view)].copy_(view)

    def host_pieces(self, slots: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """(i, view): host slots slots[i : i + len(view)], one view of mapped slots per run (for
        writes: the caller holds their reservation). The views alias the service's memory."""
        if not slots:
            return
        host = self.pools[int(TierKind.HOST)]
        if self.one_run(slots):
            yield 0, host.run(slots[0], len(slots))  # the common case: no numpy on the way
            return
        tiers = np.full(len(slots), int(TierKind.HOST))
        for start, end, _tier, first in runs(tiers, np.asarray(slots), self._per_chunk):
            yield start, host.run(first, end - start)

    def one_run(self, slots: Sequence[int]) -> bool:
        """Whether host slots `slots` are adjacent, ascending, in one chunk: one view of them."""
        first, last = slots[0], slots[-1]
        per_chunk = self.pools[int(TierKind.HOST)].per_chunk
        return first // per_chunk == last // per_chunk and tuple(slots) == tuple(range(first, last + 1))

    def prefault(self, slots: Sequence[int]) -> None:
        """Write a zero into each page of host slots this process holds a reservation for, so the
        store that fills them later does not pay this mapping's first-touch page faults (3.5 ms
        per 9 MiB on a 2-core EPYC, against 0.3 ms for the copy itself into touched pages)."""
        for _, view in self.host_pieces(slots):
            view.view(torch.uint8).reshape(-1)[:: mmap.PAGESIZE].zero_()

    def scatter(self, slots: Sequence[int], kv: torch.Tensor) -> None:
        """host slot slots[i] <- kv[i]."""
        for start, view in self.host_pieces(slots):
            view.copy_(kv[start : start + len(view)])

    def close(self) -> None:
        host = self.pools.get(int(TierKind.HOST))
        if self._pinned and host is not None:
            torch.cuda.cudart().cudaHostUnregister(host.data.data_ptr())
            self._pinned = False
        self.pools.clear()
        if self._host is not None:
            self._host.close()
            self._host = None
