"""The cache's side of the remote tier (Redis): frames out, frames in, and belief.

The one holder of the `RemoteTier` (tiers/base.py): the cache calls the link, never the tier.

Owns encoding blocks into frames for the tier, verifying frames that come back
(checksum and key binding, via `codec`; with the tier's `hmac_key` also a MAC
bound to the Redis key, so a frame forged or moved by someone who can write
Redis but lacks the key fails like a corrupt one), and what the cache believes Redis
holds: per index row, the cache-clock time until which Redis should still
have the block (its write or last Redis hit plus the Redis TTL). Local hits
do not refresh the Redis copy, so past that time a block leaving the slot
tiers is written again rather than assumed safe in Redis.

It also learns what verifying fetched frames costs (`verify_estimate`), which a
probe's budget counts after the Redis round trip itself (transfer.ProbeBudget).

It never takes the cache lock: `fetch` runs without it (I/O), the other
methods are called by the cache with its lock held.

Writes are not copied. A block written through (`write_through`, at commit) goes to the tier as
the frame's header and a view of its slot; its path stays pinned, like a leased one, until the
tier is done with the frame (`settle` unpins it, under the cache lock, once the writer has said
so), so a slot is never reused while the writer may still read it. When those blocks must go
sooner (room, a quota, a manual eviction, a flush), `release_writes` has the tier copy the
frames still queued and finish the pipeline in flight (waiting at most RELEASE_WAIT_S): the
copy a write used to make, now made only then. A block leaving the slot tiers (`keep`) is
copied into an owned frame: its slot is freed at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np

from .codec import decode_block, encode_block, frame_parts, frame_size
from .config import KVLayout
from .errors import CorruptBlock
from .hashing import BlockHash
from .index import ROOT, RadixIndex
from .kinds import TierKind
from .namespaces import NamespaceRegistry
from .tiers.arena import Arena
from .tiers.base import RemoteStats, RemoteTier
from .transfer import ProbeBudget, TransferEstimate, TransferMeter

log = logging.getLogger(__name__)

PROBE_BATCH = 32  # block hashes asked of Redis per pipelined round trip
# How long `release_writes` waits, under the cache lock, for the pipeline in flight (one of 64
# frames of 2 MiB takes ~0.2 s on loopback; a stalled Redis times out later, in the writer).
RELEASE_WAIT_S = 0.25
# Checking a fetched frame until measured: header compare + xxh3 (~10 GB/s), plus HMAC-SHA256
# when frames are keyed (~2 GB/s with SHA-NI; tests/test_redis_hmac.py, docs/deploy.md).
VERIFY_PRIOR = TransferEstimate(latency_s=5e-6, bytes_per_s=10e9)
VERIFY_PRIOR_KEYED = TransferEstimate(latency_s=5e-6, bytes_per_s=2e9)


class RemoteLink:
    """Built with the index, the namespaces (id, root and layout of a block's row) and the
    slot tiers' arenas (where a block's bytes are: the node's tier, layout and slot)."""

    def __init__(
        self, remote: RemoteTier, index: RadixIndex, namespaces: NamespaceRegistry, arenas: dict[TierKind, Arena]
    ) -> None:
        self.tier = remote
        self.index = index
        self.namespaces = namespaces
        self.arenas = arenas
        self.ttl_s = remote.ttl_s
        self._mac_key = remote.hmac_key
        self._until = np.zeros(index.capacity, dtype=np.float64)
        # What checking fetched frames costs (a MAC dominates), so that a probe's budget counts it.
        self._verify = TransferMeter(VERIFY_PRIOR_KEYED if self._mac_key is not None else VERIFY_PRIOR)
        self._verify_lock = threading.Lock()  # lookups fetch concurrently, without the cache lock
        # Writes the tier is done with, appended by its writer thread (deque appends are atomic);
        # `settle` counts them off their `_Pinned` under the cache lock.
        self._finished: deque[_Pinned] = deque()
        self._pinned = 0  # paths still pinned for writes

    # -- reading (no cache lock held) ------------------------------------------------
    def fetch(
        self,
        ns_id: str,
        root: BlockHash,
        hashes: list[BlockHash],
        blocks: np.ndarray,
        start: int,
        layout: KVLayout,
        budget: ProbeBudget | None = None,
    ) -> tuple[list[memoryview], bool]:
        """Verified payloads (blocks of `layout`) of the blocks after `start` that Redis holds, in
        order, and whether they end at a block that failed verification (its key is then deleted)."""
        payloads: list[memoryview] = []
        verify = self.verify_estimate() if budget is not None else None
        # a longer reply is refused before it is allocated (hashes of one chain share a length)
        hash_bytes = max((len(h) for h in hashes[start:]), default=0)
        most = frame_size(layout, ns_id, hash_bytes, max(hash_bytes, len(root)), self._mac_key is not None)
        for batch_start in range(start, len(hashes), PROBE_BATCH):
            batch = hashes[batch_start : batch_start + PROBE_BATCH]
            frames = self.tier.fetch(
                ns_id,
                batch,
                frame_bytes=layout.block_bytes,
                prefix_only=True,
                budget=budget,
                verify=verify,
                max_frame_bytes=most,
            )
            checked, started = len(payloads), time.perf_counter()
            try:
                for i, frame in enumerate(frames, start=batch_start):
                    if frame is None:
                        return payloads, False
                    parent = hashes[i - 1] if i else root
                    mac_key, storage_key = self._mac(ns_id, hashes[i])
                    try:
                        payloads.append(
                            decode_block(
                                frame,
                                layout,
                                ns_id,
                                hashes[i],
                                parent,
                                blocks[i],
                                mac_key=mac_key,
                                storage_key=storage_key,
                            )
                        )
                    except CorruptBlock as error:
                        log.debug("remote block failed verification: %s", error)
                        self.tier.record_integrity_failure()
                        self.tier.delete(ns_id, hashes[i])
                        return payloads, True
            finally:
                self._observe_verify((len(payloads) - checked) * layout.block_bytes, time.perf_counter() - started)
        return payloads, False

    def verify_estimate(self) -> TransferEstimate:
        with self._verify_lock:
            return self._verify.estimate()

    def _observe_verify(self, nbytes: int, seconds: float) -> None:
        if nbytes:
            with self._verify_lock:
                self._verify.observe(nbytes, seconds)

    def fetched(self, node: int, now: float) -> None:
        """`node` was just admitted from Redis, whose read refreshed the key's TTL (to at least ttl_s)."""
        self._until[node] = now + self.ttl_s

    def believed(self, path: np.ndarray, now: float) -> int:
        """How many leading blocks of `path` Redis should still hold (no I/O: what Match reports)."""
        alive = self._until[path] > now
        return len(alive) if alive.all() else int(np.argmin(alive))

    # -- writing (cache lock held) ------------------------------------------------------
    def write_through(self, path: list[int], nodes: list[int], now: float, ttl_s: float | None = None) -> int:
        """Queue new blocks `nodes` (the end of `path + nodes`, a path from the root) for Redis so
        other instances and restarts can hit them, sent from their slots: the whole path stays
        pinned until the tier is done with every one (`settle`). Returns how many were dropped.
        `ttl_s`: their keys' TTL when longer than the tier's (a retention hint)."""
        rows = path + nodes
        pinned = _Pinned(rows, 0)  # counts the accepted writes (their `done` is settled under this lock)
        self.index.pin(rows)
        done = partial(self._finished.append, pinned)
        ttl = self.ttl_s if ttl_s is None else max(self.ttl_s, ttl_s)
        try:
            for node in nodes:
                accepted = self._submit(node, done, ttl)
                self._until[node] = now + ttl if accepted else 0.0
                pinned.left += accepted
        finally:
            if pinned.left:
                self._pinned += 1
            else:
                self.index.unpin(rows)
        return len(nodes) - pinned.left

    def settle(self) -> None:
        """Unpin the paths whose every write the tier is done with."""
        finished = self._finished
        while finished:
            pinned = finished.popleft()
            pinned.left -= 1
            if not pinned.left:
                self.index.unpin(pinned.rows)
                self._pinned -= 1

    def release_writes(self) -> bool:
        """Unpin the paths pinned for writes: the tier copies the frames still queued, and the
        pipeline in flight gets RELEASE_WAIT_S to finish (the cache lock is held: a stalled Redis
        must not hold up the cache longer; its blocks then stay pinned until their writes end).
        For when those blocks must go (room, a quota, a manual eviction or flush); whether any
        path was unpinned."""
        pinned = self._pinned
        if pinned:
            if not self.tier.own_frames(RELEASE_WAIT_S):
                log.debug("a Redis pipeline is still in flight: the blocks it sends stay pinned")
            self.settle()
        return self._pinned < pinned

    def keep(self, node: int, now: float) -> bool:
        """A block is leaving the slot tiers: make sure Redis keeps it (False: the write was dropped)."""
        kept = bool(self._until[node] > now) or self._submit(node, None)
        self._until[node] = 0.0
        return kept

    def dropped(self, node: int) -> None:
        """A block left the slot tiers without a spill; its row will be reused."""
        self._until[node] = 0.0

    def set_ttl(self, rows: np.ndarray, ttls_s: np.ndarray | float, now: float, extend_only: bool = False) -> int:
        """Give the keys of `rows` (index rows; those believed in Redis) the TTLs `ttls_s`, queued
        after the writes before it: a pin keeps its blocks' keys alive, an unpin gives them their
        normal TTL back, a retention hint lengthens them. With `extend_only`, only keys believed to
        expire sooner. Returns how many keys were asked."""
        rows = np.asarray(rows, dtype=np.int64)
        ttls = np.broadcast_to(np.asarray(ttls_s, dtype=np.float64), rows.shape)
        until = now + ttls
        chosen = self._until[rows] > now  # a write dropped or never made: PEXPIRE would find nothing
        if extend_only:
            chosen &= self._until[rows] < until
        rows, ttls = rows[chosen], ttls[chosen]
        if not len(rows):
            return 0
        self._until[rows] = now + ttls
        namespaces = self.index.namespace[rows]
        for ns_row in np.unique(namespaces).tolist():
            mine = namespaces == ns_row
            ns_id = self.namespaces.by_row(ns_row).id
            self.tier.expire(ns_id, [self.index.hash_of(int(r)) for r in rows[mine].tolist()], ttls[mine].tolist())
        return len(rows)

    def _submit(self, node: int, done: Callable[[], None] | None, ttl_s: float | None = None) -> bool:
        """Queue a block's frame: the slot's bytes themselves when `done` is given (the caller
        keeps the slot until it is called), else a copy (the slot is about to be freed)."""
        index = self.index
        entry = self.namespaces.by_row(int(index.namespace[node]))
        ns_id = entry.id
        parent = int(index.parent[node])
        parent_hash = entry.root if parent == ROOT else index.hash_of(parent)
        layout = int(self.namespaces.layout_of_row[index.namespace[node]])
        payload = self.arenas[TierKind(int(index.tier[node]))].pools[layout].block_bytes(int(index.slot[node]))
        block_hash = index.hash_of(node)
        mac_key, storage_key = self._mac(ns_id, block_hash)
        encode = encode_block if done is None else frame_parts
        frame = encode(
            entry.namespace.layout,
            ns_id,
            block_hash,
            parent_hash,
            index.tokens[node],
            payload,
            mac_key=mac_key,
            storage_key=storage_key,
        )
        return self.tier.submit(ns_id, block_hash, frame, ttl_s, done=done)

    def _mac(self, ns_id: str, block_hash: BlockHash) -> tuple[bytes | None, str | None]:
        """(mac_key, storage_key): codec arguments that key a frame to the Redis key it is stored
        under (both None when unkeyed)."""
        if self._mac_key is None:
            return None, None
        return self._mac_key, self.tier.key(ns_id, block_hash)

    # -- forgetting -------------------------------------------------------------------
    def forget(self, node: int) -> None:
        """Delete a block's key (manual eviction)."""
        ns_id = self.namespaces.by_row(int(self.index.namespace[node])).id
        self.tier.delete(ns_id, self.index.hash_of(node))
        self._until[node] = 0.0

    def forget_namespace(self, ns_id: str, rows: np.ndarray) -> None:
        self.tier.delete_namespace(ns_id)
        self._until[rows] = 0.0  # pinned survivors are no longer in Redis

    def flush(self) -> None:
        self.tier.flush()
        self._until[:] = 0.0

    # -- health and figures ---------------------------------------------------------------
    def is_up(self) -> bool:
        return self.tier.is_up()

    def stats(self) -> RemoteStats:
        """The tier's own stats (the service's metrics export Redis's)."""
        return self.tier.stats()

    def figures(self) -> dict[str, float]:
        """The tier's numeric counters by name (GetStats' `remote` map)."""
        return {k: v for k, v in vars(self.stats()).items() if isinstance(v, (int, float))}

    def close(self) -> bool:
        """Stop the tier's writer; False if it is still running (it may still read slots)."""
        return self.tier.close()


class _Pinned:
    """A path pinned for its blocks' writes: unpinned when the last of `left` is done."""

    __slots__ = ("rows", "left")

    def __init__(self, rows: list[int], left: int) -> None:
        self.rows = rows
        self.left = left
