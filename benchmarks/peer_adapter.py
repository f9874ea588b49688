"""prefixcache's adapter for the peers' index benchmark (`../shared/peers/radix_bench.py`).

    PYTHONHASHSEED=0 PYTHONPATH=.:benchmarks .venv/bin/python ../shared/peers/radix_bench.py \
        --all --runs 3 --peers sglang --adapter peer_adapter:Adapter

What each timed call does, through the cache's public paths (nothing is switched off):
- match: `PrefixCache.lookup` — validate the tokens, chain-hash every full block (xxh3_128, one
  call of the compiled core), probe the block map and verify parent chain, namespace, token ids
  and TTL (one more call), touch the path (LRU).
- insert: `PrefixCache.store` of the full blocks after the hit (`start_block` = hit blocks):
  match for the commit (hashing again: store is a separate call, as over the wire), reserve host
  slots, write the blocks' bytes, index them, touch the path.
- evict: the cache's own leaf-first LRU eviction (`Placement.make_room` on the host tier, the
  path every commit into a full tier takes) until `n_tokens // block_size` more slots are free.
- hash_only: the tokens' validation and block hashes, as `lookup` computes them.

The KV layout is tiny (512-byte blocks) so the figures are the index's, not memcpy; the host
tier holds every unique block of the workload, so online and warm phases never evict.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixcache.cache import PrefixCache  # noqa: E402
from prefixcache.config import CacheConfig, KVLayout, Namespace  # noqa: E402
from prefixcache.kinds import TierKind  # noqa: E402
from prefixcache.native import core  # noqa: E402
from prefixcache.tiers.host import HostTier  # noqa: E402


class Adapter:
    name = "prefixcache"

    def __init__(self, args, wstats) -> None:
        self.bs = bs = args.block_size
        layout = KVLayout(layers=1, kv_heads=1, head_dim=8, block_size=bs, dtype="float16")
        slots = int(wstats["unique_blocks"] * 1.1) + 1024
        capacity = slots * layout.block_bytes
        # Prefaulted (`--host-prefault`): inserts then pay what they pay in a cache that has run a
        # while (slots reused), not the tmpfs's zeroing of each fresh page (~9 µs a page here).
        config = CacheConfig(host_capacity=capacity, ttl_s=3600, host_prefault=True)
        self.cache = PrefixCache(config, layout, HostTier(layout, capacity, prefault=config.host_prefault))
        self.ns = self.cache.attach(Namespace("peer-bench", "r1", layout))
        longest = wstats["prompt_tokens_max"] + getattr(args, "reply_max", 0)
        self.kv = torch.zeros((longest // bs + 1, *layout.block_shape), dtype=torch.float16)
        self.info = {
            "impl": "PrefixCache.lookup / store / Placement.make_room (leaf-first LRU)",
            "core": f"prefixcache/_core.c (xxHash {core.XXHASH_VERSION})",
            "hash": "xxh3_128 chain",
            "host_slots": slots,
            "block_bytes": layout.block_bytes,
            "ttl_s": 3600,
            "host_prefault": config.host_prefault,
        }

    def prepare(self, tokens):
        return np.asarray(tokens, dtype=np.uint32)  # the service's input type (gRPC repeated uint32)

    def hash_only(self, tokens) -> int:
        return len(self.cache.namespaces.prompt(self.ns, tokens).hashes)

    def match(self, tokens):
        hit = self.cache.lookup(self.ns, tokens).hit_tokens
        return hit, hit // self.bs

    def insert(self, tokens, hit_blocks: int) -> None:
        new = len(tokens) // self.bs - hit_blocks
        if new > 0:
            self.cache.store(self.ns, tokens, self.kv[:new], hit_blocks)

    def evict(self, n_tokens: int) -> int:
        cache = self.cache
        with cache._lock:  # what commit/reserve hold around make_room
            free = cache.placement.free(TierKind.HOST)
            before = len(free)
            cache.placement.make_room(TierKind.HOST, before + n_tokens // self.bs)
            return (len(free) - before) * self.bs

    def size_tokens(self) -> int:
        return len(self.cache.index) * self.bs

    def close(self) -> None:
        self.cache.close()
