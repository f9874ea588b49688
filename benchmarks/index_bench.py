"""Index benchmark: lookup/insert latency on multi-turn-chat-shaped prompts, hashing throughput,
and metadata bytes per cached block.

    python benchmarks/index_bench.py                       # table + JSON on stdout
    python benchmarks/index_bench.py --update-docs docs/benchmarks.md

Everything runs in-process on the real cache (shared-memory host tier) with a tiny KV layout,
so the figures are the index's and the hashing's, not memory bandwidth. Targets (issue 2):
lookup of a fully cached 8k-token prompt <= 150 us p50 including hashing; <= 200 bytes of
metadata per cached block.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixcache.cache import PrefixCache  # noqa: E402
from prefixcache.config import CacheConfig, HashAlgorithm, KVLayout, Namespace  # noqa: E402
from prefixcache.hashing import Hasher  # noqa: E402
from prefixcache.native import core  # noqa: E402
from prefixcache.tiers.host import HostTier  # noqa: E402

BLOCK = 16
MAX_TOKENS = 8192
VOCAB = 128_000
LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=8, block_size=BLOCK, dtype="float16")  # 512 B a block
HEADING = "## Index (benchmarks/index_bench.py)"
TARGET_LOOKUP_US = 150.0
TARGET_META_BYTES = 200.0
FULL_HIT_LABELS = {
    "u32_array": "lookup, token ids as a u32 array",
    "int64_array": "lookup, token ids as an int64 array",
    "python_list": "lookup, token ids as a Python list",
    "with_lease_and_release": "lookup with lease, then release",
    "miss_u32_array": "lookup of an uncached 8k prompt (miss)",
}


# -- workload ----------------------------------------------------------------------------
def chat_requests(conversations: int, seed: int) -> list[np.ndarray]:
    """Prompts of interleaved multi-turn chats: system prompt + history + new user turn, <= 8k tokens."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, rng.integers(200, 1200)) for _ in range(4)]
    chats = []
    for _ in range(conversations):
        history = list(systems[rng.integers(len(systems))])
        turns = []
        while len(history) < MAX_TOKENS:
            history += rng.integers(0, VOCAB, rng.integers(20, 400)).tolist()  # user turn
            turns.append(np.asarray(history[:MAX_TOKENS], dtype=np.uint32))
            history += rng.integers(0, VOCAB, rng.integers(50, 700)).tolist()  # assistant reply
        chats.append(turns)
    requests, turn = [], 0
    while any(turn < len(c) for c in chats):  # round-robin: turn k of every chat, then turn k+1
        requests += [c[turn] for c in chats if turn < len(c)]
        turn += 1
    return requests


def new_cache(slots: int) -> tuple[PrefixCache, str]:
    host = HostTier(LAYOUT, slots * LAYOUT.block_bytes)
    cache = PrefixCache(CacheConfig(host_capacity=slots * LAYOUT.block_bytes, ttl_s=3600), LAYOUT, host)
    return cache, cache.attach(Namespace("bench-model", "r1", LAYOUT))


def kv_blocks(count: int) -> torch.Tensor:
    return torch.zeros((count, *LAYOUT.block_shape), dtype=torch.float16)


def serve(cache: PrefixCache, ns: str, requests: list[np.ndarray], use_commit: bool = False) -> dict:
    """Worker-shaped loop: lookup, then store only the new full blocks. Returns latency samples (s)."""
    lookups, inserts = [], []
    kv = kv_blocks(MAX_TOKENS // BLOCK)
    for tokens in requests:
        start = time.perf_counter()
        hit = cache.lookup(ns, tokens).hit_tokens // BLOCK
        lookups.append((time.perf_counter() - start, len(tokens)))
        full = len(tokens) // BLOCK
        if full > hit:
            start = time.perf_counter()
            if use_commit:
                reservation = cache.reserve(full - hit)
                # what a same-host worker does: write the reserved slots (here, through the tier)
                cache.tiers[reservation.tier].write_many(list(reservation.slots), kv[: len(reservation.slots)])
                cache.commit(ns, tokens, reservation.id, hit)
            else:
                cache.store(ns, tokens, kv[: full - hit], hit)
            inserts.append((time.perf_counter() - start, len(tokens)))
    return {"lookup": lookups, "insert": inserts}


def percentiles(samples: list[tuple[float, int]]) -> dict:
    per_prompt = np.array([s for s, _ in samples]) * 1e6
    per_1k = np.array([s / (n / 1000) for s, n in samples]) * 1e6
    return {
        "n": len(samples),
        "p50_us": float(np.percentile(per_prompt, 50)),
        "p99_us": float(np.percentile(per_prompt, 99)),
        "p50_us_per_1k_tokens": float(np.percentile(per_1k, 50)),
        "p99_us_per_1k_tokens": float(np.percentile(per_1k, 99)),
    }


def repeat_us(call: Callable[[], object], repeats: int) -> dict:
    """Wall and thread-CPU time per call; CPU time leaves out time the thread was preempted."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time_ns()
        call()
        cpu.append(time.thread_time_ns() - start_cpu)
        wall.append(time.perf_counter() - start)
    wall_us, cpu_us = np.array(wall) * 1e6, np.array(cpu) / 1e3
    return {
        "p50_us": float(np.percentile(wall_us, 50)),
        "p99_us": float(np.percentile(wall_us, 99)),
        "min_us": float(wall_us.min()),
        "cpu_p50_us": float(np.percentile(cpu_us, 50)),
        "cpu_p99_us": float(np.percentile(cpu_us, 99)),
    }


# -- measurements ----------------------------------------------------------------------------
def bench_chat(requests: list[np.ndarray], slots: int, use_commit: bool = False) -> dict:
    cache, ns = new_cache(slots)
    try:
        samples = serve(cache, ns, requests, use_commit)
        stats = cache.stats()
        return {
            "lookup": percentiles(samples["lookup"]),
            "insert": percentiles(samples["insert"]),
            "token_hit_rate": stats.token_hit_rate,
            "blocks": stats.tiers[0].blocks,
            "evictions": sum(sum(v.values()) for v in stats.evictions.values()),
        }
    finally:
        cache.close()


def bench_full_hit(repeats: int) -> dict:
    cache, ns = new_cache(4096)
    try:
        tokens = np.random.default_rng(7).integers(0, VOCAB, MAX_TOKENS).astype(np.uint32)
        cache.store(ns, tokens, kv_blocks(MAX_TOKENS // BLOCK))
        as_list = tokens.tolist()
        as_int64 = tokens.astype(np.int64)
        assert cache.lookup(ns, tokens).hit_tokens == MAX_TOKENS
        out = {
            "u32_array": repeat_us(lambda: cache.lookup(ns, tokens), repeats),
            "int64_array": repeat_us(lambda: cache.lookup(ns, as_int64), repeats),
            "python_list": repeat_us(lambda: cache.lookup(ns, as_list), repeats),
            "with_lease_and_release": repeat_us(
                lambda: cache.release(cache.lookup(ns, tokens, take_lease=True).lease_id), repeats
            ),
        }
        miss = np.random.default_rng(8).integers(0, VOCAB, MAX_TOKENS).astype(np.uint32)
        out["miss_u32_array"] = repeat_us(lambda: cache.lookup(ns, miss), repeats)
        return out
    finally:
        cache.close()


def bench_hashing(repeats: int) -> dict:
    tokens = np.random.default_rng(9).integers(0, VOCAB, MAX_TOKENS).astype(np.uint32)
    out = {}
    for algorithm in HashAlgorithm:
        hasher = Hasher(algorithm)
        root = hasher.root(Namespace("bench-model", "r1", LAYOUT))
        timing = repeat_us(lambda h=hasher, r=root: h.block_hashes(r, tokens, BLOCK), repeats)
        seconds = timing["p50_us"] / 1e6
        out[algorithm.value] = {
            "p50_us_per_8k_prompt": timing["p50_us"],
            "mb_per_s": tokens.nbytes / seconds / 1e6,
            "blocks_per_s": (MAX_TOKENS // BLOCK) / seconds,
        }
    return out


def index_array_bytes(cache: PrefixCache) -> int:
    """Bytes of every per-block structure: index rows, block map, touch log, free lists, and any
    per-row array the cache keeps beside the index."""
    index, table = cache.index, cache.index.map
    arrays = [
        index.parent,
        index.namespace,
        index.tier,
        index.slot,
        index.tick,
        index.last_access,
        index.pins,
        index.children,
        index.tokens,
        table.cells,
        table.cell_of,
        *table.columns,
        index.log.rows,
    ]
    arrays += [a for a in vars(cache).values() if isinstance(a, np.ndarray) and len(a) == index.capacity]
    free_lists = index._free_rows.buffer_info()[1] * 4 + sum(
        f._free.buffer_info()[1] * 4 + len(f._is_free) for a in cache.placement.arenas.values() for f in a.free
    )
    return sum(a.nbytes for a in arrays) + free_lists


def bench_metadata(slots: int, seed: int) -> dict:
    """Fill a cache of `slots` blocks with chat traffic and count what its metadata costs."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache, ns = new_cache(slots)  # the host tier's payload lives in shared memory, outside tracemalloc
    try:
        kv = kv_blocks(MAX_TOKENS // BLOCK)
        while len(cache.index) < slots:
            for tokens in chat_requests(16, seed):
                hit = cache.lookup(ns, tokens).hit_tokens // BLOCK
                full = len(tokens) // BLOCK
                if full > hit:
                    cache.store(ns, tokens, kv[: full - hit], hit)
            seed += 1
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        blocks = len(cache.index)
        arrays = index_array_bytes(cache)
    finally:
        cache.close()
    return {
        "capacity_blocks": slots,
        "cached_blocks": blocks,
        "tracemalloc_bytes_per_cached_block": traced / blocks,
        "array_bytes_per_capacity_block": arrays / slots,
        "notes": "tracemalloc counts every Python and numpy allocation the cache made (index, hash "
        "table, free lists, counters, namespace table) after filling it to capacity; the "
        "payload is in shared memory and excluded. Token ids alone are 64 B of each block.",
    }


# -- report -----------------------------------------------------------------------------------
def machine() -> dict:
    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        model = found.group(1).strip() if found else model
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "xxhash": f"{xxhash.VERSION} (the core's vendored xxHash {core.XXHASH_VERSION})",
        "load_average_at_start": list(os.getloadavg()),
    }


def table(results: dict) -> str:
    chat, full, meta = results["chat"], results["full_hit_8k"], results["metadata"]
    rows = [
        ("lookup, chat prompts", chat["lookup"]),
        ("insert (store), chat prompts", chat["insert"]),
        ("insert (reserve/write/commit)", results["chat_commit"]["insert"]),
        ("lookup, cache full + evicting", results["chat_evicting"]["lookup"]),
        ("insert, cache full + evicting", results["chat_evicting"]["insert"]),
    ]
    lines = ["| measurement | p50 µs | p99 µs | p50 µs / 1k tokens | p99 µs / 1k tokens |", "|---|---:|---:|---:|---:|"]
    lines += [
        f"| {name} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p50_us_per_1k_tokens']:.1f} | "
        f"{r['p99_us_per_1k_tokens']:.1f} |"
        for name, r in rows
    ]
    lines += [
        "",
        "| fully cached 8k-token prompt (512 blocks) | p50 µs | p99 µs | CPU p50 µs | CPU p99 µs |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {FULL_HIT_LABELS[name]} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['cpu_p50_us']:.0f} | "
        f"{r['cpu_p99_us']:.0f} |"
        for name, r in full.items()
    ]
    lines += ["", "| hashing, 8k-token prompt | p50 µs | MB/s of tokens | blocks/s |", "|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {r['p50_us_per_8k_prompt']:.0f} | {r['mb_per_s']:.0f} | {r['blocks_per_s']:,.0f} |"
        for name, r in results["hashing"].items()
    ]
    lines += [
        "",
        "| metadata per cached block | bytes |",
        "|---|---:|",
        f"| tracemalloc, cache filled to {meta['cached_blocks']} blocks | "
        f"{meta['tracemalloc_bytes_per_cached_block']:.0f} |",
        f"| index + hash table + free-list arrays / capacity | {meta['array_bytes_per_capacity_block']:.0f} |",
    ]
    return "\n".join(lines)


def update_docs(path: Path, results: dict) -> None:
    m = results["machine"]
    lookup = results["full_hit_8k"]["u32_array"]["p50_us"]
    conversion = results["full_hit_8k"]["python_list"]["p50_us"] - lookup
    meta = results["metadata"]["tracemalloc_bytes_per_cached_block"]
    section = "\n".join(
        [
            HEADING,
            "",
            f"Machine: {m['cpu']}, {m['nproc']} CPUs available, Python {m['python']}, numpy {m['numpy']}, "
            f"torch {m['torch']}, xxhash {m['xxhash']}; load average at start {m['load_average_at_start'][0]:.2f} "
            "(the machine is shared; p99s are noisy).",
            "",
            f"Command: `python benchmarks/index_bench.py --update-docs docs/benchmarks.md` "
            f"({results['config']['requests']} chat requests from {results['config']['conversations']} "
            f"conversations, block size {BLOCK}, prompts up to {MAX_TOKENS} tokens).",
            "",
            table(results),
            "",
            f"Targets: fully cached 8k-token lookup ≤ {TARGET_LOOKUP_US:.0f} µs p50 including hashing — "
            f"**{lookup:.0f} µs** with token ids as a u32/int64 array (the service's input), "
            f"{'met' if lookup <= TARGET_LOOKUP_US else 'NOT met'}; a Python list adds the conversion "
            f"(~{conversion:.0f} µs through `array.array`). Metadata ≤ "
            f"{TARGET_META_BYTES:.0f} B per block — **{meta:.0f} B** (tracemalloc), "
            f"{'met' if meta <= TARGET_META_BYTES else 'NOT met'}.",
            "",
            "Where the lookup time goes: chained hashing of the 512 blocks (one call of the compiled core, "
            "`prefixcache/_core.c`; the chain is sequential by definition), then one more call that probes "
            "the block map (4-cell buckets) for every hash and verifies chain/namespace/tokens/TTL, and the "
            "touch (one call). Locations come back as two "
            "arrays (`BlockLocations`), not 512 objects. The p99 column is dominated by preemption on this "
            "shared 2-vCPU machine; the CPU-time columns leave that out.",
            "",
            "Metadata per block: token ids 64 B, digest 16 B (xxh3_128; 32 B for sha256), hash-table cells "
            "16-24 B (a power-of-two table) and the cell of each row 4 B, node arrays (parent, namespace, tier, slot, tick, last access, pins, "
            "children) 35 B, touch log "
            "8 B, the cache's per-block Redis deadline 8 B, free-list flags 1 B; tracemalloc adds what Python "
            "keeps beside the arrays. A dict of `bytes` -> `int` plus a list of hashes (the first version) was "
            "~240 B per block.",
            "",
            "Eviction reads the LRU order from an append-only touch log (`prefixcache/touchlog.py`) instead "
            "of sorting every tick: finding the next victims in a full 65k-block cache takes ~40-130 µs "
            "rather than ~5.5 ms.",
            "",
        ]
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--update-docs", type=Path)
    args = parser.parse_args(argv)
    requests = chat_requests(args.conversations, args.seed)
    working_set = sum(len(r) // BLOCK for r in requests)
    results = {
        "machine": machine(),
        "config": {"conversations": args.conversations, "requests": len(requests), "block_size": BLOCK},
    }
    results["full_hit_8k"] = bench_full_hit(args.repeats)
    results["hashing"] = bench_hashing(max(50, args.repeats // 10))
    results["chat"] = bench_chat(requests, slots=working_set)
    results["chat_commit"] = bench_chat(requests, slots=working_set, use_commit=True)
    results["chat_evicting"] = bench_chat(requests, slots=max(1024, working_set // 8))
    results["metadata"] = bench_metadata(slots=32_768, seed=args.seed + 1000)
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.update_docs:
        update_docs(args.update_docs, results)
    return results


if __name__ == "__main__":
    main()
