"""Disk tier benchmark: put/get GB/s through the tier next to the disk's own limit, and restart time.

    python benchmarks/disk_bench.py --dir /var/tmp/pfx-disk-bench --total 1GiB

In one run, on the same directory:
- raw: sequential 8 MiB `pwrite`/`pread` with O_DIRECT (no page cache) over a file of `--total`
  bytes: the disk's own limit;
- tier: `--total` bytes of 64 KiB and 2 MiB blocks as checked frames (codec.py) through
  `DiskTier.submit` (until `wait_idle`, then fsync) and `DiskTier.fetch` in runs of 32 blocks
  (frames verified as the cache verifies them). The tier does buffered I/O, so its files' pages
  are dropped from the page cache (`posix_fadvise(DONTNEED)` after fsync) before reading: the
  read figure is the disk's, not memory's;
- restart: a new `DiskTier` on the same directory, the time until its index is rebuilt and the
  first block is fetched and verified.
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from prefixcache.codec import decode_block, encode_block  # noqa: E402
from prefixcache.config import DType, KVLayout, parse_size  # noqa: E402
from prefixcache.tiers.disk import FILE_PREFIX, MAX_SLOTS_PER_CHUNK, PAGE, TABLE_BYTES, DiskOptions, DiskTier  # noqa: E402

RAW_IO = 8 << 20
CHUNK = 64 << 20
NS = "bench-namespace"


def drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(FILE_PREFIX):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw(directory: str, total: int) -> dict[str, float]:
    path = os.path.join(directory, "raw-odirect.dat")
    buf = mmap.mmap(-1, RAW_IO)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(RAW_IO))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        started = time.perf_counter()
        for offset in range(0, total, RAW_IO):
            os.pwritev(fd, [buf], offset)
        os.fsync(fd)
        put = total / (time.perf_counter() - started)
        started = time.perf_counter()
        for offset in range(0, total, RAW_IO):
            os.preadv(fd, [buf], offset)
        get = total / (time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"put_GBps": put / 1e9, "get_GBps": get / 1e9}


def layout_of(block_bytes: int) -> KVLayout:
    # 16 tokens a block, 8 layers, 2 heads: head_dim sets the size (float16).
    head_dim = block_bytes // (8 * 2 * 2 * 16 * 2)
    return KVLayout(layers=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=DType.FLOAT16)


def tier(directory: str, total: int, block_bytes: int) -> dict[str, float]:
    layout = layout_of(block_bytes)
    n = total // block_bytes
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, layout.block_bytes, dtype=np.uint8).tobytes()
    tokens = [np.arange(i * 16, i * 16 + 16, dtype=np.uint32) for i in range(n)]
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    frames = [
        encode_block(layout, NS, hashes[i], hashes[i - 1] if i else b"root", tokens[i], payload) for i in range(n)
    ]
    slot = -(-len(frames[0]) // PAGE) * PAGE
    per_chunk = min((CHUNK - TABLE_BYTES) // slot, MAX_SLOTS_PER_CHUNK)
    capacity = (-(-n // per_chunk) + 1) * CHUNK  # every block fits: nothing is evicted
    options = DiskOptions(directory, capacity, chunk_bytes=CHUNK, admit_after=1, queue_depth=256)
    disk = DiskTier(options)
    started = time.perf_counter()
    for i in range(n):
        while not disk.submit(NS, hashes[i], frames[i]):  # a full queue drops: the bench waits instead
            time.sleep(0.0005)
    disk.wait_idle(600)
    drop_cache(directory)  # includes the fsync
    put = n * block_bytes / (time.perf_counter() - started)
    stats = disk.stats()
    assert stats.blocks == n, stats
    started = time.perf_counter()
    got = 0
    for start in range(0, n, 32):
        for i, frame in enumerate(disk.fetch(NS, hashes[start : start + 32]), start=start):
            decode_block(frame, layout, NS, hashes[i], hashes[i - 1] if i else b"root", tokens[i])
            got += 1
    get = n * block_bytes / (time.perf_counter() - started)
    assert got == n
    disk.close()
    drop_cache(directory)
    started = time.perf_counter()
    again = DiskTier(options)
    frame = again.fetch(NS, hashes[n // 2 : n // 2 + 1])[0]
    decode_block(frame, layout, NS, hashes[n // 2], hashes[n // 2 - 1], tokens[n // 2])
    restart = time.perf_counter() - started
    restored = again.stats().restored_blocks
    again.close()
    for name in os.listdir(directory):
        if name.startswith(FILE_PREFIX):
            os.unlink(os.path.join(directory, name))
    return {
        "put_GBps": put / 1e9,
        "get_GBps": get / 1e9,
        "restart_s": restart,
        "restored_blocks": restored,
        "tier_GiB": capacity / (1 << 30),
    }


def replay(directory: str, requests: int, disk_on: bool) -> dict[str, float]:
    """Prompts drawn at random (seed 0) from a working set 4x the host tier: 64 prompts of 64
    blocks of 64 KiB against a host tier of 1,024 blocks; each request looks up, then stores its
    prompt (as a worker commits after prefill). Token hit rate and the lookup's mean time
    (disk reads and verification included; not a TTFT: no model runs here)."""
    import torch

    from prefixcache.cache import PrefixCache
    from prefixcache.config import CacheConfig, Namespace
    from prefixcache.tiers.host import HostTier

    layout = layout_of(64 << 10)
    host_blocks, n_prompts, blocks = 1024, 64, 64
    host = HostTier(layout, host_blocks * layout.block_bytes)
    disk = None
    if disk_on:
        disk = DiskTier(DiskOptions(directory, "512MiB"))
    cache = PrefixCache(CacheConfig(host_capacity=host_blocks * layout.block_bytes), layout, host, disk=disk)
    ns = cache.attach(Namespace(model="replay", revision="r", layout=layout))
    kv = torch.zeros((blocks, *layout.block_shape), dtype=torch.float16)
    rng = np.random.default_rng(0)
    hit = total = 0
    spent = 0.0
    for _ in range(requests):
        p = int(rng.integers(n_prompts))
        tokens = list(range(p * 1_000_000, p * 1_000_000 + blocks * 16))
        started = time.perf_counter()
        result = cache.lookup(ns, tokens)
        spent += time.perf_counter() - started
        hit += result.hit_tokens
        total += len(tokens)
        cache.store(ns, tokens, kv)
    cache.close()
    for name in os.listdir(directory):
        if name.startswith(FILE_PREFIX):
            os.unlink(os.path.join(directory, name))
    return {"token_hit_rate": hit / total, "lookup_ms_mean": spent / requests * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp/pfx-disk-bench")
    parser.add_argument("--total", default="1GiB", help="bytes written per measurement")
    parser.add_argument(
        "--restart-total", default=None, help="also fill a tier this big with 2 MiB blocks (e.g. 10GiB): its restart"
    )
    parser.add_argument("--replay", type=int, default=0, help="requests of the 4x-host replay (0: skip)")
    args = parser.parse_args()
    total = parse_size(args.total, "total")
    os.makedirs(args.dir, exist_ok=True)
    if args.replay:
        try:
            found = {f"replay_disk_{on}": replay(args.dir, args.replay, on) for on in (False, True)}
        finally:
            shutil.rmtree(args.dir, ignore_errors=True)
        print(json.dumps(found))
        return
    try:
        results = {"raw_odirect_8MiB": raw(args.dir, total)}
        for size in (64 << 10, 2 << 20):
            results[f"tier_{size >> 10}KiB"] = tier(args.dir, total, size)
        if args.restart_total:
            results["tier_2048KiB_big"] = tier(args.dir, parse_size(args.restart_total, "restart_total"), 2 << 20)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{'':18} {'put GB/s':>9} {'get GB/s':>9} {'restart s':>10}")
    for name, r in results.items():
        print(f"{name:18} {r['put_GBps']:9.2f} {r['get_GBps']:9.2f} {r.get('restart_s', float('nan')):10.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
