"""PrefixCache semantics over real tiers: exact eviction order, TTL on an injected clock, forced
hash collisions, leases and reservations, commit dedup/reject, manual eviction, stats, bad input.

Every test ends with `assert_consistent`, which checks the index, free lists, leases and
reservations against each other.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from prefixcache.errors import InvalidArgument, LayoutMismatch, ResourceExhausted, UnknownLease, UnknownNamespace
from prefixcache.hashing import BlockHash, Hasher
from prefixcache.kinds import MissReason, TierKind
from tests.support.core import (
    TINY,
    ManualClock,
    assert_consistent,
    block_hashes,
    kv_for,
    live_hashes,
    make_cache,
    namespace,
    read_blocks,
    same_bytes,
    write_reserved,
)

pytestmark = pytest.mark.unit

BS = TINY.block_size


def prompt(*block_ids: int, tail: int = 0) -> list[int]:
    """Tokens whose block i is `block_ids[i]` repeated, plus `tail` partial tokens."""
    return [b for b in block_ids for _ in range(BS)] + [9999] * tail


def store(cache, ns: str, tokens: list[int], start_block: int = 0):
    return cache.store(ns, tokens, kv_for(tokens, cache.layout, start_block), start_block)


def hit_kv(cache, ns: str, tokens: list[int]) -> torch.Tensor:
    result = cache.lookup(ns, tokens)
    return read_blocks(cache, result.locations)


class Names:
    """Labels for block hashes, so eviction order reads as names in assertions."""

    def __init__(self, cache, ns: str) -> None:
        self.cache, self.ns, self.label = cache, ns, {}

    def add(self, name: str, tokens: list[int]) -> None:
        for i, block_hash in enumerate(block_hashes(self.cache, self.ns, tokens)):
            self.label.setdefault(block_hash, f"{name}{i}")

    def evicted_by(self, action) -> list[str]:
        before = live_hashes(self.cache)
        action()
        return sorted(self.label[h] for h in before - live_hashes(self.cache))


# -- eviction order -------------------------------------------------------------------------
def test_eviction_is_leaf_first_lru_and_deeper_first_on_ties() -> None:
    clock = ManualClock()
    with make_cache(host_slots=6, clock=clock) as cache:
        ns = cache.attach(namespace())
        names = Names(cache, ns)
        a, b, c = prompt(1, 2, 3), prompt(1, 2, 4), prompt(5, 6)
        for name, tokens in (("a", a), ("b", b), ("c", c)):
            names.add(name, tokens)
        store(cache, ns, a)  # t0: a0 a1 a2
        clock.advance(1)
        assert store(cache, ns, b, 2).stored == 1  # t1: a0 a1 b2 (a0 a1 refreshed)
        clock.advance(1)
        store(cache, ns, c)  # t2: c0 c1
        clock.advance(1)
        cache.lookup(ns, a[:BS])  # t3: a hit on a0 alone
        order = []
        for k in range(6):
            clock.advance(1)
            filler = prompt(100 + k)
            names.add(f"f{k}-", filler)
            order += names.evicted_by(lambda f=filler: store(cache, ns, f))
        assert order == ["a2", "b2", "a1", "c1", "c0", "a0"]
        assert cache.stats().evictions == {"host": {"lru": 6}}
        assert_consistent(cache)


def test_a_hit_touches_its_whole_path() -> None:
    clock = ManualClock()
    with make_cache(host_slots=5, clock=clock) as cache:
        ns = cache.attach(namespace())
        names = Names(cache, ns)
        a, c = prompt(1, 2, 3), prompt(5, 6)
        names.add("a", a)
        names.add("c", c)
        store(cache, ns, a)
        clock.advance(1)
        store(cache, ns, c)
        clock.advance(1)
        assert cache.lookup(ns, a).hit_tokens == 3 * BS  # refreshes a0, a1 and a2
        order = []
        for k in range(5):
            clock.advance(1)
            filler = prompt(200 + k)
            names.add(f"f{k}-", filler)
            order += names.evicted_by(lambda f=filler: store(cache, ns, f))
        assert order == ["c1", "c0", "a2", "a1", "a0"]
        assert_consistent(cache)


def test_a_partial_hit_refreshes_only_the_matched_prefix() -> None:
    clock = ManualClock()
    with make_cache(host_slots=3, clock=clock) as cache:
        ns = cache.attach(namespace())
        names = Names(cache, ns)
        a = prompt(1, 2, 3)
        names.add("a", a)
        store(cache, ns, a)
        clock.advance(1)
        cache.lookup(ns, a[: 2 * BS])
        clock.advance(1)
        names.add("f", prompt(300))
        assert names.evicted_by(lambda: store(cache, ns, prompt(300))) == ["a2"]
        assert_consistent(cache)


# -- TTL ------------------------------------------------------------------------------------
def test_sliding_ttl_refreshes_on_hit_and_never_serves_expired_blocks() -> None:
    clock = ManualClock()
    with make_cache(host_slots=8, clock=clock, ttl_s=10) as cache:
        ns = cache.attach(namespace())
        a = prompt(1, 2)
        store(cache, ns, a)
        clock.advance(9)
        assert cache.lookup(ns, a[:BS]).hit_tokens == BS  # refreshes a0 only
        clock.advance(9)  # a0 is 9 s old, a1 18 s
        result = cache.lookup(ns, a)
        assert result.hit_tokens == BS and result.miss_reason is MissReason.EXPIRED
        assert same_bytes(read_blocks(cache, result.locations), kv_for(a)[:1])
        assert len(cache.index) == 2  # expired, not yet reclaimed
        assert cache.expire() == 1  # a1 goes, a0 (just hit) stays
        assert cache.stats().evictions == {"host": {"ttl": 1}}
        clock.advance(10.5)
        miss = cache.lookup(ns, a)
        assert miss.hit_tokens == 0 and miss.miss_reason is MissReason.EXPIRED
        assert cache.stats().miss_reasons == {"expired": 2}
        assert cache.expire() == 1 and len(cache.index) == 0
        assert cache.stats().evictions == {"host": {"ttl": 2}}
        assert_consistent(cache)


def test_storing_an_expired_prefix_again_revives_it() -> None:
    clock = ManualClock()
    with make_cache(host_slots=8, clock=clock, ttl_s=10) as cache:
        ns = cache.attach(namespace())
        a = prompt(1, 2, 3)
        store(cache, ns, a[: 2 * BS])
        clock.advance(11)
        assert cache.lookup(ns, a).hit_tokens == 0
        result = store(cache, ns, a)
        assert (result.stored, result.deduplicated, result.rejected) == (1, 2, 0)
        assert same_bytes(hit_kv(cache, ns, a), kv_for(a))
        assert_consistent(cache)


# -- collisions -------------------------------------------------------------------------------
class OneByteHasher(Hasher):
    """Test-only: one-byte digests, so colliding prompts are easy to find."""

    def digest(self, data: bytes) -> BlockHash:
        return BlockHash(hashlib.sha256(data).digest()[:1])


def colliding(cache, ns: str, target: list[int], stem: list[int]) -> list[int]:
    """A prompt `stem + [k]*...` whose last block hash equals `target`'s last block hash."""
    want = block_hashes(cache, ns, target)[-1]
    for k in range(100_000):
        candidate = stem + [k] * BS
        if candidate != target and block_hashes(cache, ns, candidate)[-1] == want:
            return candidate
    raise AssertionError("no collision found")


def test_a_colliding_block_is_a_counted_miss_and_never_replaces_the_original() -> None:
    with make_cache(host_slots=8, hasher=OneByteHasher()) as cache:
        ns = cache.attach(namespace())
        a = prompt(1)
        store(cache, ns, a)
        b = colliding(cache, ns, a, [])
        result = cache.lookup(ns, b)
        assert result.hit_tokens == 0 and result.miss_reason is MissReason.VERIFICATION_FAILED
        assert cache.stats().miss_reasons == {"verification_failed": 1}
        assert (store(cache, ns, b).rejected, len(cache.index)) == (1, 1)
        assert same_bytes(hit_kv(cache, ns, a), kv_for(a))
        assert_consistent(cache)


def test_a_collision_deep_in_a_chain_serves_only_the_verified_prefix() -> None:
    with make_cache(host_slots=8, hasher=OneByteHasher()) as cache:
        ns = cache.attach(namespace())
        a = prompt(1, 2)
        store(cache, ns, a)
        b = colliding(cache, ns, a, prompt(1))
        result = cache.lookup(ns, b)
        assert result.hit_tokens == BS and result.miss_reason is MissReason.VERIFICATION_FAILED
        assert same_bytes(read_blocks(cache, result.locations), kv_for(a)[:1])
        assert store(cache, ns, b).rejected == 1
        assert same_bytes(hit_kv(cache, ns, a), kv_for(a))
        assert_consistent(cache)


def test_namespace_ids_that_collide_are_refused() -> None:
    with make_cache(host_slots=2, hasher=OneByteHasher()) as cache:
        first = namespace(model="m0")
        cache.attach(first)
        roots = {cache.hasher.root(first)}
        for k in range(1, 5000):
            other = namespace(model=f"m{k}")
            if cache.hasher.root(other) in roots:
                with pytest.raises(InvalidArgument) as caught:
                    cache.attach(other)
                assert caught.value.field == "namespace"
                return
        raise AssertionError("no root collision found")


# -- leases and reservations -------------------------------------------------------------------
def test_a_lease_pins_its_blocks_under_pressure_until_release() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        p, q = prompt(1, 2), prompt(3, 4, 5, 6)
        store(cache, ns, p)
        leased = cache.lookup(ns, p, take_lease=True)
        assert leased.lease_id is not None and cache.stats().active_leases == 1
        squeezed = store(cache, ns, q)
        assert (squeezed.stored, squeezed.rejected) == (2, 2)
        assert same_bytes(read_blocks(cache, cache.lease(leased.lease_id).locations), kv_for(p))
        assert cache.lease(leased.lease_id).locations == leased.locations
        assert_consistent(cache)
        cache.release(leased.lease_id)
        assert (store(cache, ns, q).stored, cache.lookup(ns, p).hit_tokens) == (2, 0)
        assert same_bytes(hit_kv(cache, ns, q), kv_for(q))
        with pytest.raises(UnknownLease):
            cache.release(leased.lease_id)
        assert_consistent(cache)


def test_leases_expire_and_stop_pinning() -> None:
    clock = ManualClock()
    with make_cache(host_slots=4, clock=clock, lease_ttl_s=5) as cache:
        ns = cache.attach(namespace())
        p, q = prompt(1, 2), prompt(3, 4, 5, 6)
        store(cache, ns, p)
        lease_id = cache.lookup(ns, p, take_lease=True).lease_id
        clock.advance(5)
        with pytest.raises(UnknownLease):
            cache.lease(lease_id)
        assert store(cache, ns, q).stored == 4  # the expired lease is reclaimed to make room
        with pytest.raises(UnknownLease) as caught:
            cache.release(lease_id)
        assert caught.value.field == "lease_id"
        assert cache.stats().active_leases == 0
        assert_consistent(cache)


def test_a_miss_takes_no_lease_and_the_lease_limit_holds() -> None:
    with make_cache(host_slots=4, max_leases=2) as cache:
        ns = cache.attach(namespace())
        assert cache.lookup(ns, prompt(1), take_lease=True).lease_id is None
        store(cache, ns, prompt(1))
        leases = [cache.lookup(ns, prompt(1), take_lease=True).lease_id for _ in range(2)]
        with pytest.raises(ResourceExhausted):
            cache.lookup(ns, prompt(1), take_lease=True)
        assert_consistent(cache)
        for lease_id in leases:
            cache.release(lease_id)
        assert_consistent(cache)


def test_reservations_expire_and_return_their_slots() -> None:
    clock = ManualClock()
    with make_cache(host_slots=4, clock=clock, lease_ttl_s=5) as cache:
        ns = cache.attach(namespace())
        reservation = cache.reserve(3)
        assert len(reservation.slots) == 3 and cache.placement.used(TierKind.HOST) == 3
        clock.advance(6)
        cache.expire()
        assert cache.placement.used(TierKind.HOST) == 0
        assert reservation.id not in cache.leases  # expired: its slots went back
        with pytest.raises(InvalidArgument):
            cache.commit(ns, prompt(1, 2, 3), reservation.id, 0)
        stale = cache.reserve(3)
        clock.advance(6)
        assert len(cache.reserve(4).slots) == 4  # reclaimed under pressure, no expire() needed
        assert stale.id not in cache.leases
        assert_consistent(cache)


def test_a_half_written_reservation_is_invisible_until_commit() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2)
        reservation = cache.reserve(2)
        write_reserved(cache, reservation.id, 0, kv_for(p)[0])
        assert cache.lookup(ns, p).hit_tokens == 0
        write_reserved(cache, reservation.id, 1, kv_for(p)[1])
        assert cache.lookup(ns, p).hit_tokens == 0
        assert cache.commit(ns, p, reservation.id, 0).stored == 2
        assert same_bytes(hit_kv(cache, ns, p), kv_for(p))
        assert_consistent(cache)


# -- commit semantics ---------------------------------------------------------------------------
def test_commit_deduplicates_and_keeps_the_first_kv() -> None:
    with make_cache(host_slots=8) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2, 3)
        store(cache, ns, p)
        other = torch.zeros_like(kv_for(p))
        again = cache.store(ns, p, other)
        assert (again.stored, again.deduplicated, again.rejected) == (0, 3, 0)
        reservation = cache.reserve(2)
        for position in range(2):
            write_reserved(cache, reservation.id, position, other[position])
        result = cache.commit(ns, p, reservation.id, 1)
        assert (result.stored, result.deduplicated, result.rejected) == (0, 2, 0)
        assert same_bytes(hit_kv(cache, ns, p), kv_for(p))
        assert cache.stats().blocks_deduplicated == 5 and cache.stats().tiers[0].blocks == 3
        assert_consistent(cache)


def test_commit_extends_a_cached_prefix_and_rejects_a_gap() -> None:
    with make_cache(host_slots=8) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2, 3, 4)
        assert store(cache, ns, p[: 2 * BS]).stored == 2
        assert store(cache, ns, p, 2).stored == 2
        assert cache.lookup(ns, p).hit_tokens == 4 * BS
        q = prompt(5, 6, 7)
        gap = store(cache, ns, q, 1)
        assert (gap.stored, gap.rejected) == (0, 2)
        assert cache.lookup(ns, q).hit_tokens == 0
        assert_consistent(cache)


def test_store_never_evicts_its_own_cached_prefix_to_make_room() -> None:
    clock = ManualClock()
    with make_cache(host_slots=4, clock=clock) as cache:
        ns = cache.attach(namespace())
        a, b = prompt(1, 2), prompt(3, 4)
        store(cache, ns, a)  # the least recently used blocks...
        clock.advance(1)
        store(cache, ns, b)
        clock.advance(1)
        longer = prompt(1, 2, 5, 6)  # ...are the prefix of the next store
        result = store(cache, ns, longer)
        assert (result.stored, result.deduplicated, result.rejected) == (2, 2, 0)
        assert cache.lookup(ns, longer).hit_tokens == 4 * BS and cache.lookup(ns, b).hit_tokens == 0
        assert_consistent(cache)


def test_a_store_whose_write_fails_gives_its_slots_back_at_once() -> None:
    """store's slots are never a registered reservation: a write that raises (here into a host
    pool whose memory was released) must free them right away, not at lease expiry."""
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        tokens = prompt(1, 2)
        cache.placement.pool(TierKind.HOST).close()
        with pytest.raises(ValueError, match="dst: expected 2 dimension"):
            store(cache, ns, tokens)
        assert len(cache.placement.free(TierKind.HOST)) == 4 and len(cache.index) == 0
        assert_consistent(cache)


def test_commit_validates_its_block_range_without_leaking_slots() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        reservation = cache.reserve(2)
        with pytest.raises(InvalidArgument) as caught:
            cache.commit(ns, prompt(1, 2), reservation.id, -1)
        assert caught.value.field == "start_block"
        assert_consistent(cache)  # the reservation survived the bad call
        with pytest.raises(InvalidArgument) as caught:
            cache.commit(ns, prompt(1, 2), reservation.id, 1)
        assert caught.value.field == "start_block"
        # issue 33: a refused commit keeps its reservation (it expires with its TTL if never
        # committed), so the writer can commit the KV it wrote with the right range
        assert cache.leases.reservation(reservation.id) == reservation
        assert cache.placement.used(TierKind.HOST) == 2  # its two slots, still reserved
        assert_consistent(cache)
        assert cache.commit(ns, prompt(1, 2), reservation.id, 0).stored == 2
        assert reservation.id not in cache.leases
        assert_consistent(cache)


# -- manual eviction, flush, stats ----------------------------------------------------------------
def test_evict_by_namespace_age_and_prefix() -> None:
    clock = ManualClock()
    with make_cache(host_slots=16, clock=clock) as cache:
        ns1, ns2 = cache.attach(namespace()), cache.attach(namespace(tenant="other"))
        a, b, c = prompt(1, 2, 3), prompt(1, 2, 4), prompt(5)
        for tokens in (a, b, c):
            store(cache, ns1, tokens)
        store(cache, ns2, a)
        assert cache.evict(ns2) == 3 and cache.lookup(ns2, a).hit_tokens == 0
        assert cache.lookup(ns1, a).hit_tokens == 3 * BS
        names = Names(cache, ns1)
        for name, tokens in (("a", a), ("b", b), ("c", c)):
            names.add(name, tokens)
        assert names.evicted_by(lambda: cache.evict(ns1, prefix_tokens=a[: 2 * BS] + [7])) == ["a1", "a2", "b2"]
        clock.advance(10)
        store(cache, ns1, prompt(6))
        clock.advance(1)
        assert names.evicted_by(lambda: cache.evict(older_than_s=5)) == ["a0", "c0"]
        assert cache.lookup(ns1, prompt(6)).hit_tokens == BS
        assert cache.stats().evictions == {"host": {"manual": 8}}
        with pytest.raises(InvalidArgument) as caught:
            cache.evict(older_than_s=-1)
        assert caught.value.field == "older_than_s"
        with pytest.raises(InvalidArgument) as caught:
            cache.evict(prefix_tokens=a)
        assert caught.value.field == "namespace"
        assert_consistent(cache)


def test_flush_drops_everything_but_leased_paths() -> None:
    with make_cache(host_slots=8) as cache:
        ns = cache.attach(namespace())
        store(cache, ns, prompt(1, 2))
        store(cache, ns, prompt(1, 3))
        store(cache, ns, prompt(4))
        lease_id = cache.lookup(ns, prompt(1, 2), take_lease=True).lease_id
        assert cache.flush() == 2
        assert same_bytes(read_blocks(cache, cache.lease(lease_id).locations), kv_for(prompt(1, 2)))
        cache.release(lease_id)
        assert cache.flush() == 2 and len(cache.index) == 0
        assert cache.stats().tiers[0].blocks == 0
        assert_consistent(cache)


def test_stats_count_requests_blocks_tokens_and_reasons() -> None:
    with make_cache(host_slots=8) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2, 3, tail=2)
        store(cache, ns, p)
        cache.lookup(ns, p)  # hit: 3 blocks of 3
        cache.lookup(ns, prompt(1, 2, 3, 4))  # partial hit: 3 of 4
        cache.lookup(ns, prompt(7, 8))  # miss: 0 of 2
        cache.lookup(ns, [1, 2])  # shorter than a block
        cache.lookup(ns, [])  # empty: a miss, not an error
        s = cache.stats()
        assert (s.lookups, s.request_hits, s.request_misses) == (5, 2, 3)
        assert (s.block_hits, s.block_misses) == (6, 3)
        assert (s.token_hits, s.tokens_saved, s.tokens_looked_up) == (24, 24, 14 + 16 + 8 + 2)
        assert (s.blocks_committed, s.blocks_deduplicated, s.active_leases) == (3, 0, 0)
        assert s.miss_reasons == {"not_cached": 2, "shorter_than_block": 2}
        assert [(t.kind, t.blocks, t.bytes_used, t.capacity_bytes) for t in s.tiers] == [
            (TierKind.HOST, 3, 3 * TINY.block_bytes, 8 * TINY.block_bytes)
        ]
        assert s.remote_up is None and s.spills == {} and s.promotions == {}
        assert s.request_hit_rate == pytest.approx(2 / 5)
        assert s.token_hit_rate == pytest.approx(24 / 40)
        assert s.block_hit_rate == pytest.approx(6 / 9)
        assert_consistent(cache)


# -- bad input -----------------------------------------------------------------------------------
def test_empty_and_short_prompts_are_misses_not_errors() -> None:
    with make_cache(host_slots=2) as cache:
        ns = cache.attach(namespace())
        for tokens in ([], [5], np.array([], dtype=np.int64)):
            result = cache.lookup(ns, tokens, take_lease=True)
            assert (result.hit_tokens, result.lease_id, len(result.locations)) == (0, None, 0)
            assert result.miss_reason is MissReason.TOO_SHORT
        assert cache.store(ns, [], kv_for([])).stored == 0


@pytest.mark.parametrize("tokens", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [1.5, 0, 0, 0], ["a"], [[1, 2]]])
def test_bad_token_ids_name_the_tokens_field(tokens) -> None:
    with make_cache(host_slots=2) as cache:
        ns = cache.attach(namespace())
        for call in (
            lambda: cache.lookup(ns, tokens),
            lambda: cache.store(ns, tokens, kv_for(prompt(1))),
            lambda: cache.evict(ns, prefix_tokens=tokens),
        ):
            with pytest.raises(InvalidArgument) as caught:
                call()
            assert caught.value.field == "tokens"
        assert_consistent(cache)


def test_kv_of_the_wrong_shape_or_dtype_is_a_layout_mismatch() -> None:
    with make_cache(host_slots=4) as cache:
        ns = cache.attach(namespace())
        p = prompt(1, 2)
        good = kv_for(p)
        bad = [good.to(torch.float16), good[:, :, :1], good.reshape(2, -1), good.numpy(), good[0]]
        for kv in bad:
            with pytest.raises(LayoutMismatch):
                cache.store(ns, p, kv)
        with pytest.raises(InvalidArgument) as caught:
            cache.store(ns, p[:BS], good)  # two blocks of KV for a one-block prompt
        assert caught.value.field == "kv"
        assert len(cache.index) == 0
        assert_consistent(cache)


def test_unknown_namespace_and_foreign_layout_are_refused() -> None:
    with make_cache(host_slots=2) as cache:
        with pytest.raises(UnknownNamespace) as caught:
            cache.lookup("0123456789abcdef", prompt(1))
        assert caught.value.field == "namespace_id"
        with pytest.raises(UnknownNamespace):
            cache.store("nope", prompt(1), kv_for(prompt(1)))
        with pytest.raises(UnknownNamespace):
            cache.evict("nope")
        from dataclasses import replace

        with pytest.raises(LayoutMismatch):
            cache.attach(namespace(layout=replace(TINY, head_dim=4)))
        assert cache.attach(namespace()) == cache.attach(namespace())  # idempotent
        assert_consistent(cache)


def test_reserve_validates_its_arguments() -> None:
    with make_cache(host_slots=4) as cache:
        for count in (-1, "2", 1.0, True):
            with pytest.raises(InvalidArgument) as caught:
                cache.reserve(count)
            assert caught.value.field == "count"
        with pytest.raises(ResourceExhausted):
            cache.reserve(5)
        assert_consistent(cache)


# -- operator pins (issue 34) -----------------------------------------------------------------
def test_an_operator_pin_survives_lru_pressure_ttl_and_flush_until_unpinned() -> None:
    clock = ManualClock()
    with make_cache(host_slots=4, clock=clock, ttl_s=100, lease_ttl_s=5, max_leases=1) as cache:
        ns = cache.attach(namespace())
        p, q, r = prompt(1, 2), prompt(3, 4), prompt(5, 6, 7, 8)
        store(cache, ns, p)
        store(cache, ns, q)
        pin = cache.pin(ns, p + [9999])  # the partial tail is not a block; the two full ones are pinned
        assert len(pin.nodes) == 2 and pin.operator and pin.expires_at == float("inf")
        assert cache.stats().active_leases == 0  # not a worker's lease, not under max_leases
        leased = cache.lookup(ns, q, take_lease=True).lease_id  # the one worker lease still fits
        assert leased is not None
        cache.release(leased)
        clock.advance(6)  # past the lease TTL the pin's own lookup lease had
        squeezed = store(cache, ns, r)  # the host is full: LRU takes q's blocks, never p's
        assert (squeezed.stored, squeezed.rejected) == (2, 2)
        assert cache.lookup(ns, q).hit_tokens == 0
        clock.advance(200)  # past the block TTL: unpinned blocks expire, the pinned path does not
        cache.expire()
        cache.flush()
        assert cache.lookup(ns, p).hit_tokens == 2 * BS
        assert same_bytes(hit_kv(cache, ns, p), kv_for(p))
        assert [(n, x.id) for n, x in cache.pins()] == [(ns, pin.id)]
        with pytest.raises(UnknownLease):
            cache.release(pin.id)  # a worker's release cannot end an operator's pin
        assert_consistent(cache)
        cache.unpin(pin.id)
        assert cache.pins() == []
        assert store(cache, ns, r).stored == 4  # the pin's blocks are evictable again
        assert cache.lookup(ns, p).hit_tokens == 0
        with pytest.raises(InvalidArgument) as caught:
            cache.unpin(pin.id)
        assert caught.value.field == "pin_id"
        assert_consistent(cache)


def test_a_pin_with_a_ttl_ends_and_bad_pins_name_their_field() -> None:
    clock = ManualClock()
    with make_cache(host_slots=4, clock=clock) as cache:
        ns = cache.attach(namespace())
        p, r = prompt(1, 2), prompt(5, 6, 7, 8)
        store(cache, ns, p)
        pin = cache.pin(ns, p, ttl_s=10)
        clock.advance(9)
        assert store(cache, ns, r).stored == 2  # still pinned: only two slots free
        clock.advance(1)
        assert cache.pins() == []
        again = store(cache, ns, r)  # the expired pin is reclaimed to make room for r's last two
        assert (again.stored, again.deduplicated, cache.lookup(ns, p).hit_tokens) == (2, 2, 0)
        with pytest.raises(InvalidArgument) as caught:
            cache.unpin(pin.id)
        assert caught.value.field == "pin_id"
        for bad in (0, -1, True, "1h"):
            with pytest.raises(InvalidArgument) as caught:
                cache.pin(ns, r, ttl_s=bad)
            assert caught.value.field == "ttl_s"
        with pytest.raises(InvalidArgument) as caught:
            cache.pin(ns, prompt(42))
        assert caught.value.field == "tokens"
        assert_consistent(cache)
