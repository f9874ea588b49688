"""Namespaces of different KV layouts in one cache: the chunked arenas of the slot tiers.

Three layouts of different block bytes (64, 128 and 48 bytes; the last one smaller than the
first, so its chunks are only partly used) share one byte budget per tier. Checked here: the
arena's own bookkeeping, that a layout takes another's room when the other is least recently
used (and only then), that pinned blocks and reservations keep their chunks, that dropping a
chunk keeps every cached prefix contiguous from the root, that quotas count bytes, and a
stateful property run interleaving every operation over the three layouts
(`assert_consistent`: no slot owned twice, no more bytes held than the budget, prefix closure).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, KVLayout, TenantQuota, TenantQuotas
from prefixcache.errors import LayoutMismatch, UnknownLease
from prefixcache.kinds import EvictionReason, TierKind
from prefixcache.tiers.arena import Arena, chunk_bytes_for
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.host import HostTier
from tests.support.core import ManualClock, assert_consistent, kv_for, namespace, read_blocks, same_bytes

pytestmark = pytest.mark.unit

A = KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=4, dtype="float32")  # 64 bytes a block
B = KVLayout(layers=2, kv_heads=1, head_dim=2, block_size=4, dtype="float32")  # 128
C = KVLayout(layers=1, kv_heads=1, head_dim=3, block_size=4, dtype="float16")  # 48: below A's, chunks part-used
CHUNK = 256  # A: 4 blocks a chunk, B: 2, C: 4 (capped by A's block, the minimum)
HOST = TierKind.HOST
DEVICE = TierKind.DEVICE


@contextmanager
def shared_cache(
    host_chunks: int = 8, device_chunks: int = 0, clock: ManualClock | None = None, **config
) -> Iterator[PrefixCache]:
    host = HostTier(A, host_chunks * CHUNK, chunk_bytes=CHUNK)
    device = DeviceTier(A, device_chunks * CHUNK, device="cpu", chunk_bytes=CHUNK) if device_chunks else None
    cache = PrefixCache(
        CacheConfig(host_capacity=host_chunks * CHUNK, device_capacity=device_chunks * CHUNK, **config),
        A,
        host,
        device,
        clock=clock or ManualClock(),
    )
    try:
        yield cache
    finally:
        cache.close()


def tokens_of(n: int, blocks: int) -> list[int]:
    """A prompt of `blocks` full blocks, distinct for each `n` from its first token on."""
    return [n * 1000 + i for i in range(blocks * 4)]


def hit_blocks(cache: PrefixCache, ns: str, tokens: list[int]) -> int:
    return cache.lookup(ns, tokens).hit_tokens // 4


def owners(cache: PrefixCache, kind: TierKind = HOST) -> list[int]:
    return cache.placement.arenas[kind].owner.tolist()


# ---- the arena alone ------------------------------------------------------------------------


def test_the_first_layout_owns_every_chunk_and_a_chunk_changes_hands_only_empty() -> None:
    arena = Arena(HOST, torch.zeros(5 * CHUNK + 100, dtype=torch.uint8), CHUNK, A.block_bytes)
    first, second = arena.add_layout(A), arena.add_layout(B)
    assert arena.owner.tolist() == [0] * 6 and arena.max_slots == (5 * CHUNK + 100) // A.block_bytes
    assert first.num_slots == 5 * 4 + 1 and first.tiled  # the short last chunk holds one block of A
    assert len(arena.free[0]) == first.num_slots and len(arena.free[1]) == 0
    taken = arena.free[0].take_many(4)  # chunk 0
    assert taken == (0, 1, 2, 3)
    with pytest.raises(RuntimeError):
        arena.give_chunk(0, 1)  # held: never handed over
    assert arena.take_empty_chunk(1) and arena.owner.tolist()[:2] == [0, 1]
    assert list(arena.free[1].take_many(2)) == [2, 3]  # chunk 1 of B: its slots 2 and 3
    assert second.offset(3) == CHUNK + B.block_bytes
    assert arena.used(0) == 4 and arena.used(1) == 2
    assert arena.used_bytes() == 4 * A.block_bytes + 2 * B.block_bytes
    with pytest.raises(LayoutMismatch, match="chunk"):
        arena.per_chunk(KVLayout(layers=4, kv_heads=1, head_dim=4, block_size=4, dtype="float32"))  # 512 B


def test_default_chunk_size_is_whole_blocks_of_the_first_layout() -> None:
    assert chunk_bytes_for(1 << 30, 3840) == (64 << 20) // 3840 * 3840
    assert chunk_bytes_for(40 * 64, 64) == 10 * 64  # a quarter of a small budget
    assert chunk_bytes_for(64, 64) == 64
    assert chunk_bytes_for(1 << 30, 64, wanted=4096) == 4096


def test_a_smaller_layout_gets_the_minimum_blocks_slots_per_chunk_at_its_own_addresses() -> None:
    with shared_cache() as cache:
        ns_c = cache.attach(namespace(C))
        pool = cache.pool(HOST, ns_c)
        assert (pool.per_chunk, pool.tiled) == (4, False)  # 4 x 48 bytes in a 256-byte chunk
        cache.flush()
        tokens = tokens_of(1, 6)  # six blocks of C: two chunks
        assert cache.store(ns_c, tokens, kv_for(tokens, C)).stored == 6
        hit = cache.lookup(ns_c, tokens, take_lease=True)
        assert same_bytes(read_blocks(cache, hit.locations, ns_c), kv_for(tokens, C))
        slot = int(hit.locations.slots[5])
        assert slot // 4 != 0 and pool.offset(slot) == (slot // 4) * CHUNK + (slot % 4) * C.block_bytes
        raw = cache.tiers[HOST].arena.data[pool.offset(slot) : pool.offset(slot) + C.block_bytes]
        assert torch.equal(raw, kv_for(tokens, C)[5].contiguous().view(torch.uint8).reshape(-1))
        assert_consistent(cache)


# ---- eviction across layouts ----------------------------------------------------------------


def test_a_layout_takes_the_room_of_the_least_recently_used_layout() -> None:
    clock = ManualClock()
    with shared_cache(clock=clock) as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        prompts = [tokens_of(n, 4) for n in range(8)]  # one chunk of A each
        for tokens in prompts:
            assert cache.store(ns_a, tokens, kv_for(tokens, A)).stored == 4
        assert owners(cache) == [0] * 8 and cache.stats().tiers[0].bytes_used == 8 * CHUNK
        for n in (0, 1, 2, 4, 5, 6, 7):  # prompt 3 is now the least recently used
            clock.advance(1)
            assert hit_blocks(cache, ns_a, prompts[n]) == 4
        b_tokens = tokens_of(100, 2)
        assert cache.store(ns_b, b_tokens, kv_for(b_tokens, B)).stored == 2  # one chunk of B
        assert hit_blocks(cache, ns_a, prompts[3]) == 0  # its chunk went to B
        assert all(hit_blocks(cache, ns_a, prompts[n]) == 4 for n in (0, 1, 2, 4, 5, 6, 7))
        assert owners(cache).count(1) == 1
        hit = cache.lookup(ns_b, b_tokens, take_lease=True)
        assert hit.hit_tokens == 8 and same_bytes(read_blocks(cache, hit.locations, ns_b), kv_for(b_tokens, B))
        cache.release(hit.lease_id)
        stats = cache.stats()
        assert stats.tiers[0].bytes_used == 7 * CHUNK + 2 * B.block_bytes <= stats.tiers[0].capacity_bytes
        assert stats.evictions[HOST.label][EvictionReason.LRU.value] == 4
        assert_consistent(cache)
        # Now B's blocks are the oldest: A's next prompt takes B's chunk back, not another A's.
        clock.advance(1)
        for n in range(8):
            if n != 3:
                assert hit_blocks(cache, ns_a, prompts[n]) == 4
        again = tokens_of(50, 4)
        assert cache.store(ns_a, again, kv_for(again, A)).stored == 4
        assert hit_blocks(cache, ns_b, b_tokens) == 0 and owners(cache) == [0] * 8
        assert_consistent(cache)


def test_a_layout_evicts_its_own_lru_blocks_before_a_more_recent_layouts_chunk() -> None:
    clock = ManualClock()
    with shared_cache(clock=clock) as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        old_a = [tokens_of(n, 4) for n in range(4)]
        for tokens in old_a:
            cache.store(ns_a, tokens, kv_for(tokens, A))
        clock.advance(1)
        b_prompts = [tokens_of(100 + n, 2) for n in range(4)]
        for tokens in b_prompts:
            assert cache.store(ns_b, tokens, kv_for(tokens, B)).stored == 2
        assert owners(cache).count(1) == 4  # B took the four empty chunks
        clock.advance(1)
        new = tokens_of(9, 4)
        cache.store(ns_a, new, kv_for(new, A))  # the LRU blocks are A's own: no chunk changes hands
        assert owners(cache).count(1) == 4
        assert all(hit_blocks(cache, ns_b, tokens) == 2 for tokens in b_prompts)
        assert sum(hit_blocks(cache, ns_a, tokens) == 4 for tokens in old_a) == 3
        assert_consistent(cache)


def test_pinned_blocks_and_reservations_keep_their_chunks() -> None:
    clock = ManualClock()
    with shared_cache(host_chunks=4, clock=clock) as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        prompts = [tokens_of(n, 4) for n in range(4)]
        for tokens in prompts:
            cache.store(ns_a, tokens, kv_for(tokens, A))
        leased = cache.lookup(ns_a, prompts[0], take_lease=True)  # the LRU chunk, pinned
        clock.advance(1)
        for tokens in prompts[2:]:
            cache.lookup(ns_a, tokens)
        reservation = cache.reserve(4, ns_a)  # A has no free slot: prompt 1's chunk goes, to A itself
        assert len(reservation.slots) == 4 and hit_blocks(cache, ns_a, prompts[1]) == 0
        b_tokens = tokens_of(100, 2)
        assert cache.store(ns_b, b_tokens, kv_for(b_tokens, B)).stored == 2
        # Not the leased chunk, not the reserved one: B took the least recent other (prompt 2's).
        assert hit_blocks(cache, ns_a, prompts[2]) == 0 and hit_blocks(cache, ns_a, prompts[3]) == 4
        assert cache.lease(leased.lease_id).locations == leased.locations
        assert same_bytes(read_blocks(cache, leased.locations, ns_a), kv_for(prompts[0], A))
        chunks = cache.placement.arenas[HOST].chunks_of(0, np.asarray(reservation.slots))
        assert set(owners(cache)[c] for c in chunks.tolist()) == {0}
        assert_consistent(cache)
        cache.release(leased.lease_id)
        everything = tokens_of(200, 8)  # four chunks of B: only what nothing holds can go
        result = cache.store(ns_b, everything, kv_for(everything, B))
        assert result.stored == 6 and result.rejected == 2  # the reserved chunk stays A's
        assert_consistent(cache)


def test_emptying_a_chunk_drops_what_depends_on_it_so_prefixes_stay_contiguous() -> None:
    clock = ManualClock()
    with shared_cache(host_chunks=3, clock=clock) as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        lone = tokens_of(9, 1)
        cache.store(ns_a, lone, kv_for(lone, A))  # slot 0, the least recently used block
        clock.advance(1)
        root = tokens_of(1, 3)
        cache.store(ns_a, root, kv_for(root, A))  # slots 1..3: chunk 0 = [lone, root x 3]
        clock.advance(1)
        longer = root + tokens_of(2, 4)
        cache.store(ns_a, longer, kv_for(longer, A))  # its new blocks in chunk 1, below chunk 0's
        clock.advance(1)
        other = tokens_of(3, 4)
        cache.store(ns_a, other, kv_for(other, A))  # chunk 2
        # B's LRU victim is `lone`, in chunk 0: emptying it drops `root`, so `longer`'s blocks in
        # chunk 1 (which depend on it) go too; nothing stays cached below a dropped block.
        b_tokens = tokens_of(100, 2)
        assert cache.store(ns_b, b_tokens, kv_for(b_tokens, B)).stored == 2
        assert owners(cache) == [1, 0, 0]
        assert cache.placement.arenas[HOST].holds_nothing(1)
        assert hit_blocks(cache, ns_a, longer) == 0 and hit_blocks(cache, ns_a, other) == 4
        assert cache.stats().evictions[HOST.label][EvictionReason.LRU.value] == 8
        assert_consistent(cache)


def test_the_device_tier_moves_another_layouts_chunk_down_to_make_room() -> None:
    clock = ManualClock()
    with shared_cache(host_chunks=8, device_chunks=2, clock=clock) as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        a_prompts = [tokens_of(n, 4) for n in range(2)]
        for tokens in a_prompts:
            cache.store(ns_a, tokens, kv_for(tokens, A))
            clock.advance(1)
            cache.lookup(ns_a, tokens)  # promoted: the device holds both, one chunk each
        assert owners(cache, DEVICE) == [0, 0] and cache.stats().tiers[0].blocks == 8
        b_tokens = tokens_of(100, 2)
        cache.store(ns_b, b_tokens, kv_for(b_tokens, B))
        clock.advance(1)
        hit = cache.lookup(ns_b, b_tokens, take_lease=True)  # promotion takes A's LRU device chunk
        assert owners(cache, DEVICE).count(1) == 1 and set(hit.locations.tiers.tolist()) == {int(DEVICE)}
        assert same_bytes(read_blocks(cache, hit.locations, ns_b), kv_for(b_tokens, B))
        cache.release(hit.lease_id)
        for tokens in a_prompts:  # A's evicted chunk moved down to the host tier: still a hit
            again = cache.lookup(ns_a, tokens, take_lease=True)
            assert again.hit_tokens == 16 and same_bytes(read_blocks(cache, again.locations, ns_a), kv_for(tokens, A))
            cache.release(again.lease_id)
        assert_consistent(cache)


def test_quotas_count_bytes_across_a_tenants_layouts() -> None:
    quotas = TenantQuotas(overrides=(("t", TenantQuota(host=4 * B.block_bytes)),))
    with shared_cache(tenant_quotas=quotas) as cache:
        ns_a = cache.attach(namespace(A, "model-a", tenant="t"))
        ns_b = cache.attach(namespace(B, "model-b", tenant="t"))
        b_tokens = tokens_of(1, 4)
        assert cache.store(ns_b, b_tokens, kv_for(b_tokens, B)).stored == 4  # 512 bytes: the quota
        a_tokens = tokens_of(2, 2)
        assert cache.store(ns_a, a_tokens, kv_for(a_tokens, A)).stored == 2  # 128 bytes: one B block goes
        assert cache.ledger.usage("t", HOST) == 3 * B.block_bytes + 2 * A.block_bytes <= 4 * B.block_bytes
        stats = cache.stats("t")
        assert stats.evictions[HOST.label][EvictionReason.CAPACITY.value] == 1
        assert (stats.tiers[0].bytes_used, stats.tiers[0].capacity_bytes) == (
            3 * B.block_bytes + 2 * A.block_bytes,
            4 * B.block_bytes,
        )
        assert hit_blocks(cache, ns_b, b_tokens) == 3 and hit_blocks(cache, ns_a, a_tokens) == 2
        assert len(cache.reserve(4, ns_a).slots) == 4  # 256 bytes more: two more of B's blocks go
        assert cache.ledger.usage("t", HOST) == 4 * B.block_bytes
        assert cache.stats("t").evictions[HOST.label][EvictionReason.CAPACITY.value] == 3
        assert hit_blocks(cache, ns_b, b_tokens) == 1
        assert_consistent(cache)


def test_a_reservation_commits_only_into_its_own_layout() -> None:
    with shared_cache() as cache:
        ns_a, ns_b = cache.attach(namespace(A, "model-a")), cache.attach(namespace(B, "model-b"))
        reservation = cache.reserve(2, ns_a)
        from prefixcache.errors import InvalidArgument

        with pytest.raises(InvalidArgument, match="layout"):
            cache.commit(ns_b, tokens_of(1, 2), reservation.id, 0)
        assert cache.leases.reservation(reservation.id) is not None  # untouched, still A's
        with pytest.raises(LayoutMismatch, match="block_size"):
            cache.attach(namespace(KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=8, dtype="float32")))
        assert_consistent(cache)


# ---- stateful: three layouts interleaved -----------------------------------------------------

LAYOUTS = (A, B, C)


class SharedArenas(RuleBasedStateMachine):
    """Store, lookup, lease, release, reserve/commit, evict and expire across three layouts."""

    @initialize(device=st.booleans())
    def start(self, device: bool) -> None:
        self.clock = ManualClock()
        self.context = shared_cache(host_chunks=6, device_chunks=2 if device else 0, clock=self.clock, ttl_s=20.0)
        self.cache = self.context.__enter__()
        self.ns = [self.cache.attach(namespace(layout, f"model-{i}")) for i, layout in enumerate(LAYOUTS)]
        self.leases: list[tuple[int, int, list[int], object, torch.Tensor]] = []  # (id, layout, tokens, locations, kv)
        self.reservations: list[tuple[int, int]] = []

    def teardown(self) -> None:
        if hasattr(self, "context"):
            self.context.__exit__(None, None, None)

    @rule(which=st.integers(0, 2), family=st.integers(0, 3), blocks=st.integers(1, 6))
    def store(self, which: int, family: int, blocks: int) -> None:
        tokens = tokens_of(family, blocks)
        result = self.cache.store(self.ns[which], tokens, kv_for(tokens, LAYOUTS[which]))
        assert result.stored + result.deduplicated + result.rejected == blocks

    @rule(which=st.integers(0, 2), family=st.integers(0, 3), blocks=st.integers(1, 6), lease=st.booleans())
    def lookup(self, which: int, family: int, blocks: int, lease: bool) -> None:
        tokens = tokens_of(family, blocks)
        hit = self.cache.lookup(self.ns[which], tokens, take_lease=lease)
        count = hit.hit_tokens // 4
        kv = read_blocks(self.cache, hit.locations, self.ns[which])
        assert same_bytes(kv, kv_for(tokens[: count * 4], LAYOUTS[which]))
        if hit.lease_id is not None:
            self.leases.append((hit.lease_id, which, tokens, hit.locations, kv))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.leases:
            lease_id, *_ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
            try:
                self.cache.release(lease_id)
            except UnknownLease:
                pass

    @rule(which=st.integers(0, 2), count=st.integers(1, 4))
    def reserve(self, which: int, count: int) -> None:
        reservation = self.cache.reserve(count, self.ns[which])
        self.reservations.append((reservation.id, which))

    @rule(data=st.data(), family=st.integers(0, 3))
    def commit(self, data: st.DataObject, family: int) -> None:
        if not self.reservations:
            return
        reservation_id, which = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        reservation = self.cache.leases.reservation(reservation_id)
        if reservation is None:
            return
        tokens = tokens_of(family, len(reservation.slots))
        kv = kv_for(tokens, LAYOUTS[which])
        pool = self.cache.placement.pool(reservation.tier, reservation.layout)
        for i, slot in enumerate(reservation.slots):
            pool.write(slot, kv[i])
        self.cache.commit(self.ns[which], tokens, reservation_id, 0)

    @rule(which=st.integers(0, 2))
    def evict_namespace(self, which: int) -> None:
        self.cache.evict(self.ns[which])

    @rule(seconds=st.sampled_from([1.0, 5.0, 25.0]))
    def expire(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.cache.expire()
        live = []
        for entry in self.leases:
            try:
                self.cache.lease(entry[0])
                live.append(entry)
            except UnknownLease:
                pass
        self.leases = live

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            assert_consistent(self.cache)

    @invariant()
    def leased_blocks_never_move(self) -> None:
        for lease_id, which, _tokens, locations, kv in getattr(self, "leases", []):
            try:
                now = self.cache.lease(lease_id)
            except UnknownLease:
                continue  # expired (its pins went with it)
            assert now.locations == locations
            assert same_bytes(read_blocks(self.cache, locations, self.ns[which]), kv)


SharedArenas.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_shared_arenas = SharedArenas.TestCase
