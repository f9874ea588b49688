"""Stateful property test: the cache (small host + small cpu device tier) against a plain model.

The model remembers every prefix the cache ever accepted (a cache may forget, never invent) and
the KV of a block is a pure function of (namespace, prefix). After any sequence of store, lookup
(with or without a lease), release, manual evict, expire (after moving the injected clock) and
flush:
- every hit returns exactly the KV of that prefix (compared as bytes), in the right namespace;
- every hit block is a prefix the model saw stored, and the hit length equals a scalar re-walk of
  the chain that skips expired blocks (so nothing expired is served);
- a leased path stays readable byte-exact until it is released or its lease runs out;
- capacities hold, prefix closure holds, and every slot is free, reserved or owned by exactly
  one block (`assert_consistent`).

Runs under the "stateful-ci" profile by default (about 10 s); set PREFIXCACHE_STATEFUL_PROFILE=
stateful-long for a deeper search.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, DType, KVLayout
from prefixcache.errors import ResourceExhausted, UnknownLease
from prefixcache.tiers.device import DeviceTier
from prefixcache.tiers.host import HostTier
from prefixcache.touchlog import TouchLog
from tests.support.core import ManualClock, assert_consistent, block_hashes, kv_for, namespace, read_blocks, same_bytes

pytestmark = pytest.mark.slow

TTL_S = 10.0
LEASE_TTL_S = 4.0

settings.register_profile(
    "stateful-ci",
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "stateful-long",
    max_examples=1500,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# A tiny alphabet, so fresh prompts share prefixes too; at least one block (block_size <= 4).
FRESH = st.lists(st.integers(0, 2), min_size=4, max_size=9)
TURN = st.lists(st.integers(0, 2), min_size=1, max_size=8)
NAMESPACE = st.sampled_from([0, 0, 1])


@dataclass(frozen=True)
class HeldLease:
    namespace: int
    expires_at: float
    kv: torch.Tensor


class CacheMachine(RuleBasedStateMachine):
    """Prompts live in a bundle: rules reuse them and `extend` grows them turn by turn, so
    stores and lookups keep meeting cached prefixes (dedup, extension, shared parents)."""

    cache: PrefixCache | None = None
    prompts = Bundle("prompts")

    @initialize(
        block_size=st.integers(2, 4),
        host_slots=st.integers(3, 6),
        device_slots=st.integers(0, 2),
        dtype=st.sampled_from(list(DType)),
    )
    def build(self, block_size: int, host_slots: int, device_slots: int, dtype: DType) -> None:
        self.layout = KVLayout(layers=1, kv_heads=1, head_dim=2, block_size=block_size, dtype=dtype)
        self.clock = ManualClock()
        bytes_per = self.layout.block_bytes
        host = HostTier(self.layout, host_slots * bytes_per)
        device = DeviceTier(self.layout, device_slots * bytes_per, device="cpu") if device_slots else None
        config = CacheConfig(
            host_capacity=host_slots * bytes_per,
            device_capacity=device_slots * bytes_per,
            ttl_s=TTL_S,
            lease_ttl_s=LEASE_TTL_S,
        )
        self.cache = PrefixCache(config, self.layout, host, device, clock=self.clock)
        index = self.cache.index  # a log with almost no slack compacts every few steps: exercise that too
        index.log = TouchLog(index.capacity, index.tick, index.tier, slack=1)
        self.ns = [self.cache.attach(namespace(self.layout, tenant=f"t{i}")) for i in range(2)]
        self.stored: set[tuple[int, tuple[int, ...]]] = set()  # (namespace, full-block prefix) ever accepted
        self.leases: dict[int, HeldLease] = {}
        self.last_stored: tuple[int, list[int]] | None = None

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()

    # -- helpers ---------------------------------------------------------------------
    def kv(self, ns: int, tokens: list[int], start: int = 0) -> torch.Tensor:
        return kv_for(tokens, self.layout, start, salt=ns)

    def prefix(self, tokens: list[int], blocks: int) -> tuple[int, ...]:
        return tuple(tokens[: blocks * self.layout.block_size])

    def reachable(self, ns: int, tokens: list[int]) -> int:
        """Blocks a lookup may serve: a scalar walk of live, chained nodes, unexpired or pinned."""
        index, parent, count = self.cache.index, -1, 0
        for block_hash in block_hashes(self.cache, self.ns[ns], tokens):
            node = index.node_of(block_hash)
            if node is None or int(index.parent[node]) != parent:
                break
            if index.last_access[node] < self.clock() - TTL_S and not index.pins[node]:
                break  # expired, unless a lease or pin holds it (expiry never drops a pinned row)
            parent, count = node, count + 1
        return count

    # -- rules -------------------------------------------------------------------------
    @rule(target=prompts, tokens=FRESH)
    def new_prompt(self, tokens: list[int]) -> list[int]:
        return tokens

    @rule(target=prompts, base=prompts, more=TURN)
    def extend(self, base: list[int], more: list[int]) -> list[int]:
        return base + more

    @rule(
        ns=NAMESPACE,
        tokens=prompts,
        start=st.sampled_from([0, 0, 1, 2]),
        then=st.sampled_from(["nothing", "lookup", "lease"]),
    )
    def store(self, ns: int, tokens: list[int], start: int, then: str) -> None:
        full = len(tokens) // self.layout.block_size
        start = min(start, full)
        try:
            result = self.cache.store(self.ns[ns], tokens, self.kv(ns, tokens, start), start)
        except ResourceExhausted:
            return  # more new blocks than the host tier has slots
        accepted = result.stored + result.deduplicated
        assert accepted + result.rejected == full - start
        for blocks in range(start + 1, start + accepted + 1):
            self.stored.add((ns, self.prefix(tokens, blocks)))
        if accepted:
            self.last_stored = (ns, tokens)
        if then != "nothing":
            hit = self._lookup(ns, tokens, take_lease=then == "lease")
            assert accepted == 0 or hit >= start + accepted, "an accepted block was not hittable at once"

    @rule(ns=NAMESPACE, tokens=prompts, take_lease=st.booleans())
    def lookup(self, ns: int, tokens: list[int], take_lease: bool) -> None:
        self._lookup(ns, tokens, take_lease)

    @rule(ns=NAMESPACE, base=prompts, more=TURN, take_lease=st.booleans())
    def lookup_next_turn(self, ns: int, base: list[int], more: list[int], take_lease: bool) -> None:
        """The next turn of a conversation: a cached prefix, then something new (a partial hit)."""
        self._lookup(ns, base + more, take_lease)

    def _lookup(self, ns: int, tokens: list[int], take_lease: bool) -> int:
        expected_blocks = self.reachable(ns, tokens)
        result = self.cache.lookup(self.ns[ns], tokens, take_lease=take_lease)
        size = self.layout.block_size
        assert result.hit_tokens % size == 0 and result.hit_tokens == len(result.locations) * size
        hit = result.hit_tokens // size
        assert hit == expected_blocks
        assert all((ns, self.prefix(tokens, i)) in self.stored for i in range(1, hit + 1))
        expected = self.kv(ns, tokens)[:hit]
        assert same_bytes(read_blocks(self.cache, result.locations), expected)
        if result.lease_id is not None:
            assert take_lease and hit > 0
            self.leases[result.lease_id] = HeldLease(ns, result.lease_expires_at, expected)
        return hit

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        # In the order taken, not by id: ids are random, so sorting them would make the lease
        # released differ between replays of the same draws (hypothesis: FlakyStrategyDefinition).
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        held = self.leases.pop(lease_id)
        try:
            self.cache.release(lease_id)
        except UnknownLease:
            assert held.expires_at <= self.clock(), "a live lease was unknown"

    @rule(
        ns=NAMESPACE,
        tokens=prompts,
        how=st.sampled_from(["namespace", "older", "prefix"]),
        seconds=st.sampled_from([0.0, 2.0, 5.0, 11.0]),
    )
    def evict(self, ns: int, tokens: list[int], how: str, seconds: float) -> None:
        if how == "namespace":
            self.cache.evict(self.ns[ns])
        elif how == "older":
            self.cache.evict(older_than_s=seconds)
        else:
            self.cache.evict(self.ns[ns], prefix_tokens=tokens)

    @rule(
        seconds=st.sampled_from([0.5, 3.0, 4.0, 6.0, 10.0, 10.5, 12.0]),
        reclaim=st.booleans(),
        look=st.sampled_from(["nothing", "last stored", "last stored", "drawn"]),
        ns=NAMESPACE,
        tokens=prompts,
    )
    def advance_clock(self, seconds: float, reclaim: bool, look: str, ns: int, tokens: list[int]) -> None:
        """Time passes; then maybe reclaim, and maybe look a prompt up (expired blocks must miss)."""
        self.clock.advance(seconds)
        if reclaim:
            self.cache.expire()
        if look == "last stored" and self.last_stored is not None:
            self._lookup(*self.last_stored, take_lease=False)
        elif look == "drawn":
            self._lookup(ns, tokens, take_lease=False)

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.cache is not None:
            assert_consistent(self.cache)

    @invariant()
    def leased_paths_stay_readable(self) -> None:
        for lease_id, held in self.leases.items():
            if held.expires_at > self.clock():
                assert same_bytes(read_blocks(self.cache, self.cache.lease(lease_id).locations), held.kv)


CacheMachine.TestCase.settings = settings.get_profile(os.environ.get("PREFIXCACHE_STATEFUL_PROFILE", "stateful-ci"))
TestCacheMachine = CacheMachine.TestCase
