"""Block hash -> node row: an open-addressing hash table in flat arrays.

Why not a dict: a Python dict of 16-byte `bytes` keys to `int` rows costs
~120 bytes per block (key object, value object, table), more than half of the
index's metadata budget. This table costs the digest (padded to 8-byte words)
plus 16..28 bytes of cells per block. The arrays live here (numpy); searching and
placing are the compiled core's (`_core.HashTable`, prefixcache/_core.c), which
probes a whole prompt's hashes in one call, and unmaps a batch of rows (which needs
no search) in another.

Layout:
- `columns[k][row]` (rows of `words`): word k of the row's digest as a native u64
  (the digest zero padded to whole words); word 0 is the probe key.
- `cells`: `[buckets, BUCKET]` rows (-1 = empty, -2 = deleted); a digest's home
  bucket is `word0 & bucket_mask`, and a bucket without a free cell overflows into
  the next one (linear probing over buckets).
- `cell_of[row]`: the flat cell holding a mapped row (-1 when unmapped), so deleting
  rows costs no search (a batch of deletions is one O(n) pass of the core).

Invariants:
- buckets x BUCKET >= 3 x capacity, so the load is at most 1/3; a bucket
  overflows rarely and every probe sequence ends at a bucket with an empty cell.
- A mapped row sits in exactly one cell; no bucket from its home bucket up to
  (not including) the one holding it has an empty cell, so a search may stop at
  the first bucket with an empty cell. Deletion leaves a tombstone (-2), which
  keeps this true; inserts take the first free cell (tombstone or empty) on the
  path, and when fewer than a third of the cells are empty the table is rebuilt
  from the mapped rows (at most once per `capacity` inserts, so deletion is O(1)
  amortised, independent of the table).
- A row is found only when its whole digest equals the query.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .native import core

EMPTY = -1
DELETED = -2  # a tombstone: not empty for a search, free for an insert
BUCKET = 4  # cells per bucket (prefixcache/_core.c's BUCKET)


class BlockMap:
    """Maps up to `capacity` distinct digests of `digest_size` bytes to rows in [0, capacity)."""

    def __init__(self, capacity: int, digest_size: int) -> None:
        self.capacity = capacity
        self.digest_size = digest_size
        self.word_count = -(-digest_size // 8)
        buckets = 1 << max(2, (-(-3 * capacity // BUCKET) - 1).bit_length())
        self.bucket_mask = buckets - 1
        self.cells = np.full((buckets, BUCKET), EMPTY, dtype=np.int32)
        self.cell_of = np.full(capacity, EMPTY, dtype=np.int32)
        self.words = np.zeros((self.word_count, capacity), dtype=np.uint64)  # word k of row r: [k, r]
        self.columns = list(self.words)
        self.table = core.HashTable(self.cells, self.cell_of, self.words, digest_size)
        self._count = 0
        self._empty = buckets * BUCKET  # cells holding EMPTY
        self._min_empty = buckets * BUCKET // 3  # fewer: rebuild

    def __len__(self) -> int:
        return self._count

    def digest(self, row: int) -> bytes:
        return self.words[:, row].tobytes()[: self.digest_size]

    def get(self, digest: bytes) -> int | None:
        row = self.table.get(digest)
        return row if row >= 0 else None

    def get_many(self, digests: Sequence[bytes]) -> np.ndarray:
        """Rows of `digests` (int64, -1 where unmapped or of a foreign size)."""
        found = np.empty(len(digests), dtype=np.int64)
        self.table.get_many(digests, found)
        return found

    def insert(self, digest: bytes, row: int) -> None:
        """Map `digest` to `row`; the digest must not be mapped yet."""
        self.insert_many([digest], [row])

    def insert_many(self, digests: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> None:
        """Map `digests[i]` to unmapped `rows[i]`; raises KeyError, changing nothing, if a digest is
        mapped already or repeats in `digests` (ValueError for a digest of a foreign size)."""
        self._empty -= self.table.insert_many(
            digests, rows if isinstance(rows, list) else np.asarray(rows, dtype=np.int64)
        )
        self._count += len(digests)
        if self._empty < self._min_empty:
            self.rebuild()

    def insert_prefix(self, digests: Sequence[bytes], rows: list[int]) -> int:
        """Map `digests[i]` to unmapped `rows[i]` for the leading digests up to (not including) the
        first that is mapped already or repeats one before it; returns how many were mapped
        (ValueError, changing nothing, for a digest of a foreign size)."""
        inserted, used = self.table.insert_prefix(digests, rows)
        self._empty -= used
        self._count += inserted
        if self._empty < self._min_empty:
            self.rebuild()
        return inserted

    def delete(self, row: int) -> None:
        """Unmap `row` (its cell becomes a tombstone)."""
        cell = int(self.cell_of[row]) if 0 <= row < self.capacity else EMPTY
        if cell < 0:
            raise KeyError(f"row {row} is not mapped")
        self.cells.reshape(-1)[cell] = DELETED
        self.cell_of[row] = EMPTY
        self._count -= 1

    def delete_many(self, rows: np.ndarray) -> None:
        """Unmap distinct mapped `rows` (one call of the compiled core); raises KeyError, changing
        nothing, if one is not mapped (or repeats), ValueError if one is outside [0, capacity)."""
        rows = np.asarray(rows, dtype=np.int64)
        self.table.delete_many(rows)
        self._count -= len(rows)

    def rebuild(self) -> None:
        """Re-place every mapped row into a table without tombstones."""
        rows = np.flatnonzero(self.cell_of >= 0).astype(np.int64)
        self.cells.fill(EMPTY)
        self.cell_of.fill(EMPTY)
        self._empty = self.cells.size - self.table.place(rows)
