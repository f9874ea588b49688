"""Which blocks the index holds, published in shared memory for same-host engines to read.

An engine's scheduler asks the service about every new prompt, and most answers add nothing to
what the engine's own prefix cache has: a request whose next block no one has stored cannot hit.
The service therefore keeps a table of its indexed blocks' fingerprints in a shared-memory
segment beside its host tier; a same-host engine maps it read-only and skips the Lookup (and any
wait for it) when the block after its own prefix is not there (integrations/vllm/scheduler.py).
Every namespace's blocks share the one table; a salted prompt hashes from its salt's root, which
a view derives from the attached namespace's encoding around the salt (hashing.py `salt_gap`).

A fingerprint is the first 8 bytes of a block's chained hash (prefixcache/hashing.py) as a native
u64 (the block map's probe word: `BlockMap.words[0]`), with 0 reserved for an empty cell. The
table is `buckets` rows of `WAYS` cells; a fingerprint lives in row `fp & (buckets - 1)`.
Segment layout: a 64-byte header (`MAGIC`, ways, buckets), then the cells.

Invariants:
- The table is advice, never the answer: an engine that finds a block here still gets it only
  through a Lookup, which verifies tokens. A stale or torn read costs a Lookup (a block that is
  gone) or a hit (a block just stored), never wrong KV.
- The writer (the index, under the cache lock) adds a fingerprint when a block is indexed and
  clears it when the block leaves the index; the index's blocks are exactly the table's, except a
  block displaced from a full row (one of `WAYS` in a row of a table at most a quarter full:
  rare), which reads as absent until it is stored again.
- Only a service whose index is all it can hit publishes one: with a Redis or disk tier, a Lookup
  also finds blocks the index does not hold (another service's, or spilled), so no table is
  published and engines look up every prompt.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np

from .config import validate_salt
from .errors import ConfigError
from .hashing import BlockHash, Hasher, Tokens, token_array

MAGIC = b"pfxheld\x01"
WAYS = 8  # cells per row
HEADER_BYTES = 64
SALTED_ROOTS = 4096  # salts whose roots a view keeps (a salt is typically one user's, reused turn after turn)
_HEADER = struct.Struct("<8sIIQ")  # magic, ways, reserved, buckets
_NO_FPS = np.empty(0, dtype=np.uint64)
_ONE = np.uint64(1)


def buckets_for(capacity: int) -> int:
    """Rows for an index of `capacity` blocks: a power of two, the table at most a quarter full."""
    return 1 << max(0, (-(-4 * capacity // WAYS) - 1).bit_length())


def table_bytes(capacity: int) -> int:
    return HEADER_BYTES + buckets_for(capacity) * WAYS * 8


def fingerprints(hashes: Sequence[bytes]) -> np.ndarray:
    """The fingerprints of block hashes (their first 8 bytes as native u64; 0 reads as 1)."""
    if not hashes:
        return _NO_FPS
    return np.maximum(np.frombuffer(b"".join([h[:8] for h in hashes]), dtype=np.uint64), _ONE)


class PresenceTable:
    """The writer: a table over `buf` (zeroed memory of `table_bytes(capacity)` bytes)."""

    def __init__(self, buf: memoryview, capacity: int) -> None:
        buckets = buckets_for(capacity)
        if len(buf) < table_bytes(capacity):
            raise ValueError(f"{len(buf)} bytes cannot hold a presence table for {capacity} blocks")
        buf[:HEADER_BYTES] = _HEADER.pack(MAGIC, WAYS, 0, buckets).ljust(HEADER_BYTES, b"\0")
        self.cells = np.frombuffer(buf, dtype=np.uint64, count=buckets * WAYS, offset=HEADER_BYTES).reshape(
            buckets, WAYS
        )
        self.cells[:] = 0
        self.mask = np.uint64(buckets - 1)

    def add(self, words: np.ndarray) -> None:
        """Record blocks by their probe words (distinct blocks; `BlockMap.words[0]` of their rows)."""
        fps = _nonzero(words)
        if not fps.size:
            return
        rows = fps & self.mask
        ordered = np.sort(rows)
        if not (ordered[1:] == ordered[:-1]).any():  # one block per row, the usual case: one vectorised pass
            self._place(rows, fps)
            return
        _, first = np.unique(rows, return_index=True)
        alone = np.zeros(len(rows), dtype=bool)
        alone[first] = True
        self._place(rows[alone], fps[alone])
        for row, fp in zip(rows[~alone].tolist(), fps[~alone].tolist(), strict=True):  # rare: share a row
            self._place(np.array([row], dtype=np.uint64), np.array([fp], dtype=np.uint64))

    def _place(self, rows: np.ndarray, fps: np.ndarray) -> None:
        """Each fingerprint into the first empty cell of its row (distinct rows), or over the cell
        its top bits choose when the row is full (that block then reads as absent)."""
        cells = self.cells[rows]
        new = ~(cells == fps[:, None]).any(axis=1)
        if not new.any():
            return
        cells, rows, fps = cells[new], rows[new], fps[new]
        empty = cells == 0
        way = np.where(empty.any(axis=1), empty.argmax(axis=1), (fps >> np.uint64(61)).astype(np.int64) % WAYS)
        self.cells[rows, way] = fps

    def discard(self, words: np.ndarray) -> None:
        """Forget blocks by their probe words (absent ones are skipped)."""
        fps = _nonzero(words)
        if not fps.size:
            return
        rows = fps & self.mask
        at = self.cells[rows] == fps[:, None]
        which, way = np.nonzero(at)
        self.cells[rows[which], way] = 0

    def release(self) -> None:
        """Drop the view of the segment (before its owner unmaps it); the table is empty after."""
        self.cells = np.zeros((0, WAYS), dtype=np.uint64)


class PresenceView:
    """An engine's read-only mapping of a service's table (by its shm name), for one namespace:
    `root` its root hash, hashed with `hasher` in blocks of `block_size` tokens (the service's);
    `salt_gap` its encoding around the salt (hashing.py), for its salted siblings' roots (None:
    the service sent none, and salted prompts are not answered). Unmapped when the last
    reference to it goes (never under a reader on another thread)."""

    def __init__(
        self,
        segment_name: str,
        root: bytes,
        hasher: Hasher,
        block_size: int,
        salt_gap: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.root, self.hasher, self.block_size = BlockHash(root), hasher, block_size
        self.salt_gap = salt_gap
        self._salted: dict[str, BlockHash] = {}  # salt -> root; emptied when SALTED_ROOTS are held
        fd = _posixshmem.shm_open("/" + segment_name.lstrip("/"), os.O_RDONLY, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ConfigError("presence", f"shared memory {segment_name!r} is too short for a presence table")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, ways, _, buckets = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or ways != WAYS or buckets & (buckets - 1) or HEADER_BYTES + buckets * WAYS * 8 > size:
            self._map.close()
            raise ConfigError("presence", f"shared memory {segment_name!r} is not a presence table this version reads")
        self.cells = np.frombuffer(self._map, dtype=np.uint64, count=buckets * WAYS, offset=HEADER_BYTES).reshape(
            buckets, WAYS
        )
        self.mask = np.uint64(buckets - 1)

    def held_tokens(self, tokens: Tokens, salt: str | None = None) -> int | None:
        """How many leading tokens of `tokens` (salted `salt`) the table holds, in whole blocks;
        None for a salt it cannot hash (no `salt_gap`, or not a valid salt: the Lookup says why)."""
        root = self.root if salt is None else self._salted_root(salt)
        if root is None:
            return None
        fps = fingerprints(self.hasher.block_hashes(root, token_array(tokens), self.block_size))
        if not fps.size:
            return 0
        present = (self.cells[fps & self.mask] == fps[:, None]).any(axis=1)
        return (len(present) if present.all() else int(present.argmin())) * self.block_size

    def _salted_root(self, salt: str) -> BlockHash | None:
        root = self._salted.get(salt)
        if root is None and self.salt_gap is not None:
            try:
                validate_salt(salt)
            except ConfigError:
                return None
            if len(self._salted) >= SALTED_ROOTS:
                self._salted.clear()
            root = self._salted[salt] = self.hasher.salted_root(self.salt_gap, salt)
        return root


def _nonzero(words: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(words, dtype=np.uint64), _ONE)  # a new array: the caller's stays
