"""Match (`PrefixCache.match`), the router's question: it agrees with a lookup on the hit and
leaves no trace (no lease, no TTL refresh, no count, no promotion), and it is fast."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.config import KVLayout
from prefixcache.kinds import MissReason, TierKind
from tests.support.core import TINY, ManualClock, kv_for, make_cache, namespace

pytestmark = pytest.mark.unit

BS = TINY.block_size


def blocks_of(ids: list[int], tail: int = 0) -> list[int]:
    return [b for b in ids for _ in range(BS)] + [7777] * tail


def tiers_of(cache, ns: str, tokens: list[int], tiers: np.ndarray) -> dict[TierKind, int]:
    """Blocks per tier of the index's own match of `tokens` (what a lookup would find)."""
    prompt = cache.namespaces.prompt(ns, tokens)
    rows = cache.index.match(prompt.entry.index, prompt.hashes, prompt.blocks, cache.clock(), cache.config.ttl_s).rows
    kinds, counts = np.unique(tiers[rows], return_counts=True)
    return {TierKind(int(k)): int(n) for k, n in zip(kinds, counts, strict=True)}


prompts = st.lists(st.integers(1, 4), min_size=0, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stored=st.lists(prompts, min_size=1, max_size=5),
    probes=st.lists(st.tuples(prompts, st.integers(0, BS - 1)), min_size=1, max_size=4),
    ages=st.lists(st.sampled_from([0.0, 2.0, 7.0]), min_size=5, max_size=5),
)
def test_match_agrees_with_lookup_and_leaves_no_trace(stored, probes, ages) -> None:
    clock = ManualClock()
    # Small tiers (device 3 blocks, host 6) so stores evict and spill; a TTL that some ages pass.
    with make_cache(host_slots=6, device_slots=3, clock=clock, ttl_s=10.0) as cache:
        ns = cache.attach(namespace())
        for ids, age in zip(stored, ages, strict=False):
            tokens = blocks_of(ids)
            if ids:
                cache.store(ns, tokens, kv_for(tokens, cache.layout))
            clock.advance(age)
        for ids, tail in probes:
            tokens = blocks_of(ids, tail)
            ticks, lookups = cache.index.last_access.copy(), cache.counters.lookups
            tier_before, pins = cache.index.tier.copy(), cache.index.pins.copy()
            matched = cache.match(ns, tokens)
            assert np.array_equal(cache.index.last_access, ticks)  # no TTL refresh
            assert np.array_equal(cache.index.tier, tier_before)  # no promotion
            assert np.array_equal(cache.index.pins, pins)  # no pin
            assert cache.counters.lookups == lookups and cache.leases.lease_count() == 0
            looked = cache.lookup(ns, tokens, take_lease=True)
            assert matched.hit_tokens == looked.hit_tokens
            assert matched.miss_reason == looked.miss_reason
            assert matched.prompt_tokens == len(tokens)
            assert matched.blocks == tiers_of(cache, ns, tokens, tier_before)
            assert matched.remote_blocks == 0  # no Redis tier
            if looked.lease_id is not None:
                cache.release(looked.lease_id)


def test_match_of_a_short_or_empty_prompt_is_too_short() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        for tokens in ([], [1] * (BS - 1)):
            matched = cache.match(ns, tokens)
            assert (matched.hit_tokens, matched.blocks, matched.miss_reason) == (0, {}, MissReason.TOO_SHORT)


def test_match_of_8k_tokens_takes_well_under_a_millisecond() -> None:
    """8192 tokens in blocks of 16 (512 blocks), all cached: hash + probe + verify in one call."""
    layout = KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=16, dtype="float16")
    tokens = list(range(8192))
    with make_cache(host_slots=600, layout=layout) as cache:
        ns = cache.attach(namespace(layout))
        cache.store(ns, tokens, kv_for(tokens, layout))
        assert cache.match(ns, tokens).blocks == {TierKind.HOST: 512}
        array = np.asarray(tokens, dtype=np.int64)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            cache.match(ns, array)
            times.append(time.perf_counter() - start)
    p50 = float(np.median(times))
    print(f"match of 8192 tokens: p50 {p50 * 1e6:.0f} us, min {min(times) * 1e6:.0f} us")
    assert p50 < 1e-3, p50
