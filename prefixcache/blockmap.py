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
- `cells`: `[buckets, BUCKET]` rows (-1 = empty); a digest's home bucket is
  `word0 & bucket_mask`, and a full bucket overflows into the next one
  (linear probing over buckets).

Invariants:
- buckets x BUCKET >= 3 x capacity, so the load is at most 1/3; a bucket
  overflows rarely and every probe sequence ends at a bucket with an empty cell.
- A mapped row sits in exactly one cell; every bucket from its home bucket up
  to (not including) the one holding it is full. Deletion moves a later entry
  that overflowed past the emptied bucket back into it (no tombstones), which
  keeps this true; so a search may stop at the first bucket with an empty cell.
- A row is found only when its whole digest equals the query.

`_cells` and `_words` are `array.array`s viewed by numpy: scalar access
(insert, delete) goes through the arrays (fast in Python), batches through
the numpy views.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

EMPTY = -1
BUCKET = 4  # cells per bucket: a bucket's bool row of 4 reads as one u32
_FULL_BUCKET = np.frombuffer(b"\x01" * BUCKET, dtype=np.uint32)[0]


class BlockMap:
    """Maps up to `capacity` distinct digests of `digest_size` bytes to rows in [0, capacity)."""

    def __init__(self, capacity: int, digest_size: int) -> None:
        self.capacity = capacity
        self.digest_size = digest_size
        self.word_count = -(-digest_size // 8)
        buckets = 1 << max(2, (-(-3 * capacity // BUCKET) - 1).bit_length())
        self.bucket_mask = buckets - 1
        self._cells = array.array("i", [EMPTY]) * (buckets * BUCKET)
        self._words = array.array("Q", [0]) * (capacity * self.word_count)  # word k of row r: [k * capacity + r]
        self.cells = np.frombuffer(self._cells, dtype=np.int32).reshape(buckets, BUCKET)
        self.columns = [np.frombuffer(self._words, dtype=np.uint64, count=capacity, offset=8 * k * capacity)
                        for k in range(self.word_count)]
        self._count = 0

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
        """Flat cell holding the row of `words`, or -1 - (the cell where it would be inserted)."""
        cells, table, capacity = self._cells, self._words, self.capacity
        bucket = words[0] & self.bucket_mask
        while True:
            empty = -1
            for cell in range(bucket * BUCKET, (bucket + 1) * BUCKET):
                row = cells[cell]
                if row == EMPTY:
                    if empty < 0:
                        empty = cell
                elif table[row] == words[0] and all(
                        table[k * capacity + row] == words[k] for k in range(1, self.word_count)):
                    return cell
            if empty >= 0:  # earlier buckets on the path are full, so this is the first free cell
                return -1 - empty
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
        self._cells[-1 - cell] = row
        self._count += 1

    def delete(self, row: int) -> None:
        """Unmap `row`, then refill its bucket from entries that overflowed past it."""
        hole = self._find(self._words_of(row))
        if hole < 0 or self._cells[hole] != row:
            raise KeyError(f"row {row} is not mapped")
        cells, table, mask = self._cells, self._words, self.bucket_mask
        cells[hole] = EMPTY
        bucket = hole // BUCKET
        while True:
            bucket = (bucket + 1) & mask
            has_empty, moved = False, False
            for cell in range(bucket * BUCKET, (bucket + 1) * BUCKET):
                entry = cells[cell]
                if entry == EMPTY:
                    has_empty = True
                    continue
                home = table[entry] & mask
                # It may fill the hole unless its home lies cyclically in (hole's bucket, bucket].
                if (bucket - home) & mask >= (bucket - hole // BUCKET) & mask:
                    cells[hole], cells[cell] = entry, EMPTY
                    hole, moved = cell, True
                    break
            if has_empty and not moved:
                break  # nothing beyond a bucket with room ever overflowed past it
        self._count -= 1

    # -- batch lookup -------------------------------------------------------------
    def get_many(self, digests: Sequence[bytes]) -> np.ndarray:
        """Rows of `digests` (int64, -1 where unmapped).

        One vectorised pass over the home buckets resolves nearly every digest; the few whose
        home bucket is full without holding them (an entry that overflowed, or a miss) are
        finished by the scalar search, which is cheaper than another vectorised round.
        """
        count = len(digests)
        joined = b"".join(digests)
        if len(joined) != count * self.digest_size:  # a digest of a foreign size: never mapped
            return np.array([EMPTY if (r := self.get(d)) is None else r for d in digests], dtype=np.int64)
        query = self._query_words(joined, count)
        found = np.full(count, EMPTY, dtype=np.int64)
        rows = np.take(self.cells, (query[:, 0] & np.uint64(self.bucket_mask)).astype(np.intp), axis=0)
        occupied = rows >= 0
        candidates = np.flatnonzero(occupied & (np.take(self.columns[0], rows) == query[:, :1]))
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
        unresolved = occupied.view(np.uint32).reshape(-1) == _FULL_BUCKET
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
