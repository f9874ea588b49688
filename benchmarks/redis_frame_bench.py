"""What a Redis block frame costs the client: `encode_block` and `decode_block` per block, on one
thread and on several at once (the payload's copy and checksum run with the GIL released, so
threads should add up; a GIL-held step serializes them).

    PYTHONPATH=. python benchmarks/redis_frame_bench.py [--sizes 64KiB,2MiB] [--threads 1,2] [--json-out F]

Payloads are the peer bench's block shapes (benchmarks/redis_peer_bench.LAYOUTS), four distinct
ones cycled; each figure is the best of `--repeats` timed loops of `--blocks` blocks (µs per block,
and GB/s of payload over all threads). Run it from another tree's root (PYTHONPATH there) to
compare codecs: it uses only `prefixcache.codec` and `prefixcache.config`.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prefixcache.codec import decode_block, encode_block
from prefixcache.config import DType, KVLayout

LAYOUTS = {  # redis_peer_bench.LAYOUTS (not imported: an older tree may lack that module)
    "64KiB": KVLayout(layers=16, kv_heads=1, head_dim=64, block_size=16, dtype=DType.FLOAT16),
    "2MiB": KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype=DType.FLOAT16),
}
NS = "bench00000000000"
PARENT = bytes(16)


def timed(threads: int, blocks: int, repeats: int, work: Callable[[int], None]) -> float:
    """Best wall seconds of `repeats` runs of `work(blocks)` on `threads` threads at once."""
    best = float("inf")
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def run(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            work(blocks)

        pool = [threading.Thread(target=run) for _ in range(threads)]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        best = min(best, time.perf_counter() - start)
    return best


def bench(size: str, threads: int, blocks: int, repeats: int, keyed: bool) -> dict[str, object]:
    layout = LAYOUTS[size]
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, layout.block_bytes, dtype=np.uint8) for _ in range(4)]
    tokens = np.arange(layout.block_size, dtype="<u4")
    hashes = [i.to_bytes(16, "big") for i in range(4)]
    mac_key, storage_key = (bytes(32), "bench:k") if keyed else (None, None)
    frames = [
        encode_block(layout, NS, hashes[i], PARENT, tokens, payloads[i].data, mac_key=mac_key, storage_key=storage_key)
        for i in range(4)
    ]

    def encode(n: int) -> None:
        for i in range(n):
            payload = payloads[i & 3].data
            encode_block(layout, NS, hashes[i & 3], PARENT, tokens, payload, mac_key=mac_key, storage_key=storage_key)

    def decode(n: int) -> None:
        for i in range(n):
            frame = frames[i & 3]
            decode_block(frame, layout, NS, hashes[i & 3], PARENT, tokens, mac_key=mac_key, storage_key=storage_key)

    row: dict[str, object] = {"block": size, "threads": threads, "keyed": keyed}
    for name, work in (("encode", encode), ("decode", decode)):
        seconds = timed(threads, blocks, repeats, work)
        row[f"{name}_us"] = seconds / blocks * 1e6  # wall per block of one thread's loop
        row[f"{name}_gbs"] = threads * blocks * layout.block_bytes / seconds / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,2MiB", help=",".join(LAYOUTS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--blocks", type=int, default=200, help="blocks per thread per timed loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keyed", action="store_true", help="frames with an HMAC-SHA256 (mac_key)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    rows = [
        bench(size, int(threads), args.blocks, args.repeats, args.keyed)
        for size in args.sizes.split(",")
        for threads in args.threads.split(",")
    ]
    print("| block | threads | keyed | encode µs | encode GB/s | decode µs | decode GB/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['block']} | {r['threads']} | {r['keyed']} | {r['encode_us']:.1f} | {r['encode_gbs']:.2f} "
            f"| {r['decode_us']:.1f} | {r['decode_gbs']:.2f} |"
        )
    if args.json_out:
        report = {"unit": "µs per block (one thread's loop), GB/s of payload over all threads", "rows": rows}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
