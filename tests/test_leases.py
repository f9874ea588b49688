"""LeaseTable (leases and reservations) and the core's use of it: ids, expiry, tenant checks."""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidArgument, ResourceExhausted
from prefixcache.kinds import TierKind
from prefixcache.leases import LeaseTable
from tests.support.core import (
    TINY,
    ManualClock,
    assert_consistent,
    kv_for,
    make_cache,
    namespace,
    read_blocks,
    same_bytes,
    write_reserved,
)

pytestmark = pytest.mark.unit


def test_ids_are_unique_across_leases_and_reservations_and_expiry_removes_each_once() -> None:
    table = LeaseTable(max_leases=2)
    lease = table.add_lease(0, (1, 2), expires_at=10.0)
    reservation = table.add_reservation(TierKind.HOST, (5,), expires_at=20.0, namespace=0)
    assert lease.id != reservation.id and lease.id in table and reservation.id in table
    assert reservation.tier is TierKind.HOST and not table.full()
    assert table.live_lease(lease.id, now=9.9) == lease and table.live_lease(lease.id, now=10.0) is None
    assert table.expired(15.0) == ([lease], [])  # the lease went; the reservation is still live
    assert table.expired(15.0) == ([], [])  # and it is removed exactly once
    assert table.take_reservation(reservation.id) == reservation and table.take_reservation(reservation.id) is None
    assert table.lease_count() == 0 and reservation.id not in table


def test_a_commit_with_another_tenants_reservation_leaves_it_theirs() -> None:
    clock = ManualClock()
    with make_cache(host_slots=8, clock=clock) as cache:
        acme = cache.attach(namespace(tenant="acme"))
        globex = cache.attach(namespace(tenant="globex"))
        p = list(range(2 * TINY.block_size))
        reservation = cache.reserve(2, acme)
        for position in range(2):
            write_reserved(cache, reservation.id, position, kv_for(p)[position])
        with pytest.raises(InvalidArgument) as caught:
            cache.commit(globex, p, reservation.id, 0)
        assert caught.value.field == "reservation_id"
        assert cache.leases.reservation(reservation.id) == reservation  # untouched, still acme's
        assert_consistent(cache)
        assert cache.commit(acme, p, reservation.id, 0).stored == 2
        hit = cache.lookup(acme, p)
        assert hit.hit_tokens == 2 * TINY.block_size and same_bytes(read_blocks(cache, hit.locations), kv_for(p))
        assert cache.lookup(globex, p).hit_tokens == 0
        assert_consistent(cache)


def test_slot_tiers_hand_out_bytes_and_share_handles_through_the_interface() -> None:
    with make_cache(host_slots=4, device_slots=2) as cache:
        ns = cache.attach(namespace())
        p = list(range(TINY.block_size))
        cache.store(ns, p, kv_for(p))
        location = cache.lookup(ns, p).locations[0]
        tier = cache.tiers[location.tier]
        raw = tier.block_bytes(location.slot)
        assert len(raw) == TINY.block_bytes and bytes(raw) == kv_for(p)[0].numpy().tobytes()
        tier.write_bytes(location.slot, bytes(TINY.block_bytes))
        assert not any(bytes(tier.block_bytes(location.slot)))  # a view of the slot: the write shows
        host = cache.tiers[TierKind.HOST].share_handle()
        assert host is not None and host.segment and host.cuda_ipc is None
        assert (host.kind, host.num_slots, host.slot_bytes) == (TierKind.HOST, 4, TINY.block_bytes)
        assert cache.tiers[TierKind.DEVICE].share_handle() is None  # a CPU stand-in cannot be shared


def test_with_several_tenants_one_holds_at_most_its_share_of_the_leases() -> None:
    """Issue 33, finding 6: one client took all of --max-leases while another tenant's next lease
    was refused. With two tenants each holds at most half; leases count out as they go."""
    table = LeaseTable(max_leases=4)
    assert table.tenant_share == 2
    first = [table.add_lease(0, (i,), expires_at=10.0, tenant="acme") for i in range(2)]
    assert table.full("acme") and not table.full("globex") and not table.full()
    table.pop_lease(first[0].id)
    assert not table.full("acme") and table.tenant_leases("acme") == 1
    table.expired(11.0)
    assert table.tenant_leases("acme") == 0
    clock = ManualClock()
    with make_cache(host_slots=8, clock=clock, max_leases=4) as cache:
        acme = cache.attach(namespace(tenant="acme"))
        globex = cache.attach(namespace(tenant="globex"))
        tokens = list(range(4 * TINY.block_size))
        for ns in (acme, globex):
            cache.store(ns, tokens, kv_for(tokens))
        leases = [cache.lookup(acme, tokens, take_lease=True).lease_id for _ in range(2)]
        with pytest.raises(ResourceExhausted, match="take_lease: this tenant holds its share"):
            cache.lookup(acme, tokens, take_lease=True)
        assert cache.lookup(globex, tokens, take_lease=True).lease_id is not None  # the other tenant is served
        cache.release(leases[0])
        assert cache.lookup(acme, tokens, take_lease=True).lease_id is not None
