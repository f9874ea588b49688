"""Arena benchmark: what chunked slot tiers (tiers/arena.py) cost one layout, and what sharing costs.

    python benchmarks/arena_bench.py --baseline-tree /tmp/prefixcache-base   # before/after, one run
    python benchmarks/arena_bench.py                                          # this tree only

In-process, on the real cache (shared-memory host tier, 16384 slots of a 512-byte layout, so
the figures are the index's and placement's, not memory bandwidth). Measured per tree:
- lookup: a fully cached 8k-token prompt (hashing included), p50 over `--repeats`;
- commit: reserve + write + commit of a new 1024-token prompt (64 blocks) into a full cache, so
  every commit makes room by LRU eviction first; p50.
With `--baseline-tree` (an export of the commit before arenas, e.g. `git archive <commit> | tar
-x -C DIR`), each measurement runs in child processes alternating between the two trees, three
rounds each, and the table gives the best-of-rounds p50s and after/before ratios. This tree
also measures two layouts sharing the budget: commits of layout B (1 KiB blocks) while layout A
fills the cache and is least recently used, so each of B's commits may empty a chunk of A's.
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SLOTS = 16384
BLOCK = 16


def child(repeats: int, shared: bool) -> dict[str, float]:
    import numpy as np
    import torch

    from prefixcache.cache import PrefixCache
    from prefixcache.config import CacheConfig, KVLayout, Namespace
    from prefixcache.kinds import TierKind
    from prefixcache.tiers.host import HostTier

    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, block_size=BLOCK, dtype="float16")  # 512 B
    capacity = SLOTS * layout.block_bytes
    cache = PrefixCache(CacheConfig(host_capacity=capacity, ttl_s=3600), layout, HostTier(layout, capacity))
    rng = np.random.default_rng(1)
    ns = cache.attach(Namespace("bench", "r", layout))
    results: dict[str, float] = {}

    def commit(ns_id: str, tokens: np.ndarray, kv: torch.Tensor) -> None:
        reservation = cache.reserve(len(kv), ns_id)
        pool = cache.tiers[TierKind.HOST] if ns_id == ns else cache.pool(TierKind.HOST, ns_id)
        pool.write_many(list(reservation.slots), kv[: len(reservation.slots)])
        cache.commit(ns_id, tokens, reservation.id, 0)

    def p50_us(samples: list[float]) -> float:
        return float(np.percentile(samples, 50) * 1e6)

    kv64 = torch.zeros((64, *layout.block_shape), dtype=layout.dtype.torch)
    for _ in range(SLOTS // 64 + 8):  # full, and evicting
        commit(ns, rng.integers(0, 128_000, 64 * BLOCK).astype(np.uint32), kv64)
    long = rng.integers(0, 128_000, 8192).astype(np.uint32)
    commit(ns, long[: 512 * BLOCK], torch.zeros((512, *layout.block_shape), dtype=layout.dtype.torch))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        hit = cache.lookup(ns, long)
        times.append(time.perf_counter() - started)
    assert hit.hit_tokens == 8192
    results["lookup_8k_us"] = p50_us(times)
    times = []
    for _ in range(max(50, repeats // 10)):
        tokens = rng.integers(0, 128_000, 64 * BLOCK).astype(np.uint32)
        started = time.perf_counter()
        commit(ns, tokens, kv64)
        times.append(time.perf_counter() - started)
        cache.lookup(ns, long)  # keep the long prompt recent
    results["commit_64_blocks_us"] = p50_us(times)
    if shared:
        other = KVLayout(layers=1, kv_heads=1, head_dim=16, block_size=BLOCK, dtype="float16")  # 1 KiB
        ns_b = cache.attach(Namespace("bench-b", "r", other))
        kv_b = torch.zeros((64, *other.block_shape), dtype=other.dtype.torch)
        times = []
        for _ in range(max(50, repeats // 10)):
            for _busy in range(2):  # A stays busy, so B's LRU victims are A's oldest
                commit(ns, rng.integers(0, 128_000, 64 * BLOCK).astype(np.uint32), kv64)
            tokens = rng.integers(0, 128_000, 64 * BLOCK).astype(np.uint32)
            started = time.perf_counter()
            commit(ns_b, tokens, kv_b)
            times.append(time.perf_counter() - started)
        results["commit_64_blocks_other_layout_us"] = p50_us(times)
        results["commit_64_blocks_other_layout_max_us"] = float(max(times) * 1e6)
        results["chunk_bytes"] = float(cache.tiers[TierKind.HOST].arena.chunk_bytes)
    cache.close()
    return results


def run_tree(tree: Path, repeats: int, shared: bool) -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "from arena_bench import child; print(json.dumps(child(int(sys.argv[3]), sys.argv[4] == '1')))"
    )
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tree), str(HERE / "benchmarks"), str(repeats), "1" if shared else "0"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-tree", type=Path, default=None, help="an export of the tree before arenas")
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"after": HERE} | ({"before": args.baseline_tree} if args.baseline_tree else {})
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            figures = run_tree(tree, args.repeats, shared=name == "after")
            for key, value in figures.items():
                keep = best.setdefault(name, {})
                keep[key] = min(keep.get(key, float("inf")), value)
    rows = []
    for key in best["after"]:
        after = best["after"][key]
        before = best.get("before", {}).get(key)
        ratio = f"{after / before:.2f}" if before else ""
        rows.append((key, f"{before:.1f}" if before else "", f"{after:.1f}", ratio))
    print(f"{'figure':40} {'before':>10} {'after':>10} {'after/before':>13}")
    for row in rows:
        print(f"{row[0]:40} {row[1]:>10} {row[2]:>10} {row[3]:>13}")
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), **best}))


if __name__ == "__main__":
    main()
