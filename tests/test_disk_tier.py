"""The disk tier (tiers/disk.py) over real files: alone, and under a real host tier in PrefixCache.

What it shows: blocks pushed out of a tiny host tier come back from disk byte for byte (and from
Redis past the disk, test_cache_redis covers Redis alone); admission after reuse (a block evicted
once is not written, the second time it is); an exact byte budget with LRU eviction; a restart on
the same directory serves what was there, rebuilt from the chunk tables; torn, flipped, truncated
and foreign data are counted integrity misses, never wrong bytes; a full filesystem (a small tmpfs
this test mounts when root) and a deleted directory turn the tier off with the host tier still
serving; operator pins come back after a restart (their blocks kept on disk through LRU, TTL,
evict and flush), a pin past its end or without its blocks does not, and an unreadable pin book
is set aside. (A read-only remount is not tested: the kernel refuses `remount,ro` while the tier holds
its files open for writing; the real case, ext4's errors=remount-ro, needs a loop device.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, DType, KVLayout
from prefixcache.errors import ConfigError, InvalidArgument
from prefixcache.pin_book import FILE_NAME as PIN_BOOK
from prefixcache.tiers.disk import FILE_PREFIX, MAX_SLOTS_PER_CHUNK, PAGE, TABLE_BYTES, DiskOptions, DiskTier
from prefixcache.tiers.host import HostTier
from prefixcache_services.cache_server.inspect import inspect_prefix
from prefixcache_services.cache_server.metrics import DiskCollector
from tests.support.core import ManualClock, kv_for, namespace, read_blocks, same_bytes
from tests.support.poll import poll

UNIT = pytest.mark.unit  # every test but the SIGKILL one (a child process)

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=DType.FLOAT16)  # 512-byte blocks
BS = LAYOUT.block_size
CHUNK = TABLE_BYTES + 16 * PAGE  # 16 one-page slots a chunk (a 512-byte block's frame fits a page)


@contextmanager
def disk_cache(
    directory: Path,
    host_slots: int = 4,
    chunks: int = 4,
    wall: Callable[[], float] = time.time,
    tier: type[DiskTier] = DiskTier,
    **options,
) -> Iterator[tuple[PrefixCache, str]]:
    disk = tier(DiskOptions(str(directory), chunks * CHUNK, chunk_bytes=CHUNK, **options), clock=wall)
    host = HostTier(LAYOUT, host_slots * LAYOUT.block_bytes)
    cache = PrefixCache(
        CacheConfig(host_capacity=host_slots * LAYOUT.block_bytes), LAYOUT, host, clock=ManualClock(), disk=disk
    )
    try:
        yield cache, cache.attach(namespace(LAYOUT))
    finally:
        cache.close()


def tokens_for(seed: int, blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BS)]


def store(cache: PrefixCache, ns: str, tokens: list[int]) -> int:
    return cache.store(ns, tokens, kv_for(tokens, LAYOUT)).stored


def hit_blocks(cache: PrefixCache, ns: str, tokens: list[int]) -> int:
    """Blocks hit, each checked byte for byte against what was stored."""
    result = cache.lookup(ns, tokens)
    hit = result.hit_tokens // BS
    if hit:
        assert same_bytes(read_blocks(cache, result.locations), kv_for(tokens, LAYOUT)[:hit])
    return hit


def cycle(cache: PrefixCache, ns: str, seeds: range, blocks: int = 4) -> None:
    """Store each prompt in turn: with a host tier of `blocks`, each pushes the previous out."""
    for seed in seeds:
        store(cache, ns, tokens_for(seed, blocks))
    assert cache.disk is not None and cache.disk.wait_idle(5)


@UNIT
def test_admission_after_reuse_then_a_disk_hit_is_promoted(tmp_path: Path) -> None:
    with disk_cache(tmp_path) as (cache, ns):
        disk = cache.disk
        assert disk is not None
        a = tokens_for(1, 4)
        cycle(cache, ns, range(1, 3))  # a evicted once: offered, not written
        stats = disk.stats()
        assert stats.rejected == 4 and stats.admitted == 0 and stats.blocks == 0
        assert cache.lookup(ns, a).hit_tokens == 0
        cycle(cache, ns, range(1, 3))  # a stored again and evicted a second time: written
        stats = disk.stats()
        assert stats.admitted == 4 and stats.blocks == 4 and stats.bytes_written > 4 * LAYOUT.block_bytes
        assert hit_blocks(cache, ns, a) == 4  # all four from disk, now in the host tier
        assert cache.stats().promotions == {"host": 4}
        assert disk.stats().hits == 4


@UNIT
def test_admit_after_one_writes_at_the_first_eviction(tmp_path: Path) -> None:
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        cycle(cache, ns, range(1, 3))
        assert cache.disk is not None and cache.disk.stats().blocks == 4
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 4


@UNIT
def test_match_counts_what_the_disk_holds_past_the_local_hit_and_reads_nothing(tmp_path: Path) -> None:
    a = tokens_for(1, 4)
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        cycle(cache, ns, range(1, 3))  # a on disk only
        disk = cache.disk
        assert disk is not None
        before = disk.stats()
        matched = cache.match(ns, a)
        assert (matched.hit_tokens, matched.disk_blocks) == (0, 4)
        assert cache.match(ns, a[: 2 * BS] + [99] * BS).disk_blocks == 2  # a run from the local hit, in order
        report = inspect_prefix(cache, ns, np.asarray(a))  # what `prefixcache inspect` shows
        assert (report.hit_tokens, report.disk_blocks) == (0, 4)
        after = disk.stats()
        assert (after.hits, after.misses, after.bytes_read) == (before.hits, before.misses, before.bytes_read)
        assert cache.stats().promotions == {} and hit_blocks(cache, ns, a) == 4  # the lookup promotes them
        assert cache.match(ns, a).disk_blocks == 0 and cache.match(ns, a).hit_tokens == 4 * BS


@UNIT
def test_byte_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    with disk_cache(tmp_path, chunks=1, admit_after=1) as (cache, ns):  # 16 slots on disk
        cycle(cache, ns, range(1, 8))  # 6 prompts of 4 blocks leave the host tier: 24 > 16
        disk = cache.disk
        assert disk is not None
        stats = disk.stats()
        assert stats.blocks == 16 and stats.evictions_lru == 8
        assert os.path.getsize(tmp_path / f"{FILE_PREFIX}0000.dat") == CHUNK  # the exact budget, preallocated
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 0  # the oldest went
        assert hit_blocks(cache, ns, tokens_for(6, 4)) == 4


@UNIT
def test_restart_serves_what_was_on_disk(tmp_path: Path) -> None:
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        cycle(cache, ns, range(1, 4))  # prompts 1 and 2 on disk
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        assert cache.disk is not None and cache.disk.stats().restored_blocks == 8
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 4
        assert hit_blocks(cache, ns, tokens_for(2, 4)) == 4
        assert hit_blocks(cache, ns, tokens_for(3, 4)) == 0  # never left the old host tier


class SlowDisk(DiskTier):
    """Real files, each read 20 ms slower: a throttled network volume."""

    def _read(self, entry):
        time.sleep(0.02)
        return super()._read(entry)


@UNIT
def test_a_slow_disk_is_read_only_where_it_beats_recomputing(tmp_path: Path) -> None:
    a = tokens_for(1, 4)
    with disk_cache(tmp_path, admit_after=1, tier=SlowDisk) as (cache, ns):
        disk = cache.disk
        assert disk is not None
        store(cache, ns, a)
        for _ in range(4):  # a leaves the host tier for disk, and a lookup without a cost reads it back (timed)
            cycle(cache, ns, range(2, 3))
            assert hit_blocks(cache, ns, a) == 4
        stats = disk.stats()
        assert stats.read_latency_s + 4 * LAYOUT.block_bytes / stats.read_bytes_per_s > 0.01  # learned: slow
        cycle(cache, ns, range(2, 3))
        fast_worker = cache.lookup(ns, a, recompute_s_per_token=1e-6)  # 4 us a block: recomputing wins
        assert fast_worker.hit_tokens == 0 and disk.stats().reads_declined == 4
        slow_worker = cache.lookup(ns, a, recompute_s_per_token=0.1)  # 0.4 s a block: the disk wins
        assert slow_worker.hit_tokens == 4 * BS and disk.stats().reads_declined == 4


# ---- pins kept on disk (pin_book.py) ------------------------------------------------------------


@UNIT
def test_pins_come_back_after_a_restart_with_their_id_priority_and_end(tmp_path: Path) -> None:
    a, b = tokens_for(1, 4), tokens_for(2, 3)
    with disk_cache(tmp_path, host_slots=8) as (cache, ns):  # admission after reuse: nothing on disk yet
        store(cache, ns, a)
        store(cache, ns, b)
        pin_a = cache.pin(ns, a, ttl_s=3600, priority=7)
        pin_b = cache.pin(ns, b[: 2 * BS])  # no TTL; two of b's three blocks
        disk = cache.disk
        assert disk is not None and disk.wait_idle(5)
        stats = disk.stats()
        assert stats.blocks == stats.pinned_blocks == 6 and stats.admitted == 0  # written at once, kept
        gauges = {m.name: m.samples[0].value for m in DiskCollector(disk.stats).collect() if len(m.samples) == 1}
        assert gauges["prefixcache_disk_pinned_blocks"] == 6
    with disk_cache(tmp_path, host_slots=8) as (cache, ns):  # attached: both pins made again from disk
        pins = {pin.id: pin for _, pin in cache.pins()}
        assert set(pins) == {pin_a.id, pin_b.id}
        assert pins[pin_a.id].priority == 7 and len(pins[pin_a.id].nodes) == 4
        assert 3590 < pins[pin_a.id].expires_at - cache.clock() <= 3600
        assert pins[pin_b.id].expires_at == float("inf") and len(pins[pin_b.id].nodes) == 2
        assert hit_blocks(cache, ns, a) == 4 and hit_blocks(cache, ns, b) == 2  # byte for byte, from the host tier
        cache.unpin(pin_a.id)  # its old id still names it
    with disk_cache(tmp_path, host_slots=8) as (cache, ns):
        assert [pin.id for _, pin in cache.pins()] == [pin_b.id]
        assert cache.disk is not None and cache.disk.stats().pinned_blocks == 2


@UNIT
def test_a_pin_waiting_for_its_namespace_is_listed_and_can_be_unpinned(tmp_path: Path) -> None:
    with disk_cache(tmp_path, host_slots=8) as (cache, ns):
        store(cache, ns, tokens_for(1, 2))
        pin = cache.pin(ns, tokens_for(1, 2), ttl_s=600, priority=3)
    other = namespace(LAYOUT, model="another-model")
    with disk_cache(tmp_path, host_slots=8) as (cache, _):  # (disk_cache attaches ns: restored)
        assert [(n, p.id, len(p.nodes)) for n, p in cache.pins()] == [(ns, pin.id, 2)]
    disk = DiskTier(DiskOptions(str(tmp_path), 4 * CHUNK, chunk_bytes=CHUNK))
    cache = PrefixCache(
        CacheConfig(host_capacity=8 * LAYOUT.block_bytes), LAYOUT, HostTier(LAYOUT, 8 * LAYOUT.block_bytes), disk=disk
    )
    try:
        cache.attach(other)  # only another namespace comes back: ns's pin waits, listed, holding nothing
        ((waiting_ns, waiting),) = cache.pins()
        assert (waiting_ns, waiting.id, waiting.nodes, waiting.priority) == (ns, pin.id, (), 3)
        assert 590 < waiting.expires_at - cache.clock() <= 600 and disk.stats().pinned_blocks == 2
        cache.unpin(pin.id)  # forgotten: out of the book, its blocks no longer kept
        assert cache.pins() == [] and disk.stats().pinned_blocks == 0
        with pytest.raises(InvalidArgument, match="pin_id"):
            cache.unpin(pin.id)
    finally:
        cache.close()
    with disk_cache(tmp_path, host_slots=8) as (cache, _):
        assert cache.pins() == []


@UNIT
def test_attaches_at_once_after_a_restart_restore_each_pin_once(tmp_path: Path) -> None:
    prompts = [tokens_for(seed, 2) for seed in range(1, 4)]
    with disk_cache(tmp_path, host_slots=8) as (cache, ns):
        for tokens in prompts:
            store(cache, ns, tokens)
        ids = {cache.pin(ns, tokens, priority=i).id for i, tokens in enumerate(prompts)}
    for _ in range(5):  # each round a restart, then four engines attaching together
        pins = _restart_and_attach_at_once(tmp_path)
        assert {pin.id for pin in pins} == ids and sum(len(pin.nodes) for pin in pins) == 6


def _restart_and_attach_at_once(directory: Path) -> list:
    disk = DiskTier(DiskOptions(str(directory), 4 * CHUNK, chunk_bytes=CHUNK))
    host = HostTier(LAYOUT, 8 * LAYOUT.block_bytes)
    cache = PrefixCache(CacheConfig(host_capacity=8 * LAYOUT.block_bytes), LAYOUT, host, disk=disk)
    try:
        with ThreadPoolExecutor(4) as pool:
            assert len({f.result() for f in [pool.submit(cache.attach, namespace(LAYOUT)) for _ in range(4)]}) == 1
        assert poll(lambda: len(cache.pins()) == 3, 5)  # (an attach may return while another restores)
        return [pin for _, pin in cache.pins()]
    finally:
        cache.close()


@UNIT
def test_pinned_blocks_on_disk_outlast_lru_ttl_evict_and_flush(tmp_path: Path) -> None:
    now = [1_000_000.0]
    pinned = tokens_for(1, 4)
    with disk_cache(tmp_path, host_slots=8, chunks=1, admit_after=1, ttl_s=60, wall=lambda: now[0]) as (cache, ns):
        store(cache, ns, pinned)
        pin = cache.pin(ns, pinned)
        disk = cache.disk
        assert disk is not None
        for round_ in range(3):  # 16 disk slots; 4 of them pinned; the rest turned over
            cycle(cache, ns, range(10 + 10 * round_, 14 + 10 * round_))
        assert disk.stats().evictions_lru > 0 and disk.stats().pinned_blocks == 4
        now[0] += 120  # past the disk tier's TTL
        assert cache.lookup(ns, tokens_for(12, 4)).hit_tokens == 0  # expired on disk too
        cache.evict(ns)
        cache.flush()
        assert disk.stats().blocks == 4
    with disk_cache(tmp_path, host_slots=8, chunks=1, admit_after=1, ttl_s=60, wall=lambda: now[0]) as (cache, ns):
        assert [p.id for _, p in cache.pins()] == [pin.id]
        assert hit_blocks(cache, ns, pinned) == 4


@UNIT
def test_a_pin_is_not_restored_past_its_end_nor_when_its_blocks_are_gone(tmp_path: Path, caplog) -> None:
    now = [1_000_000.0]
    with disk_cache(tmp_path, host_slots=8, wall=lambda: now[0]) as (cache, ns):
        store(cache, ns, tokens_for(1, 2))
        store(cache, ns, tokens_for(2, 2))
        cache.pin(ns, tokens_for(1, 2), ttl_s=30)
        lost = cache.pin(ns, tokens_for(2, 2))
    now[0] += 60
    for data in tmp_path.glob(f"{FILE_PREFIX}*.dat"):  # the blocks go; the pin book stays
        data.write_bytes(b"")
    with disk_cache(tmp_path, host_slots=8, wall=lambda: now[0]) as (cache, ns):
        assert cache.disk is not None and [r.pin_id for r in cache.disk.kept_pins()] == [lost.id]  # not the ended one
        assert cache.pins() == []  # attached: the other tried, and dropped
    assert f"pin {lost.id} of namespace {ns} not restored" in caplog.text
    assert '"pins":[]' in (tmp_path / PIN_BOOK).read_text()  # neither is kept for the next start


@UNIT
@pytest.mark.parametrize(
    "pin",
    [
        '{"pin_id": "x"}',
        '{"pin_id": 1, "namespace_id": "n", "tokens": "123", "block_hashes": [], "expires_unix": null, "priority": 0}',
    ],
    ids=["not-an-id", "tokens-a-string"],
)
def test_an_unreadable_pin_book_is_set_aside_and_the_tier_serves(tmp_path: Path, caplog, pin: str) -> None:
    (tmp_path / PIN_BOOK).write_text(f'{{"schema_version": 1, "pins": [{pin}]}}')
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        assert cache.disk is not None and cache.disk.is_up() and cache.pins() == []
        cycle(cache, ns, range(1, 3))
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 4
    assert "pin book" in caplog.text and "pins[0]" in caplog.text
    assert (tmp_path / f"{PIN_BOOK}.unreadable").exists() and not (tmp_path / PIN_BOOK).exists()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@UNIT
def test_flipped_and_foreign_blocks_are_counted_misses(tmp_path: Path) -> None:
    with disk_cache(tmp_path, admit_after=1, io_threads=1) as (cache, ns):  # one writer: slots in eviction order
        cycle(cache, ns, range(1, 3))  # leaf first: slots 0..3 hold blocks 3, 2, 1, 0
    data = tmp_path / f"{FILE_PREFIX}0000.dat"
    _flip(data, TABLE_BYTES + 2 * PAGE + 400)  # inside block 1's payload
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 1  # stops before the flipped block
        assert cache.disk is not None and cache.disk.stats().integrity_failures == 1
        assert cache.disk.stats().blocks == 3  # its slot freed
    other = KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=DType.BFLOAT16)  # same size, foreign
    disk = DiskTier(DiskOptions(str(tmp_path), 4 * CHUNK, chunk_bytes=CHUNK, admit_after=1))
    host = HostTier(other, 4 * other.block_bytes)
    cache = PrefixCache(CacheConfig(host_capacity=4 * other.block_bytes), other, host, disk=disk, clock=ManualClock())
    try:
        ns = cache.attach(namespace(other))
        tokens = tokens_for(1, 4)
        assert cache.lookup(ns, tokens).hit_tokens == 0  # another namespace id: its keys are others
        assert disk.stats().integrity_failures == 0
    finally:
        cache.close()


@UNIT
def test_truncated_and_torn_files_are_misses(tmp_path: Path) -> None:
    with disk_cache(tmp_path, admit_after=1, io_threads=1) as (cache, ns):
        cycle(cache, ns, range(1, 3))  # slots 0..3 hold blocks 3, 2, 1, 0
    data = tmp_path / f"{FILE_PREFIX}0000.dat"
    with open(data, "r+b") as f:  # a torn write: block 2's record names a frame only half there
        f.seek(TABLE_BYTES + 1 * PAGE + 100)
        f.write(bytes(200))
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 2
        assert cache.disk is not None and cache.disk.stats().integrity_failures == 1
    os.truncate(data, TABLE_BYTES + PAGE)  # a file of another size: rebuilt empty, nothing served
    with disk_cache(tmp_path, admit_after=1) as (cache, ns):
        assert cache.disk is not None and cache.disk.stats().restored_blocks == 0
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 0


@UNIT
def test_deleted_directory_turns_the_tier_off_host_keeps_serving(tmp_path: Path, caplog) -> None:
    directory = tmp_path / "disk"
    with disk_cache(directory, admit_after=1) as (cache, ns):
        cycle(cache, ns, range(1, 3))
        shutil.rmtree(directory)
        cycle(cache, ns, range(3, 6))  # writes meet the missing directory
        disk = cache.disk
        assert disk is not None and not disk.is_up() and disk.stats().up == 0
        assert sum("disk tier off" in r.getMessage() for r in caplog.records) == 1
        assert hit_blocks(cache, ns, tokens_for(5, 4)) == 4  # the host tier still serves
        assert hit_blocks(cache, ns, tokens_for(1, 4)) == 0  # the tier answers misses


@UNIT
def test_options_name_the_bad_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="disk_capacity"):
        DiskOptions(str(tmp_path), 4096)
    with pytest.raises(ConfigError, match="disk_admit_after"):
        DiskOptions(str(tmp_path), "1GiB", admit_after=0)
    with pytest.raises(ConfigError, match="disk_chunk_bytes"):
        DiskOptions(str(tmp_path), "1GiB", chunk_bytes=1000)


# ---- a real small filesystem: full and read-only (root only: it mounts a tmpfs) -----------------


@contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    mount = tmp_path / "mnt"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@UNIT
def test_a_full_filesystem_turns_the_tier_off_at_start(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path, "256k") as mount:
        with disk_cache(mount, chunks=8) as (cache, ns):  # 8 chunks of 128 KiB > 256 KiB
            disk = cache.disk
            assert disk is not None and not disk.is_up() and disk.stats().io_errors == 1
            cycle(cache, ns, range(1, 4))
            assert hit_blocks(cache, ns, tokens_for(3, 4)) == 4


# ---- SIGKILL mid-write (a real child process) --------------------------------------------------

WRITER = """
import sys
from prefixcache.tiers.disk import DiskOptions, DiskTier
from tests.test_disk_tier import CHUNK, LAYOUT, kill_frame
disk = DiskTier(DiskOptions(sys.argv[1], 8 * CHUNK, chunk_bytes=CHUNK, admit_after=1))
i = 0
while True:
    if disk.submit("ns", i.to_bytes(8, "little"), kill_frame(i)):
        i += 1
    if i == 40:
        disk.wait_idle(5)
        print("ready", flush=True)  # 40 written; the parent kills while more are being written
"""


def kill_frame(i: int) -> bytes:
    from prefixcache.codec import encode_block

    tokens = np.arange(i * BS, (i + 1) * BS, dtype=np.uint32)
    payload = np.full(LAYOUT.block_bytes, i % 251, dtype=np.uint8).tobytes()
    return encode_block(LAYOUT, "ns", i.to_bytes(8, "little"), b"root", tokens, payload)


@pytest.mark.process
def test_sigkill_mid_write_leaves_at_worst_a_few_misses(tmp_path: Path) -> None:
    from prefixcache.codec import decode_block
    from prefixcache.errors import CorruptBlock

    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(0.05)  # writes (and evictions: 128 slots) under way
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    disk = DiskTier(DiskOptions(str(tmp_path), 8 * CHUNK, chunk_bytes=CHUNK))
    try:
        restored = disk.stats().restored_blocks
        assert restored >= 40
        good = bad = 0
        for i in range(100_000):
            key = i.to_bytes(8, "little")
            frames = disk.fetch("ns", [key])
            if not frames:
                continue
            tokens = np.arange(i * BS, (i + 1) * BS, dtype=np.uint32)
            try:
                payload = decode_block(frames[0], LAYOUT, "ns", key, b"root", tokens)
                assert bytes(payload) == bytes([i % 251]) * LAYOUT.block_bytes
                good += 1
            except CorruptBlock:
                disk.corrupt("ns", key)
                bad += 1
            if good + bad == restored:
                break
        assert good + bad == restored and bad <= 4  # at most one torn write per writer thread
    finally:
        disk.close()


# ---- the service: SIGKILL, restart on the same directory, hits from disk -----------------------


@pytest.mark.process
def test_service_killed_and_restarted_serves_from_disk(tmp_path: Path) -> None:
    """10-20 s on 2 busy cores: two `serve` processes. Host tier of 16 blocks of 128 KiB, disk tier of
    128 MiB. A pin made before the kill comes back after it."""
    import torch

    from prefixcache.client import CacheClient
    from tests.support import lifetime
    from tests.test_service_process import _start

    served = KVLayout(layers=4, kv_heads=8, head_dim=64, block_size=16, dtype=DType.BFLOAT16)  # 128 KiB blocks
    flags = ("--host-capacity", "2MiB", "--disk-dir", str(tmp_path), "--disk-capacity", "128MiB")
    prompts = [list(range(seed * 100_000, seed * 100_000 + 16 * 16)) for seed in range(3)]
    kv = [torch.randint(-(2**15), 2**15, (16, *served.block_shape), dtype=torch.int16) for _ in prompts]
    process, address, _, _ = _start(*flags)
    try:
        with CacheClient(address, timeout_s=10) as client:
            client.attach("model", served)
            for _ in range(2):  # each prompt pushes the previous out: twice, so all are admitted
                for tokens, blocks in zip(prompts, kv):
                    assert client.store(tokens, blocks.view(torch.bfloat16)).stored == 16
            files = list(tmp_path.glob("prefixcache-disk-*.dat"))
            assert len(files) == 1 and files[0].stat().st_size == 128 << 20  # preallocated, exact
            # Both of the first two prompts on disk: each of their 16 slots' records written.
            poll(lambda: _records(files[0]) >= 32, timeout_s=10)
            pin = client.pin(prompts[2], ttl_s=3600, priority=9)  # the last prompt, still in the host tier only
            assert _records(files[0]) >= 48  # pinned: written to disk at once
    finally:
        lifetime.kill(process)  # SIGKILL: no drain, no close
    # A host tier of 64 blocks now: the restored pin holds 16 of them, the two prompts read take 32.
    process, address, _, _ = _start("--host-capacity", "8MiB", *flags[2:])
    try:
        with CacheClient(address, timeout_s=10) as client:
            client.attach("model", served)
            matched = client.match(prompts[0])  # a router sees the warm disk before any lookup
            assert (matched.hit_tokens, matched.disk_blocks) == (0, 16)
            inspected = client.inspect(prompts[0])  # and an operator too
            assert (inspected.hit_tokens, inspected.disk_blocks) == (0, 16)
            for tokens, blocks in zip(prompts[:2], kv[:2]):
                hit = client.lookup(tokens)
                assert hit.hit_tokens == 16 * 16
                assert torch.equal(client.read(hit).view(torch.int16), blocks)
                client.release(hit)
            # It never left the host tier, but it was pinned: the pin is back, its blocks read from disk.
            (restored,) = client.pins()
            assert (restored.pin_id, restored.priority, restored.pinned_tokens) == (pin.pin_id, 9, 16 * 16)
            assert restored.expires_in_s is not None and 3500 < restored.expires_in_s <= 3600
            hit = client.lookup(prompts[2])
            assert hit.hit_tokens == 16 * 16 and torch.equal(client.read(hit).view(torch.int16), kv[2])
            client.release(hit)
            stats = client.stats().snapshot  # GetStats reports the disk tier (stats, top)
            assert stats is not None and stats.disk_up is True
            assert stats.disk["restored_blocks"] >= 48 and stats.disk["pinned_blocks"] == 16
            assert stats.disk["capacity_bytes"] == 128 << 20
    finally:
        lifetime.stop(process, 10)


def _records(path: Path) -> int:
    """Slot records written in a disk file's chunks (the tables the restart reads)."""
    from prefixcache.tiers.disk import _RECORD

    data = path.read_bytes()
    count = 0
    for chunk in range(0, len(data), 64 << 20):
        for s in range(MAX_SLOTS_PER_CHUNK):
            _, _, length, _ = _RECORD.unpack_from(data, chunk + PAGE + s * _RECORD.size)
            count += length > 0
    return count


@UNIT
def test_restart_restores_every_block_concurrent_writers_wrote(tmp_path: Path) -> None:
    """Four writers opening chunks at once: no chunk's header write may clear another's record."""
    options = DiskOptions(str(tmp_path), 16 * CHUNK, chunk_bytes=CHUNK, admit_after=1, io_threads=4, queue_depth=256)
    disk = DiskTier(options)
    for i in range(200):
        assert disk.submit("ns", i.to_bytes(8, "little"), kill_frame(i))
    assert disk.wait_idle(10) and disk.stats().blocks == 200
    disk.close()
    again = DiskTier(options)
    try:
        assert again.stats().restored_blocks == 200
    finally:
        again.close()


@pytest.mark.redis
def test_host_then_disk_then_redis(tmp_path: Path, redis_server) -> None:
    """A block evicted once lives in Redis only and comes back from there; evicted a second time
    it is on disk too, and the disk serves it before Redis is asked."""
    from prefixcache.tiers.redis import RedisOptions, RedisTier

    disk = DiskTier(DiskOptions(str(tmp_path), 4 * CHUNK, chunk_bytes=CHUNK))
    host = HostTier(LAYOUT, 4 * LAYOUT.block_bytes)
    redis = RedisTier(RedisOptions(url=redis_server.url, key_prefix=f"d{os.getpid()}", ttl_s=600))
    cache = PrefixCache(
        CacheConfig(host_capacity=4 * LAYOUT.block_bytes), LAYOUT, host, remote=redis, clock=ManualClock(), disk=disk
    )
    try:
        ns = cache.attach(namespace(LAYOUT))
        a = tokens_for(1, 4)
        cycle(cache, ns, range(1, 3))  # a leaves the host tier once: Redis has it, the disk not yet
        assert redis.wait_idle(5)
        assert hit_blocks(cache, ns, a) == 4
        assert disk.stats().hits == 0 and cache.stats().remote["hits"] == 4
        cycle(cache, ns, range(2, 3))  # a leaves a second time: written to disk
        assert disk.stats().blocks == 4
        assert hit_blocks(cache, ns, a) == 4
        assert disk.stats().hits == 4 and cache.stats().remote["hits"] == 4  # Redis not asked
    finally:
        cache.close()


@UNIT
def test_a_full_write_queue_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    big = 4 << 20  # a 4 MiB frame takes milliseconds to write; 20 submissions take microseconds
    options = DiskOptions(
        str(tmp_path), 2 * (64 << 20), chunk_bytes=64 << 20, admit_after=1, io_threads=1, queue_depth=1
    )
    disk = DiskTier(options)
    try:
        frame = os.urandom(big)
        started = time.perf_counter()
        accepted = [disk.submit("ns", i.to_bytes(8, "little"), frame) for i in range(20)]
        assert time.perf_counter() - started < 0.5
        stats = disk.stats()
        assert not all(accepted) and stats.dropped == accepted.count(False)
        assert stats.admitted == accepted.count(True)
        assert disk.wait_idle(10) and disk.stats().blocks == accepted.count(True)
    finally:
        disk.close()
