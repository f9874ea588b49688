"""Inspect: where each block of a prompt's cached prefix lives, without touching it.

Unlike a lookup this refreshes no TTL, takes no pin and counts nothing, so an
operator can look without changing what they look at.

It reads the cache's radix index without the cache's lock (the core exposes
no read-only inspection call yet), so under concurrent writes a report can be
a moment stale: a block reported resident may be evicted right after. It
never mutates anything and only reads the index's arrays, so it cannot
disturb the cache. Each step verifies the chain (parent link and token ids),
exactly like a lookup, so a hash collision is reported as a verification
failure, never as a hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixcache.cache import PrefixCache
from prefixcache.hashing import token_array
from prefixcache.index import ROOT
from prefixcache.kinds import MissReason, TierKind


@dataclass(frozen=True)
class BlockState:
    block: int  # index of the block in the prompt
    tier: TierKind
    slot: int
    ttl_left_s: float
    last_access_age_s: float
    leased: bool


@dataclass(frozen=True)
class BlockReport:
    prompt_tokens: int
    hit_tokens: int
    blocks: tuple[BlockState, ...]
    miss_reason: MissReason | None
    disk_blocks: int = 0  # past the cached prefix, held by the disk tier in a row

    @classmethod
    def empty(cls, prompt_tokens: int, block_size: int) -> BlockReport:
        """The report of a namespace that holds nothing."""
        reason = (
            None
            if prompt_tokens == 0
            else (MissReason.TOO_SHORT if prompt_tokens < block_size else MissReason.NOT_CACHED)
        )
        return cls(prompt_tokens, 0, (), reason)


def inspect_prefix(cache: PrefixCache, ns_id: str, tokens: np.ndarray) -> BlockReport:
    """Residency of the longest cached prefix of `tokens` in namespace `ns_id`."""
    namespace = cache.namespace(ns_id)
    array = token_array(tokens)
    size = cache.layout.block_size
    full = len(array) // size
    blocks = array[: full * size].reshape(full, size)
    hashes = cache.hasher.block_hashes(cache.hasher.root(namespace), array, size)
    index, now, ttl = cache.index, cache.clock(), cache.config.ttl_s
    states: list[BlockState] = []
    stop: MissReason | None = MissReason.TOO_SHORT if full == 0 and len(array) else None
    parent = ROOT
    for i, block_hash in enumerate(hashes):
        node = index.node_of(block_hash)
        if node is None:
            stop = MissReason.NOT_CACHED
            break
        tier = int(index.tier[node])
        if tier < 0 or int(index.parent[node]) != parent or not np.array_equal(index.tokens[node], blocks[i]):
            stop = MissReason.VERIFICATION_FAILED
            break
        last_access = float(index.last_access[node])
        kept = ttl + float(index.extra_ttl[node])  # a retention hint's extra time counts
        if last_access + kept < now:
            stop = MissReason.EXPIRED
            break
        states.append(
            BlockState(
                i,
                TierKind(tier),
                int(index.slot[node]),
                last_access + kept - now,
                now - last_access,
                bool(index.pins[node] > 0),
            )
        )
        parent = node
    disk = 0
    if cache.disk is not None and stop is MissReason.NOT_CACHED:
        disk = cache.disk.held_run(ns_id, hashes[len(states) :])
    return BlockReport(len(array), len(states) * size, tuple(states), stop, disk)
