"""Block hash -> node row: an open-addressing hash table in flat arrays.

Why not a dict: a Python dict of 16-byte `bytes` keys to `int` rows costs
~120 bytes per block (key object, value object, table), more than half of the
index's metadata budget. This table costs the digest (padded to 8-byte words)
plus 12..24 bytes of cells per block, and a lookup resolves all of a prompt's
block hashes in one vectorised numpy pass instead of a dict probe each.

Layout:
- `columns[k][row]`: word k of the row's digest as a native u64 (the digest
  zero padded to whole words); word 0 is the probe key. Columns are separate
  contiguous arrays because numpy gathers from them several times faster
  than from a strided 2-d view.
- `cells`: `[buckets, BUCKET]` rows (-1 = empty, -2 = deleted); a digest's home
  bucket is `word0 & bucket_mask`, and a bucket without a free cell overflows into
  the next one (linear probing over buckets).
- `cell_of[row]`: the flat cell holding a mapped row (-1 when unmapped), so deleting
  rows costs no search and a batch of deletions is one vectorised store.

Invariants:
- buckets x BUCKET >= 3 x capacity, so the load is at most 1/3; a bucket
  overflows rarely and every probe sequence ends at a bucket with an empty cell.
- A mapped row sits in exactly one cell; no bucket from its home bucket up to
  (not including) the one holding it has an empty cell, so a search may stop at
  the first bucket with an empty cell. Deletion leaves a tombstone (-2), which
  keeps this true; inserts reuse tombstones, and when fewer than a third of the
  cells are empty the table is rebuilt from the mapped rows (at most once per
  `capacity` inserts, so deletion is O(1) amortised, independent of the table).
- A row is found only when its whole digest equals the query.

`_cells` and `_words` are `array.array`s viewed by numpy: scalar access
(insert, get) goes through the arrays (fast in Python), batches (get_many,
insert_many, delete_many, rebuild) through the numpy views.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

EMPTY = -1
DELETED = -2  # a tombstone: not empty for a search, free for an insert
BUCKET = 4  # cells per bucket: a bucket's bool row of 4 reads as one u32
_FULL_BUCKET = np.frombuffer(b"\x01" * BUCKET, dtype=np.uint32)[0]
_SCALAR_BATCH = 4  # batches up to this size insert one by one (cheaper than the numpy rounds)


class BlockMap:
    """Maps up to `capacity` distinct digests of `digest_size` bytes to rows in [0, capacity)."""

    def __init__(self, capacity: int, digest_size: int) -> None:
        self.capacity = capacity
        self.digest_size = digest_size
        self.word_count = -(-digest_size // 8)
        buckets = 1 << max(2, (-(-3 * capacity // BUCKET) - 1).bit_length())
        self.bucket_mask = buckets - 1
        self._cells = array.array("i", [EMPTY]) * (buckets * BUCKET)
        self._cell_of = array.array("i", [EMPTY]) * capacity
        self._words = array.array("Q", [0]) * (capacity * self.word_count)  # word k of row r: [k * capacity + r]
        self.cells = np.frombuffer(self._cells, dtype=np.int32).reshape(buckets, BUCKET)
        self.cell_of = np.frombuffer(self._cell_of, dtype=np.int32)
        self.columns = [
            np.frombuffer(self._words, dtype=np.uint64, count=capacity, offset=8 * k * capacity)
            for k in range(self.word_count)
        ]
        self._count = 0
        self._empty = buckets * BUCKET  # cells holding EMPTY
        self._min_empty = buckets * BUCKET // 3  # fewer: rebuild

    def __len__(self) -> int:
        return self._count

    def _split(self, digest: bytes) -> array.array[int]:
        words = array.array("Q")
        words.frombytes(digest.ljust(self.word_count * 8, b"\0"))
        return words

    def _words_of(self, row: int) -> array.array[int]:
        return array.array("Q", (self._words[k * self.capacity + row] for k in range(self.word_count)))

    def digest(self, row: int) -> bytes:
        return self._words_of(row).tobytes()[: self.digest_size]

    # -- scalar operations ------------------------------------------------------
    def _find(self, words: array.array[int]) -> int:
        """Flat cell holding the row of `words`, or -1 - (the first free cell on its probe path)."""
        cells, table, capacity = self._cells, self._words, self.capacity
        bucket = words[0] & self.bucket_mask
        free = -1
        while True:
            has_empty = False
            for cell in range(bucket * BUCKET, (bucket + 1) * BUCKET):
                row = cells[cell]
                if row < 0:
                    if free < 0:
                        free = cell
                    has_empty = has_empty or row == EMPTY
                elif table[row] == words[0] and all(
                    table[k * capacity + row] == words[k] for k in range(1, self.word_count)
                ):
                    return cell
            if has_empty:  # nothing on this path overflowed past a bucket with an empty cell
                return -1 - free
            bucket = (bucket + 1) & self.bucket_mask

    def get(self, digest: bytes) -> int | None:
        if len(digest) != self.digest_size:
            return None
        cell = self._find(self._split(digest))
        return self._cells[cell] if cell >= 0 else None

    def insert(self, digest: bytes, row: int) -> None:
        """Map `digest` to `row`; the digest must not be mapped yet."""
        if len(digest) != self.digest_size:
            raise ValueError(f"digest of {len(digest)} bytes, expected {self.digest_size}")
        words = self._split(digest)
        cell = self._find(words)
        if cell >= 0:
            raise KeyError("digest already mapped")
        for k in range(self.word_count):
            self._words[k * self.capacity + row] = words[k]
        self._place_one(-1 - cell, row)
        self._count += 1
        self._maybe_rebuild()

    def _place_one(self, cell: int, row: int) -> None:
        if self._cells[cell] == EMPTY:
            self._empty -= 1
        self._cells[cell] = row
        self._cell_of[row] = cell

    def delete(self, row: int) -> None:
        """Unmap `row` (its cell becomes a tombstone)."""
        cell = self._cell_of[row] if 0 <= row < self.capacity else EMPTY
        if cell < 0:
            raise KeyError(f"row {row} is not mapped")
        self._cells[cell] = DELETED
        self._cell_of[row] = EMPTY
        self._count -= 1

    # -- batch operations -----------------------------------------------------------
    def delete_many(self, rows: np.ndarray) -> None:
        """Unmap distinct mapped `rows` in one vectorised step; raises KeyError, changing nothing,
        if one is not mapped (or repeats)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return
        cells = self.cell_of[rows]
        ordered = np.sort(cells)
        if ordered[0] < 0 or (ordered[1:] == ordered[:-1]).any():
            raise KeyError("a row to delete is not mapped")
        self.cells.reshape(-1)[cells] = DELETED
        self.cell_of[rows] = EMPTY
        self._count -= len(rows)

    def insert_many(self, digests: Sequence[bytes], rows: list[int], found: np.ndarray | None = None) -> None:
        """Map `digests[i]` to `rows[i]`; raises KeyError, changing nothing, if a digest is mapped
        already or repeats in `digests` (ValueError for a digest of a foreign size).

        `found`: `get_many(digests)` as the caller just computed it (nothing changed since), which
        spares the second probe.
        """
        count = len(digests)
        if count <= _SCALAR_BATCH:
            for done, (digest, row) in enumerate(zip(digests, rows)):
                try:
                    self.insert(digest, row)
                except KeyError:
                    for inserted in rows[:done]:
                        self.delete(inserted)
                    raise
            return
        joined = b"".join(digests)
        if len(joined) != count * self.digest_size:
            raise ValueError(f"digests must be {self.digest_size} bytes each")
        if len(set(digests)) != count:
            raise KeyError("a digest repeats in the batch")
        if ((self.get_many(digests) if found is None else found) >= 0).any():
            raise KeyError("digest already mapped")
        query = self._query_words(joined, count)
        targets = np.asarray(rows, dtype=np.int64)
        for k in range(self.word_count):
            self.columns[k][targets] = query[:, k]
        self._place(targets, (query[:, 0] & np.uint64(self.bucket_mask)).astype(np.int64))
        self._count += count
        self._maybe_rebuild()

    def _place(self, rows: np.ndarray, buckets: np.ndarray) -> None:
        """Put unmapped `rows` into free cells, probing from `buckets` (vectorised rounds).

        Each round writes every waiting row into the first free cell of its bucket; where several
        rows chose one cell the last write stays and the others try again. A row moves on to the
        next bucket only when its bucket has no free cell left, so no bucket on a row's path before
        its own keeps an empty cell.
        """
        flat = self.cells.reshape(-1)
        while rows.size:
            free = self.cells[buckets] < 0
            room = free.any(axis=1)
            target = buckets * BUCKET + free.argmax(axis=1)
            waiting = rows[room]
            cells = target[room]
            before = flat[cells]
            flat[cells] = waiting
            placed = flat[cells] == waiting
            self._empty -= int(np.count_nonzero(before[placed] == EMPTY))
            self.cell_of[waiting[placed]] = cells[placed]
            rows = np.concatenate([waiting[~placed], rows[~room]])
            buckets = np.concatenate([buckets[room][~placed], (buckets[~room] + 1) & self.bucket_mask])

    def _maybe_rebuild(self) -> None:
        if self._empty < self._min_empty:
            self.rebuild()

    def rebuild(self) -> None:
        """Re-place every mapped row into a table without tombstones."""
        rows = np.flatnonzero(self.cell_of >= 0)
        self.cells.fill(EMPTY)
        self.cell_of.fill(EMPTY)
        self._empty = self.cells.size
        self._place(rows, (self.columns[0][rows] & np.uint64(self.bucket_mask)).astype(np.int64))

    def get_many(self, digests: Sequence[bytes]) -> np.ndarray:
        """Rows of `digests` (int64, -1 where unmapped).

        One vectorised pass over the home buckets resolves nearly every digest; the few whose
        home bucket has no empty cell without holding them (an entry that overflowed, or a miss)
        are finished by the scalar search, which is cheaper than another vectorised round.
        """
        count = len(digests)
        joined = b"".join(digests)
        if len(joined) != count * self.digest_size:  # a digest of a foreign size: never mapped
            return np.array([EMPTY if (r := self.get(d)) is None else r for d in digests], dtype=np.int64)
        query = self._query_words(joined, count)
        found = np.full(count, EMPTY, dtype=np.int64)
        rows = np.take(self.cells, (query[:, 0] & np.uint64(self.bucket_mask)).astype(np.intp), axis=0)
        occupied = rows >= 0
        candidates = np.flatnonzero(occupied & (np.take(self.columns[0], rows, mode="clip") == query[:, :1]))
        owners, candidate_rows = candidates // BUCKET, rows.reshape(-1)[candidates]
        # One word-0 match per digest, in order (owners == 0..count-1): the usual full hit.
        everyone = len(owners) == count and not (owners[1:] == owners[:-1]).any()
        for k in range(1, self.word_count):  # the rest of the digest, for word-0 matches only
            same = np.take(self.columns[k], candidate_rows) == (query[:, k] if everyone else query[owners, k])
            if not same.all():
                owners, candidate_rows, everyone = owners[same], candidate_rows[same], False
        if everyone:
            return candidate_rows.astype(np.int64)
        found[owners] = candidate_rows
        unresolved = (rows != EMPTY).view(np.uint32).reshape(-1) == _FULL_BUCKET
        unresolved[owners] = False
        for i in np.flatnonzero(unresolved).tolist():
            row = self.get(digests[i])
            if row is not None:
                found[i] = row
        return found

    def _query_words(self, joined: bytes, count: int) -> np.ndarray:
        width = self.word_count * 8
        if width == self.digest_size:
            return np.frombuffer(joined, dtype=np.uint64).reshape(count, self.word_count)
        padded = np.zeros((count, width), dtype=np.uint8)
        padded[:, : self.digest_size] = np.frombuffer(joined, dtype=np.uint8).reshape(count, self.digest_size)
        return padded.view(np.uint64)
