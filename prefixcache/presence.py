"""Which blocks a Lookup can hit, published in shared memory for same-host engines to read.

An engine's scheduler asks the service about every new prompt, and most answers add nothing to
what the engine's own prefix cache has: a request whose next block no one has stored cannot hit.
The service therefore keeps a table of its blocks' fingerprints in a shared-memory segment beside
its host tier; a same-host engine maps it read-only and skips the Lookup (and any wait for it)
when the block after its own prefix is not there (integrations/vllm/scheduler.py). Every
namespace's blocks share the one table; a salted prompt hashes from its salt's root, which a view
derives from the attached namespace's encoding around the salt (hashing.py `salt_gap`).

A fingerprint is the first 8 bytes of a block's chained hash (prefixcache/hashing.py) as a native
u64 (the block map's probe word: `BlockMap.words[0]`), with 0 reserved for an empty cell. A table
is `buckets` rows of `WAYS` cells; a fingerprint lives in row `fp & (buckets - 1)`. A segment holds
two: the index's cells, and, for a service with a Redis tier, the remote cells (blocks Redis
holds, whoever wrote them: tiers/redis_presence.py). Segment layout: a 64-byte header (`MAGIC`,
ways, the remote state word, buckets, remote buckets, the writer's heartbeat), the index's
cells, the remote cells.

Invariants:
- The table is advice, never the answer: an engine that finds a block here still gets it only
  through a Lookup, which verifies tokens. A stale or torn read costs a Lookup (a block that is
  gone) or a hit (a block just stored), never wrong KV.
- The index's cells: the writer (the index, under the cache lock) adds a fingerprint when a block
  is indexed and clears it when the block leaves the index; the index's blocks are exactly the
  table's, except a block displaced from a full row (one of `WAYS` in a row of a table at most a
  quarter full: rare), which reads as absent until it is stored again.
- The remote cells are read only while the state word says `REMOTE_LIVE`: their writer (one
  thread, the Redis feed) sets it once it has followed every write since its last (re)connect,
  and clears it whenever it may have missed one; a view then answers None (look the prompt up).
  A remote cell holds its block until the TTL Redis was given for it ends (a key Redis evicts
  sooner costs a Lookup that misses).
- A table its service no longer keeps reads as None: a service killed or restarted leaves its
  engines' old mapping frozen, and its blocks are not those the new service holds; the engine's
  Lookup then fails and its re-attach maps the new table. A view tells by two checks on each
  read: the segment's name still names the segment it mapped (a restarted service, or anyone
  clearing a dead one's, removes or replaces it: a stat, ~2 µs), and the writer beat within
  `STALE_S` (it beats CLOCK_MONOTONIC, which every process on the host shares unless given a time
  namespace of its own, every `BEAT_S`, and zeroes it when it closes: a hung or killed service
  whose name no one removed).
- With a disk tier a Lookup also finds spilled blocks the table does not follow: no table is
  published, and engines look up every prompt.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from .config import validate_salt
from .errors import ConfigError
from .hashing import BlockHash, Hasher, Tokens, token_array
from .tiers.shm import SHM_DIR

MAGIC = b"pfxheld\x02"
MAGIC_V1 = b"pfxheld\x01"  # an older service's segment: the index's cells only (read still)
WAYS = 8  # cells per row
HEADER_BYTES = 64
SALTED_ROOTS = 4096  # salts whose roots a view keeps (a salt is typically one user's, reused turn after turn)
PRESENCE_BLOCKS = 1 << 18  # Redis blocks the remote cells follow by default (8 MiB of shared memory)
REMOTE_LIVE = 1  # the state word while the remote cells follow every Redis write
BEAT_S = 0.25  # the writer's heartbeat ...
STALE_S = 2.0  # ... and how old it may be before readers stop trusting the table
_HEADER = struct.Struct("<8sIIQQQ")  # magic, ways, remote state, buckets, remote buckets, heartbeat ns
_STATE_OFFSET, _BEAT_OFFSET = 12, 32
_STALE_NS = int(STALE_S * 1e9)
_NO_FPS = np.empty(0, dtype=np.uint64)
_ONE = np.uint64(1)


def buckets_for(capacity: int) -> int:
    """Rows for `capacity` blocks: a power of two, the table at most a quarter full (0 for none)."""
    return 1 << max(0, (-(-4 * capacity // WAYS) - 1).bit_length()) if capacity > 0 else 0


def table_bytes(capacity: int, remote_capacity: int = 0) -> int:
    return HEADER_BYTES + (buckets_for(capacity) + buckets_for(remote_capacity)) * WAYS * 8


def fingerprints(hashes: Sequence[bytes]) -> np.ndarray:
    """The fingerprints of block hashes (their first 8 bytes as native u64; 0 reads as 1)."""
    if not hashes:
        return _NO_FPS
    return np.maximum(np.frombuffer(b"".join([h[:8] for h in hashes]), dtype=np.uint64), _ONE)


class FingerprintCells:
    """One table of fingerprints over `cells` (rows x WAYS u64, a power-of-two count of rows)."""

    def __init__(self, cells: np.ndarray) -> None:
        self.cells = cells
        self.mask = np.uint64(max(len(cells), 1) - 1)

    def holds(self, fps: np.ndarray) -> np.ndarray:
        """Which of `fps` (nonzero) the table holds."""
        held: np.ndarray = (self.cells[fps & self.mask] == fps[:, None]).any(axis=1)
        return held

    def add(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Place `fps` (nonzero): each into the first empty cell of its row, or over the cell its top
        bits choose when the row is full (that block then reads as absent). Where each now lies,
        (rows, ways), and which of them were there already."""
        rows = fps & self.mask
        ordered = np.sort(rows)
        if not (ordered[1:] == ordered[:-1]).any():  # one block per row, the usual case: one vectorised pass
            return (rows, *self._place(rows, fps))
        _, first = np.unique(rows, return_index=True)
        alone = np.zeros(len(rows), dtype=bool)
        alone[first] = True
        ways, found = self._place(rows[alone], fps[alone])
        parts = [(rows[alone], ways, found)]
        for row, fp in zip(rows[~alone].tolist(), fps[~alone].tolist(), strict=True):  # rare: share a row
            one = np.array([row], dtype=np.uint64)
            parts.append((one, *self._place(one, np.array([fp], dtype=np.uint64))))
        all_rows, all_ways, all_found = (np.concatenate(column) for column in zip(*parts, strict=True))
        return all_rows, all_ways, all_found

    def _place(self, rows: np.ndarray, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`add` for fingerprints of distinct rows: (ways, found)."""
        cells = self.cells[rows]
        match = cells == fps[:, None]
        found = match.any(axis=1)
        empty = cells == 0
        way = np.where(
            found,
            match.argmax(axis=1),
            np.where(empty.any(axis=1), empty.argmax(axis=1), (fps >> np.uint64(61)).astype(np.int64) % WAYS),
        )
        new = ~found
        self.cells[rows[new], way[new]] = fps[new]
        return way, found

    def discard(self, fps: np.ndarray) -> None:
        """Forget `fps` (nonzero; absent ones are skipped)."""
        rows = fps & self.mask
        which, way = np.nonzero(self.cells[rows] == fps[:, None])
        self.cells[rows[which], way] = 0


class RemoteHeld:
    """The remote cells' writer (one thread: the Redis feed): blocks Redis holds, each until its
    TTL ends by `clock`, and the state word that says whether readers may trust them."""

    def __init__(self, cells: np.ndarray, state: np.ndarray, clock: Callable[[], float] = time.monotonic) -> None:
        self._cells = FingerprintCells(cells)
        self._state = state
        self._until = np.zeros(cells.shape, dtype=np.float64)
        self.clock = clock

    @property
    def capacity(self) -> int:
        """Blocks the cells hold at a quarter full (buckets_for's sizing)."""
        return self._cells.cells.size // 4

    def add(self, fps: np.ndarray, ttl_s: float) -> None:
        """Blocks Redis holds for `ttl_s` from now, by fingerprint; a block already held keeps the
        later of its two ends (a TTL only ever lengthens: tiers/redis.py)."""
        fps = _nonzero(fps)
        if not fps.size:
            return
        rows, ways, found = self._cells.add(fps)
        until = self.clock() + ttl_s
        self._until[rows, ways] = np.where(found, np.maximum(self._until[rows, ways], until), until)

    def sweep(self) -> int:
        """Forget the blocks whose TTL has ended; how many."""
        expired = (self._until < self.clock()) & (self._cells.cells != 0)
        count = int(np.count_nonzero(expired))
        if count:
            self._cells.cells[expired] = 0
        return count

    def held(self) -> int:
        return int(np.count_nonzero(self._cells.cells))

    def set_live(self, live: bool) -> None:
        """Readers trust the cells (`live`: every write since the last reconnect was followed) or not."""
        self._state[0] = REMOTE_LIVE if live else 0

    @property
    def live(self) -> bool:
        return bool(self._state[0] == REMOTE_LIVE)

    def release(self) -> None:
        self._cells = FingerprintCells(np.zeros((0, WAYS), dtype=np.uint64))
        self._until = np.zeros((0, WAYS), dtype=np.float64)
        self._state = np.zeros(1, dtype=np.uint32)


class PresenceTable:
    """The writer: a segment over `buf` (zeroed memory of `table_bytes(capacity, remote_capacity)`
    bytes): the index's cells (`add`, `discard`: the index calls them) and, where
    `remote_capacity`, the remote cells (`remote`: the Redis feed writes them)."""

    def __init__(self, buf: memoryview, capacity: int, remote_capacity: int = 0) -> None:
        buckets, remote_buckets = buckets_for(capacity), buckets_for(remote_capacity)
        if len(buf) < table_bytes(capacity, remote_capacity):
            raise ValueError(f"{len(buf)} bytes cannot hold a presence table for {capacity} blocks")
        header = _HEADER.pack(MAGIC, WAYS, 0, buckets, remote_buckets, time.monotonic_ns())
        buf[:HEADER_BYTES] = header.ljust(HEADER_BYTES, b"\0")
        words = np.frombuffer(buf, dtype=np.uint64, count=(buckets + remote_buckets) * WAYS, offset=HEADER_BYTES)
        words[:] = 0
        cells = words.reshape(-1, WAYS)
        self._index = FingerprintCells(cells[:buckets])
        state = np.frombuffer(buf, dtype=np.uint32, count=1, offset=_STATE_OFFSET)
        self.remote = RemoteHeld(cells[buckets:], state) if remote_buckets else None
        self._beat = np.frombuffer(buf, dtype=np.uint64, count=1, offset=_BEAT_OFFSET)
        self._stop_beating = threading.Event()
        self._beater: threading.Thread | None = None

    def beat_every(self, seconds: float = BEAT_S) -> None:
        """Keep the heartbeat fresh from a daemon thread until `stop_beating`."""

        def run() -> None:
            while not self._stop_beating.wait(seconds):
                self._beat[0] = time.monotonic_ns()

        self._beat[0] = time.monotonic_ns()
        self._beater = threading.Thread(target=run, name="prefixcache-presence-beat", daemon=True)
        self._beater.start()

    def stop_beating(self) -> None:
        """Tell readers the table is no longer kept (they read None from now on)."""
        self._stop_beating.set()
        if self._beater is not None:
            self._beater.join()
            self._beater = None
        self._beat[0] = 0

    @property
    def cells(self) -> np.ndarray:
        """The index's cells."""
        return self._index.cells

    @property
    def mask(self) -> np.uint64:
        return self._index.mask

    def add(self, words: np.ndarray) -> None:
        """Record indexed blocks by their probe words (`BlockMap.words[0]` of their rows)."""
        fps = _nonzero(words)
        if fps.size:
            self._index.add(fps)

    def discard(self, words: np.ndarray) -> None:
        """Forget blocks that left the index, by their probe words (absent ones are skipped)."""
        fps = _nonzero(words)
        if fps.size:
            self._index.discard(fps)

    def release(self) -> None:
        """Drop the views of the segment (before its owner unmaps it); the table is empty after."""
        self.stop_beating()
        self._beat = np.zeros(1, dtype=np.uint64)
        self._index = FingerprintCells(np.zeros((0, WAYS), dtype=np.uint64))
        if self.remote is not None:
            self.remote.release()


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
        self._path = SHM_DIR / segment_name.lstrip("/")
        try:
            stat = os.fstat(fd)
            size, self._identity = stat.st_size, (stat.st_dev, stat.st_ino)
            if size < HEADER_BYTES:
                raise ConfigError("presence", f"shared memory {segment_name!r} is too short for a presence table")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, ways, _, buckets, remote_buckets, _ = _HEADER.unpack_from(self._map, 0)
        if magic == MAGIC_V1:
            remote_buckets = 0  # its later header words were not there: zero
        if (
            magic not in (MAGIC, MAGIC_V1)
            or ways != WAYS
            or not buckets
            or buckets & (buckets - 1)
            or remote_buckets & (remote_buckets - 1)
            or HEADER_BYTES + (buckets + remote_buckets) * WAYS * 8 > size
        ):
            self._map.close()
            raise ConfigError("presence", f"shared memory {segment_name!r} is not a presence table this version reads")
        cells = np.frombuffer(
            self._map, dtype=np.uint64, count=(buckets + remote_buckets) * WAYS, offset=HEADER_BYTES
        ).reshape(-1, WAYS)
        self._index = FingerprintCells(cells[:buckets])
        self._remote = FingerprintCells(cells[buckets:]) if remote_buckets else None
        self._state = np.frombuffer(self._map, dtype=np.uint32, count=1, offset=_STATE_OFFSET)
        self._beat = np.frombuffer(self._map, dtype=np.uint64, count=1, offset=_BEAT_OFFSET) if magic == MAGIC else None

    @property
    def cells(self) -> np.ndarray:
        """The index's cells."""
        return self._index.cells

    def held_tokens(self, tokens: Tokens, salt: str | None = None) -> int | None:
        """How many leading tokens of `tokens` (salted `salt`) the table holds, in whole blocks;
        None when it cannot say: a salt it cannot hash (no `salt_gap`, or not a valid salt: the
        Lookup says why), remote cells not live (their feed is catching up), or a table its
        service no longer keeps (closed, killed, hung)."""
        root = self.root if salt is None else self._salted_root(salt)
        if root is None or not self.kept():
            return None
        fps = fingerprints(self.hasher.block_hashes(root, token_array(tokens), self.block_size))
        if not fps.size:
            return 0
        present = self._index.holds(fps)
        if self._remote is not None:
            if self._state[0] != REMOTE_LIVE:
                return None
            present |= self._remote.holds(fps)
        return (len(present) if present.all() else int(present.argmin())) * self.block_size

    def kept(self) -> bool:
        """Whether the service still keeps the table: it beat within STALE_S (a v1 table does not
        beat), and its name still names this segment."""
        if self._beat is not None:
            beat = int(self._beat[0])
            if beat == 0 or time.monotonic_ns() - beat > _STALE_NS:
                return False
        try:
            stat = os.stat(self._path)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self._identity

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
