"""Disk tier: checked frames (codec.py) in a few large preallocated files, under the host tier.

Keyed like the Redis tier, by (namespace id, block hash), and holding the same frames, so a block
read back is verified exactly like a Redis one (header, tokens, checksum): a torn write, a flipped
bit or a block from another layout is an integrity miss, never wrong KV.

Layout (the arena/chunk design of tiers/arena.py, on disk): `capacity_bytes` is cut into files of
at most `file_bytes`, all preallocated at start (`posix_fallocate`: a full disk shows at start,
never mid-write), each cut into chunks of `chunk_bytes`. A chunk serves one slot size at a time
(a frame's length rounded up to 4 KiB) and starts with its table (TABLE_BYTES): a header (magic,
version, slot size) and one 32-byte record per slot (key digest, namespace digest, frame length,
write time). A write puts the frame in its slot, then the slot's record: at restart the index is
rebuilt from the tables alone (one read per chunk), and a write torn by a kill leaves a record
naming a frame that fails verification, i.e. a miss.

Threads: `submit` never blocks (a bounded queue; full: the write is dropped and counted); a small
pool of writer threads pwrites. `fetch` preads from the caller's thread, in parallel on the same
pool's sibling reader pool. The tier's own lock guards its index; I/O runs outside it, and a slot
being read is never reused until the read is over.

Eviction: least recently used first (a hit touches a path's blocks leaf to root, so the leaves of
a path go before its root, as in the slot tiers), and entries older than `ttl_s` since their last
use are misses that free their slot. Admission after reuse: a key is written the `admit_after`-th
time it is offered (default 2: the second eviction from the host tier), to spare SSD writes nobody
reads back.

Never slower: the tier times its reads (`TransferMeter`: latency + bytes / bandwidth, the reads
of one fetch running in parallel on its pool), and a lookup that says what recomputing costs its
worker (a `ProbeBudget`) reads only the blocks it expects to read faster than that; the rest are
misses (`reads_declined`), so a slow or throttled disk costs a recompute, never a slower hit.

Pins (pin_book.py): the blocks of operator pins are written here as they are pinned (no
admission wait) and kept out of LRU and TTL eviction, namespace evictions and `flush` while the
pin book in the same directory lists them; the book is read back at start (`kept_pins`).

Fail-open: an OSError in any I/O (ENOSPC, EIO, EROFS), or the directory gone or replaced, turns
the tier off with one log line; it then answers misses and drops writes, and `stats().up` is 0.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from .. import pin_book
from ..config import parse_duration, parse_size
from ..errors import ConfigError
from ..pin_book import PinRecord
from ..transfer import ProbeBudget, TransferEstimate, TransferMeter

log = logging.getLogger(__name__)

PAGE = 4096
TABLE_BYTES = 64 << 10  # a chunk's header and slot records
_HEADER = struct.Struct("<8sII")  # magic, version, slot bytes
_RECORD = struct.Struct("<16s8sII")  # key digest, namespace digest, frame length, write time (s)
MAGIC = b"PFXDISK1"
VERSION = 1
MAX_SLOTS_PER_CHUNK = (TABLE_BYTES - PAGE) // _RECORD.size  # records after the first page
FILE_PREFIX = "prefixcache-disk-"
ADMISSION_MEMORY = 1 << 20  # keys remembered for admission (oldest forgotten first)
# What a read is expected to cost until reads are timed: a local NVMe drive's order (the first
# read then measures the real one, and a slow disk is followed at once: see READ_CLIP).
READ_PRIOR = TransferEstimate(latency_s=2e-4, bytes_per_s=1e9)
READ_CLIP = 16.0  # one read counts as at most this much slower than expected (a preempted thread)


@dataclass(frozen=True)
class DiskOptions:
    """Where and how big; sizes as bytes or strings like "10GiB", durations like "1h"."""

    directory: str
    capacity_bytes: int | str
    file_bytes: int | str = 1 << 30
    chunk_bytes: int | str = 64 << 20
    ttl_s: float | str = 24 * 3600.0
    admit_after: int = 2
    io_threads: int = 4
    queue_depth: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ConfigError("disk_dir", "must name a directory")
        for name in ("capacity_bytes", "file_bytes", "chunk_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), f"disk_{name}"))
        object.__setattr__(self, "ttl_s", parse_duration(self.ttl_s, "disk_ttl"))
        chunk = int(self.chunk_bytes)
        if chunk < TABLE_BYTES + PAGE or chunk % PAGE:
            raise ConfigError("disk_chunk_bytes", f"must be a multiple of {PAGE} and more than {TABLE_BYTES + PAGE}")
        if int(self.file_bytes) < chunk:
            raise ConfigError("disk_file_bytes", f"must hold at least one chunk ({chunk} bytes)")
        if int(self.capacity_bytes) < chunk:
            raise ConfigError("disk_capacity", f"must hold at least one chunk ({chunk} bytes)")
        for name, low in (("admit_after", 1), ("io_threads", 1), ("queue_depth", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"disk_{name}", f"must be an integer >= {low}, got {value!r}")


@dataclass
class DiskStats:
    """The tier's figures (GetStats' `disk` map, Prometheus `prefixcache_disk_*`)."""

    up: int = 1
    capacity_bytes: int = 0
    used_bytes: int = 0  # frame bytes held
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    admitted: int = 0  # writes queued
    rejected: int = 0  # offers before reuse (admission policy)
    dropped: int = 0  # writes dropped: queue full, no room, or the tier off
    evictions_lru: int = 0
    evictions_ttl: int = 0
    integrity_failures: int = 0
    io_errors: int = 0
    restored_blocks: int = 0
    restore_s: float = 0.0
    reads_declined: int = 0  # blocks held but not read: expected slower than recomputing them
    read_latency_s: float = 0.0  # the reads' estimated latency ...
    read_bytes_per_s: float = 0.0  # ... and bandwidth (0: not measured yet)
    pinned_blocks: int = 0  # blocks the pin book keeps (never evicted while it does)


@dataclass
class _Chunk:
    file: int
    offset: int  # of the chunk in its file
    slot_bytes: int = 0  # 0: serves no slot size yet
    keys: list[bytes | None] = field(default_factory=list)  # per slot
    free: list[int] = field(default_factory=list)
    used: int = 0  # slots held or reserved


@dataclass
class _Entry:
    chunk: int
    slot: int
    length: int
    ns: bytes
    used: float  # wall-clock time of the last write or hit
    readers: int = 0


def block_key(namespace_id: str, block_hash: bytes) -> bytes:
    """The tier's key of a block (a collision can only cost a miss: the frame binds the real key)."""
    return xxhash.xxh3_128_digest(namespace_id.encode("utf-8") + b"\0" + bytes(block_hash))


def _ns_digest(namespace_id: str) -> bytes:
    return xxhash.xxh3_64_digest(namespace_id.encode("utf-8"))


class DiskTier:
    """See the module docstring. `clock` is wall time (it is stored, and must survive a restart)."""

    def __init__(self, options: DiskOptions, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self.clock = clock
        self._lock = threading.Lock()
        self._stats = DiskStats(capacity_bytes=int(options.capacity_bytes))
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._offers: OrderedDict[bytes, int] = OrderedDict()  # admission: times offered
        self._writing: set[bytes] = set()  # keys being written (a second offer is not written twice)
        self._kept: frozenset[bytes] = frozenset()  # keys of pinned blocks: never evicted (keep_pins)
        self._book: list[PinRecord] = []  # the pin book as read at start
        self._reads = TransferMeter(READ_PRIOR, clip=READ_CLIP)  # under `_lock`
        self._chunks: list[_Chunk] = []
        self._fds: list[int] = []
        self._up = False
        self._dir_id: tuple[int, int] | None = None
        self._queue: queue.Queue[tuple[bytes, bytes, bytes] | None] = queue.Queue(options.queue_depth)
        self._pending = 0  # writes queued or running
        self._idle = threading.Condition(self._lock)
        self._readers = ThreadPoolExecutor(options.io_threads, thread_name_prefix="disk-read")
        self._writers: list[threading.Thread] = []
        try:
            self._open()
            self._up = True
        except OSError as error:
            self._fail(error, "opening")
        if self._up:
            self._read_pins()
        for i in range(options.io_threads if self._up else 0):
            thread = threading.Thread(target=self._write_loop, name=f"disk-write-{i}", daemon=True)
            thread.start()
            self._writers.append(thread)

    # -- files --------------------------------------------------------------------
    def _open(self) -> None:
        opts = self.options
        chunk, file_bytes = int(opts.chunk_bytes), int(opts.file_bytes)
        chunks_total = int(opts.capacity_bytes) // chunk
        per_file = file_bytes // chunk
        os.makedirs(opts.directory, exist_ok=True)
        st = os.stat(opts.directory)
        self._dir_id = (st.st_dev, st.st_ino)
        started = time.perf_counter()
        n_files = -(-chunks_total // per_file)
        for i in range(n_files):
            size = min(per_file, chunks_total - i * per_file) * chunk
            path = os.path.join(opts.directory, f"{FILE_PREFIX}{i:04d}.dat")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self._fds.append(fd)
            if os.fstat(fd).st_size != size:  # new, or of another sizing: its tables are not ours
                os.ftruncate(fd, 0)
            os.posix_fallocate(fd, 0, size)  # the whole budget now: ENOSPC here, not mid-write
            for c in range(size // chunk):
                self._chunks.append(_Chunk(i, c * chunk))
        self._restore()
        self._stats.restore_s = time.perf_counter() - started
        log.info(
            "disk tier: %d bytes in %d files under %s; %d blocks restored in %.3f s",
            chunks_total * chunk,
            n_files,
            opts.directory,
            self._stats.restored_blocks,
            self._stats.restore_s,
        )

    def _restore(self) -> None:
        """Rebuild the index from the chunks' tables (one read each); anything else is a free chunk."""
        found: list[tuple[int, bytes, _Entry]] = []
        for c, ch in enumerate(self._chunks):
            table = os.pread(self._fds[ch.file], TABLE_BYTES, ch.offset)
            if len(table) < TABLE_BYTES:
                continue
            magic, version, slot_bytes = _HEADER.unpack_from(table)
            if magic != MAGIC or version != VERSION or not self._fits(slot_bytes):
                continue
            self._assign(c, slot_bytes)
            ch.free.clear()
            for s in range(len(ch.keys)):
                key, ns, length, stamp = _RECORD.unpack_from(table, PAGE + s * _RECORD.size)
                if 0 < length <= slot_bytes and key not in self._entries:
                    entry = _Entry(c, s, length, ns, float(stamp))
                    self._entries[key] = entry
                    ch.keys[s] = key
                    ch.used += 1
                    found.append((stamp, key, entry))
                else:
                    ch.free.append(s)
            ch.free.reverse()
        found.sort(key=lambda item: item[0])  # least recently written first
        self._entries = OrderedDict((key, entry) for _, key, entry in found)
        self._stats.restored_blocks = len(found)
        self._stats.blocks = len(found)
        self._stats.used_bytes = sum(e.length for e in self._entries.values())

    def _fits(self, slot_bytes: int) -> bool:
        return slot_bytes > 0 and slot_bytes % PAGE == 0 and slot_bytes <= int(self.options.chunk_bytes) - TABLE_BYTES

    def _assign(self, c: int, slot_bytes: int) -> None:
        per_chunk = min((int(self.options.chunk_bytes) - TABLE_BYTES) // slot_bytes, MAX_SLOTS_PER_CHUNK)
        ch = self._chunks[c]
        ch.slot_bytes = slot_bytes
        ch.keys = [None] * per_chunk
        ch.free = list(range(per_chunk - 1, -1, -1))
        ch.used = 0

    # -- pins ------------------------------------------------------------------------
    @property
    def pin_book_path(self) -> str:
        return os.path.join(self.options.directory, pin_book.FILE_NAME)

    def _read_pins(self) -> None:
        """The pin book left by the last run: its live pins' blocks are kept from now on."""
        try:
            records = pin_book.read(self.pin_book_path)
        except (OSError, ValueError) as error:  # (UnicodeDecodeError and JSON errors are ValueErrors)
            aside = f"{self.pin_book_path}.unreadable"
            log.error(
                "disk tier: pin book %s unreadable (%s); no pin restored, moved to %s", self.pin_book_path, error, aside
            )
            with contextlib.suppress(OSError):
                os.replace(self.pin_book_path, aside)
            return
        now = self.clock()
        self._book = [r for r in records if r.live(now)]
        self._set_kept(self._book)
        if self._book:
            log.info("disk tier: %d pin(s) to restore as their namespaces attach", len(self._book))

    def kept_pins(self) -> list[PinRecord]:
        """The pins the book held at start, still live then (PrefixCache restores them)."""
        return list(self._book)

    def keep_pins(self, records: list[PinRecord]) -> None:
        """Make `records` the pin book: their blocks are kept from eviction from now on, others
        no longer; written to the directory (a failure turns the tier off, as any I/O error)."""
        self._set_kept(records)
        if not self._up:
            return
        try:
            self._check_dir()
            pin_book.write(self.pin_book_path, records)
        except OSError as error:
            self._fail(error, "writing the pin book")

    def _set_kept(self, records: list[PinRecord]) -> None:
        kept = frozenset(block_key(r.namespace_id, h) for r in records for h in r.block_hashes)
        with self._lock:
            self._kept = kept
            self._stats.pinned_blocks = sum(1 for key in kept if key in self._entries)

    def held_run(self, namespace_id: str, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, the tier holds unexpired (no touch, no count)."""
        if not self._up:
            return 0
        now, ttl = self.clock(), float(self.options.ttl_s)
        with self._lock:
            for held, block_hash in enumerate(hashes):
                key = block_key(namespace_id, block_hash)
                entry = self._entries.get(key)
                if entry is None or (now - entry.used > ttl and key not in self._kept):
                    return held
            return len(hashes)

    def holds(self, namespace_id: str, block_hash: bytes) -> bool:
        with self._lock:
            return block_key(namespace_id, block_hash) in self._entries

    def write_now(self, namespace_id: str, block_hash: bytes, frame: bytes) -> None:
        """Write a pinned block from the caller's thread (no admission, no queue to drop it)."""
        if self._up:
            self._write(block_key(namespace_id, block_hash), _ns_digest(namespace_id), frame)

    # -- writing -------------------------------------------------------------------
    def offer(self, namespace_id: str, block_hash: bytes) -> bool:
        """Whether a block leaving the host tier should be written now (admission after reuse):
        False when the tier is off, already holds it (touched instead), or has not seen it
        `admit_after` times yet. Cheap: called under the cache lock before a frame is made."""
        if not self._up:
            return False
        key = block_key(namespace_id, block_hash)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.used = self.clock()
                self._entries.move_to_end(key)
                return False
            seen = self._offers.pop(key, 0) + 1
            if seen < self.options.admit_after:
                self._offers[key] = seen
                if len(self._offers) > ADMISSION_MEMORY:
                    self._offers.popitem(last=False)
                self._stats.rejected += 1
                return False
            return True

    def submit(self, namespace_id: str, block_hash: bytes, frame: bytes) -> bool:
        """Queue an owned frame for writing; never blocks. False when it was dropped."""
        if not self._up:
            return False
        key = block_key(namespace_id, block_hash)
        with self._lock:
            self._pending += 1
        try:
            self._queue.put_nowait((key, _ns_digest(namespace_id), frame))
        except queue.Full:
            with self._lock:
                self._pending -= 1
                self._stats.dropped += 1
            return False
        with self._lock:
            self._stats.admitted += 1
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._up:
                    self._write(*item)
                else:
                    with self._lock:
                        self._stats.dropped += 1
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()

    def _write(self, key: bytes, ns: bytes, frame: bytes) -> None:
        slot_bytes = -(-len(frame) // PAGE) * PAGE
        if not self._fits(slot_bytes):
            with self._lock:
                self._stats.dropped += 1
            return
        with self._lock:
            if key in self._entries or key in self._writing:
                return
            place = self._take_slot(slot_bytes)
            if place is None:
                self._stats.dropped += 1
                return
            c, s, fresh = place
            ch = self._chunks[c]
            ch.keys[s] = key  # reserved: not free, not yet readable (no entry)
            ch.used += 1
            fd, base = self._fds[ch.file], ch.offset
            if fresh:
                # Header and cleared records, before any writer can put a record there (hence
                # under the lock, once per chunk): none of another slot size survives a restart.
                try:
                    os.pwrite(fd, _HEADER.pack(MAGIC, VERSION, slot_bytes).ljust(TABLE_BYTES, b"\0"), base)
                except OSError as error:
                    self._up_off(error, "writing")
                    return
            self._writing.add(key)
        try:
            self._check_dir()
            os.pwrite(fd, frame, base + TABLE_BYTES + s * slot_bytes)
            stamp = int(self.clock())
            os.pwrite(fd, _RECORD.pack(key, ns, len(frame), stamp), base + PAGE + s * _RECORD.size)
        except OSError as error:
            self._fail(error, "writing")
            return
        finally:
            with self._lock:
                self._writing.discard(key)
        with self._lock:
            self._entries[key] = _Entry(c, s, len(frame), ns, float(stamp))
            self._stats.pinned_blocks += key in self._kept
            self._stats.blocks += 1
            self._stats.used_bytes += len(frame)
            self._stats.bytes_written += len(frame)

    def _take_slot(self, slot_bytes: int) -> tuple[int, int, bool] | None:
        """(chunk, slot, whether the chunk is newly assigned) of a free slot of `slot_bytes`,
        evicting least recently used blocks for it; None when every candidate is being read.
        Lock held."""
        while True:
            for c, ch in enumerate(self._chunks):
                if ch.slot_bytes == slot_bytes and ch.free:
                    return c, ch.free.pop(), False
            for c, ch in enumerate(self._chunks):
                if ch.used == 0:  # unassigned, or emptied: it may change slot size
                    self._assign(c, slot_bytes)
                    return c, ch.free.pop(), True
            kept = self._kept
            victim = next((k for k, e in self._entries.items() if not e.readers and k not in kept), None)
            if victim is None:
                return None
            self._remove(victim)
            self._stats.evictions_lru += 1

    def _remove(self, key: bytes) -> None:
        """Forget a block (its record stays until the slot is rewritten: a stale one is a miss). Lock held."""
        entry = self._entries.pop(key)
        ch = self._chunks[entry.chunk]
        ch.keys[entry.slot] = None
        ch.free.append(entry.slot)
        ch.used -= 1
        self._stats.blocks -= 1
        self._stats.used_bytes -= entry.length
        self._stats.pinned_blocks -= key in self._kept

    # -- reading --------------------------------------------------------------------
    def fetch(
        self, namespace_id: str, hashes: Sequence[bytes], budget: ProbeBudget | None = None, frame_bytes: int = 0
    ) -> list[bytes]:
        """Frames of the longest run of `hashes` from the first that the tier holds (unverified:
        the caller checks each with the codec and calls `corrupt` on a failure). With a `budget`
        (and the blocks' `frame_bytes`), only as many as it grants at the reads' measured pace."""
        if not self._up or not hashes:
            return []
        now = self.clock()
        ttl = float(self.options.ttl_s)
        picked: list[tuple[bytes, _Entry]] = []
        with self._lock:
            for block_hash in hashes:
                key = block_key(namespace_id, block_hash)
                entry = self._entries.get(key)
                if entry is None:
                    break
                if now - entry.used > ttl and key not in self._kept:
                    self._remove(key)
                    self._stats.evictions_ttl += 1
                    break
                picked.append((key, entry))
            if budget is not None and picked:
                granted = budget.grant(
                    len(picked), self._reads.estimate(), frame_bytes, len(picked), time.perf_counter()
                )
                self._stats.reads_declined += len(picked) - granted
                del picked[granted:]
            for _, entry in picked:
                entry.readers += 1
            self._stats.hits += len(picked)
            self._stats.misses += len(picked) < len(hashes)
            for key, entry in reversed(picked):  # leaf to root: the root ends most recent
                entry.used = now
                self._entries.move_to_end(key)
        started = time.perf_counter()
        try:
            frames = list(self._readers.map(self._read, [entry for _, entry in picked]))
        except OSError as error:
            self._fail(error, "reading")
            frames = []
        finally:
            with self._lock:
                for _, entry in picked:
                    entry.readers -= 1
        seconds = time.perf_counter() - started
        with self._lock:
            nbytes = sum(len(f) for f in frames)
            self._stats.bytes_read += nbytes
            if frames:  # one sample: the fetch's reads, in parallel on the pool
                self._reads.observe(nbytes, seconds)
        return frames

    def _read(self, entry: _Entry) -> bytes:
        ch = self._chunks[entry.chunk]
        return os.pread(self._fds[ch.file], entry.length, ch.offset + TABLE_BYTES + entry.slot * ch.slot_bytes)

    def corrupt(self, namespace_id: str, block_hash: bytes) -> None:
        """A fetched frame failed verification: count it and free its slot."""
        key = block_key(namespace_id, block_hash)
        with self._lock:
            self._stats.integrity_failures += 1
            entry = self._entries.get(key)
            if entry is not None and not entry.readers:
                self._remove(key)

    # -- forgetting ---------------------------------------------------------------------
    def delete_namespace(self, namespace_id: str) -> None:
        ns = _ns_digest(namespace_id)
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.ns == ns and not e.readers and k not in self._kept]:
                self._remove(key)

    def flush(self) -> None:
        """Forget everything but pinned blocks, on disk too (the tables are rewritten: a restart
        finds only those)."""
        self.wait_idle(5.0)
        with self._lock:
            for key in [k for k, e in self._entries.items() if not e.readers and k not in self._kept]:
                self._remove(key)
            if not self._up:
                return
            try:
                for ch in self._chunks:
                    if not ch.slot_bytes:
                        continue
                    table = bytearray(TABLE_BYTES)
                    if ch.used:  # pinned blocks (or ones being read) stay, and their records
                        _HEADER.pack_into(table, 0, MAGIC, VERSION, ch.slot_bytes)
                        for s, held in enumerate(ch.keys):
                            entry = self._entries.get(held) if held is not None else None
                            if entry is not None:
                                _RECORD.pack_into(
                                    table, PAGE + s * _RECORD.size, held, entry.ns, entry.length, int(entry.used)
                                )
                    os.pwrite(self._fds[ch.file], table, ch.offset)
                    if not ch.used:
                        ch.slot_bytes = 0
            except OSError as error:
                self._up_off(error, "flushing")

    # -- health ---------------------------------------------------------------------------
    def _check_dir(self) -> None:
        """The directory deleted or replaced (our files unlinked) is a failure like EIO."""
        st = os.stat(self.options.directory)  # FileNotFoundError: an OSError
        if (st.st_dev, st.st_ino) != self._dir_id:
            raise OSError(errno.ESTALE, "the disk tier's directory was replaced", self.options.directory)

    def _fail(self, error: OSError, doing: str) -> None:
        with self._lock:
            self._up_off(error, doing)

    def _up_off(self, error: OSError, doing: str) -> None:
        """Turn the tier off (lock held): one log line, `up` 0, every later call a miss or a drop."""
        self._stats.io_errors += 1
        if not self._up and self._stats.up == 0:
            return
        self._up = False
        self._stats.up = 0
        log.error(
            "disk tier off after an error %s %s: %s (serving from the other tiers)",
            doing,
            self.options.directory,
            error,
        )

    def is_up(self) -> bool:
        return self._up

    def stats(self) -> DiskStats:
        with self._lock:
            stats = DiskStats(**vars(self._stats))
            estimate = self._reads.estimate()
            if estimate.samples:
                stats.read_latency_s, stats.read_bytes_per_s = estimate.latency_s, estimate.bytes_per_s
            return stats

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no write is queued or running (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def close(self, timeout_s: float = 2.0) -> bool:
        idle = self.wait_idle(timeout_s)
        for _ in self._writers:
            self._queue.put(None)
        for thread in self._writers:
            thread.join(timeout_s)
        self._readers.shutdown(wait=True)
        with self._lock:
            self._up = False
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        return idle
