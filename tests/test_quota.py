"""Per-tenant byte quotas and per-tenant figures in the core (prefixcache/quota.py), over real tiers.

The point of a quota: a tenant that floods the cache evicts its *own* least recently used
blocks (reason `capacity`), never another tenant's. Each flood test has a control without
quotas that shows the same flood does push the other tenant out.
"""

from __future__ import annotations

import pytest

from prefixcache.config import TenantQuota, TenantQuotas
from prefixcache.errors import ConfigError, InvalidArgument
from prefixcache.kinds import TierKind
from tests.support.core import TINY, assert_consistent, kv_for, make_cache, namespace, write_reserved

pytestmark = pytest.mark.unit

BS = TINY.block_size
BLOCK = TINY.block_bytes


def prompt(*block_ids: int) -> list[int]:
    return [b for b in block_ids for _ in range(BS)]


def store(cache, ns: str, tokens: list[int]):
    return cache.store(ns, tokens, kv_for(tokens, cache.layout))


def hit_blocks(cache, ns: str, tokens: list[int]) -> int:
    return cache.lookup(ns, tokens).hit_tokens // BS


def quotas(host: int | None = None, device: int | None = None, **overrides: TenantQuota) -> TenantQuotas:
    return TenantQuotas(TenantQuota(host=host, device=device), tuple(overrides.items()))


def tenants(cache, *names: str) -> list[str]:
    return [cache.attach(namespace(tenant=name)) for name in names]


FLOOD = [prompt(100 + 10 * i, 101 + 10 * i) for i in range(6)]  # 6 prompts of 2 blocks


@pytest.mark.parametrize("limited", [True, False])
def test_a_flooding_tenant_evicts_only_its_own_blocks(limited: bool) -> None:
    config = {"tenant_quotas": quotas(host=4 * BLOCK)} if limited else {}
    with make_cache(host_slots=8, **config) as cache:
        a, b = tenants(cache, "a", "b")
        victim = prompt(1, 2, 3)
        store(cache, a, victim)
        for tokens in FLOOD:
            store(cache, b, tokens)
        if not limited:  # the control: global LRU lets the flood push tenant a out
            assert hit_blocks(cache, a, victim) < 3
            return
        assert hit_blocks(cache, a, victim) == 3
        # b keeps exactly its 4 most recent blocks: the last two prompts, nothing older.
        assert [hit_blocks(cache, b, tokens) for tokens in FLOOD] == [0, 0, 0, 0, 2, 2]
        evictions = cache.stats().evictions["host"]
        assert evictions == {"capacity": 8}
        assert cache.stats("b").evictions == {"host": {"capacity": 8}}
        assert cache.stats("a").evictions == {}
        assert cache.ledger.resident("b", TierKind.HOST) == 4
        assert_consistent(cache)


def test_pinned_blocks_keep_their_quota_and_new_blocks_are_rejected() -> None:
    with make_cache(host_slots=8, tenant_quotas=quotas(host=4 * BLOCK)) as cache:
        a, b = tenants(cache, "a", "b")
        store(cache, b, FLOOD[0])
        store(cache, b, FLOOD[1])
        leases = [cache.lookup(b, tokens, take_lease=True) for tokens in FLOOD[:2]]
        result = store(cache, b, FLOOD[2])
        assert (result.stored, result.rejected) == (0, 2)  # its 4 blocks are leased: no room in its quota
        assert store(cache, a, prompt(1, 2, 3)).stored == 3  # the others' room is untouched
        for lease in leases:
            cache.release(lease.lease_id)
        assert store(cache, b, FLOOD[2]).stored == 2
        assert hit_blocks(cache, b, FLOOD[0]) == 0 and hit_blocks(cache, b, FLOOD[1]) == 2
        assert_consistent(cache)


def test_per_tenant_overrides_replace_the_default() -> None:
    with make_cache(host_slots=16, tenant_quotas=quotas(host=2 * BLOCK, big=TenantQuota(host=None))) as cache:
        small, big = tenants(cache, "small", "big")
        for tokens in FLOOD:
            store(cache, small, tokens)
            store(cache, big, [t + 1 for t in tokens])
        assert cache.ledger.resident("small", TierKind.HOST) == 2
        assert cache.ledger.resident("big", TierKind.HOST) == 12
        assert cache.stats("small").tiers[0].capacity_bytes == 2 * BLOCK  # its quota, not the tier
        assert_consistent(cache)


def test_device_quota_demotes_the_tenants_own_blocks() -> None:
    with make_cache(host_slots=16, device_slots=4, tenant_quotas=quotas(device=2 * BLOCK)) as cache:
        a, b = tenants(cache, "a", "b")
        first, second, other = prompt(1, 2, 3), prompt(4, 5), prompt(7, 8)
        store(cache, a, first)
        assert hit_blocks(cache, a, first) == 3  # promoted, but only 2 blocks: a's quota
        assert cache.ledger.resident("a", TierKind.DEVICE) == 2
        store(cache, b, other)
        assert hit_blocks(cache, b, other) == 2
        store(cache, a, second)
        assert hit_blocks(cache, a, second) == 2  # a makes room from its own device blocks
        tiers = [TierKind(int(t)) for t in cache.lookup(a, second).locations.tiers]
        assert tiers == [TierKind.DEVICE, TierKind.DEVICE]
        assert cache.ledger.resident("b", TierKind.DEVICE) == 2  # b's device blocks stayed
        assert cache.stats().evictions["device"] == {"capacity": 2}
        assert_consistent(cache)


def test_a_reservation_is_committed_only_by_its_tenant() -> None:
    with make_cache(host_slots=8) as cache:
        a, b = tenants(cache, "a", "b")
        tokens = prompt(1, 2)
        reservation = cache.reserve(2, a)
        for position, block in enumerate(kv_for(tokens, TINY)):
            write_reserved(cache, reservation.id, position, block)
        with pytest.raises(InvalidArgument, match="reservation_id"):
            cache.commit(b, tokens, reservation.id, 0)
        assert cache.commit(a, tokens, reservation.id, 0).stored == 2  # still a's to commit
        assert hit_blocks(cache, b, tokens) == 0 and hit_blocks(cache, a, tokens) == 2
        assert_consistent(cache)


def test_tenant_figures_count_only_the_tenants_own_traffic() -> None:
    with make_cache(host_slots=8) as cache:
        a, b = tenants(cache, "a", "b")
        a_salted = cache.attach(namespace(tenant="a", cache_salt="team"))
        store(cache, a, prompt(1, 2))
        store(cache, a_salted, prompt(3))
        lease = cache.lookup(a, prompt(1, 2), take_lease=True)
        cache.lookup(b, prompt(1, 2))
        mine, theirs, everyone = cache.stats("a"), cache.stats("b"), cache.stats()
        assert (mine.lookups, mine.block_hits, mine.blocks_committed, mine.active_leases) == (1, 2, 3, 1)
        assert (theirs.lookups, theirs.block_hits, theirs.blocks_committed, theirs.active_leases) == (1, 0, 0, 0)
        assert (everyone.lookups, everyone.blocks_committed) == (2, 3)
        assert [t.blocks for t in mine.tiers] == [3] and [t.blocks for t in theirs.tiers] == [0]
        assert theirs.miss_reasons == {"not_cached": 1}
        assert cache.stats("nobody").lookups == 0
        cache.release(lease.lease_id)


def test_quota_specs_parse_and_name_their_errors() -> None:
    quota = TenantQuota.parse("host=256MiB, device=1GiB")
    assert (quota.host, quota.device) == (256 << 20, 1 << 30)
    assert quota.updated("host=unlimited") == TenantQuota(device=1 << 30)
    assert TenantQuota.parse("") == TenantQuota() and not TenantQuotas().limited
    for spec, field in (("gpu=1GiB", "tenant_quota"), ("host", "tenant_quota"), ("host=lots", "tenant_quota.host")):
        with pytest.raises(ConfigError) as error:
            TenantQuota.parse(spec)
        assert error.value.field == field
    with pytest.raises(ConfigError, match="two quota overrides"):
        TenantQuotas(TenantQuota(), (("a", TenantQuota()), ("a", TenantQuota(host=1))))
