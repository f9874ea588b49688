"""One call per same-host store: each Commit reserves the writer's next store (issue 31).

A same-host store was Reserve + write the mapped slots + Commit. The Commit now asks for the
next store's slots (`reserve_next`) and the client keeps that spare reservation, so a worker
storing request after request makes one call per store. Real servers on loopback; the calls
are counted by the service's own metrics. In a full tier the spare evicts as the next Reserve
would (never where layouts share the tier, nor when it is over an eighth of it), a spare too small is given back in the Reserve that
replaces it, and a Commit publishes only the slots it names. A writer
that copies blocks straight into the spare's slots (the vLLM worker on CPU) commits them alone.
"""

from __future__ import annotations

import pytest

from prefixcache.config import KVLayout
from prefixcache.errors import InvalidArgument
from prefixcache.kinds import TierKind
from prefixcache.rpc import cache_pb2 as pb
from tests.support.service import BLOCK, layout_of, prompt, random_kv, rpc_code, running_servers, same_bytes, stub_for


@pytest.fixture
def start():
    with running_servers() as make:
        yield make


def calls(server, method: str) -> int:
    value = server.metrics.registry.get_sample_value("prefixcache_rpcs_total", {"method": method, "code": "OK"})
    return int(value or 0)


def assert_read_back(client, stored: list) -> None:
    """Each (tokens, kv) stored is a whole hit whose bytes are kv: it landed in its own slots."""
    for tokens, kv in stored:
        hit = client.lookup(tokens)
        try:
            assert hit.hit_tokens == len(kv) * BLOCK and same_bytes(client.read(hit), kv)
        finally:
            client.release(hit)


def test_a_worker_storing_request_after_request_makes_one_call_per_store(start) -> None:
    layout = layout_of()
    server = start(host_capacity=64 * layout.block_bytes, metrics_port=0)
    client = start.client(server)
    client.attach("model", layout)
    assert client.attachment.shared_memory
    stored = []
    for request in range(10):
        tokens, kv = prompt(4, start=10_000 * (request + 1)), random_kv(4, layout, seed=request)
        assert client.store(tokens, kv).stored == 4
        stored.append((tokens, kv))
    assert (calls(server, "Reserve"), calls(server, "Commit")) == (1, 10)
    assert_read_back(client, stored)  # every store's bytes landed in the slots it was given
    # A smaller store uses the spare's first slots; the rest go back to the free list, and the next
    # spare is as large as the largest of the last stores (4), so a store of that size fits it.
    tokens, kv = prompt(2, start=900_000), random_kv(2, layout, seed=99)
    assert client.store(tokens, kv).stored == 2 and calls(server, "Reserve") == 1
    assert client.stats().snapshot.tiers[0].blocks == 10 * 4 + 2  # blocks only: the next spare holds none
    assert server.backend.cache.placement.used(TierKind.HOST) == 10 * 4 + 2 + 4  # + the spare
    assert client.store(prompt(4, start=950_000), random_kv(4, layout, seed=98)).stored == 4
    assert calls(server, "Reserve") == 1


def test_in_a_full_tier_a_spare_evicts_for_the_next_store_and_every_store_is_one_call(start) -> None:
    layout = layout_of()
    server = start(host_capacity=64 * layout.block_bytes, metrics_port=0)
    client = start.client(server)
    client.attach("model", layout)
    used = lambda: server.backend.cache.placement.used(TierKind.HOST)  # noqa: E731  (slots: blocks + reservations)
    evicted = lambda: sum(client.stats().snapshot.evictions.get("host", {}).values())  # noqa: E731
    first = prompt(2, start=0)
    client.store(first, random_kv(2, layout, seed=1))  # 2 resident + a spare of 2
    stored = []
    for n in range(12):  # 2 + 12 x 6 = 74 blocks for 64 slots: the tier fills, then LRU evicts
        tokens, kv = prompt(6, start=10_000 * (n + 1)), random_kv(6, layout, seed=n + 2)
        assert client.store(tokens, kv).stored == 6
        stored.append((tokens, kv))
    # One Reserve for the store that found the spare of 2 too small; every other store, those
    # in the full tier too, was one Commit whose spare evicted the least recently used blocks.
    assert (calls(server, "Reserve"), calls(server, "Commit")) == (2, 13)
    assert used() == 64 and evicted() == 2 + 12 * 6 + 6 - 64  # the blocks and a spare of 6 fill the tier
    # In LRU order: the first prompt, the next two, and the last 2 blocks of the one after.
    hits = [client.lookup(tokens, take_lease=False).hit_tokens // BLOCK for tokens in [first] + [t for t, _ in stored]]
    assert hits == [0, 0, 0, 4] + [6] * 9
    assert_read_back(client, stored[3:])


def test_a_spare_too_small_is_given_back_and_a_large_spare_never_evicts(start) -> None:
    """A spare over an eighth of the tier would hold room that promotions and other writers need."""
    layout = layout_of()
    server = start(host_capacity=12 * layout.block_bytes, metrics_port=0)
    client = start.client(server)
    client.attach("model", layout)
    client.store(prompt(2, start=0), random_kv(2, layout, seed=1))  # 2 resident + a spare of 2
    used = lambda: server.backend.cache.placement.used(TierKind.HOST)  # noqa: E731
    assert used() == 4
    client.store(prompt(6, start=50_000), random_kv(6, layout, seed=2))  # Reserve(6) gives the 2 back
    assert calls(server, "Reserve") == 2
    # 8 resident and 4 free: a spare of 6 may not evict, and even the 4 free would leave none,
    # so there is no spare and nothing was evicted (the spare of 2 was given back, or 10 would be used).
    snapshot = client.stats().snapshot
    assert used() == 8 and snapshot.tiers[0].blocks == 8 and sum(snapshot.evictions.get("host", {}).values()) == 0
    assert client.lookup(prompt(2, start=0), take_lease=False).hit_tokens == 2 * BLOCK
    # No spare: a plain Reserve, which evicts as always.
    assert client.store(prompt(6, start=90_000), random_kv(6, layout, seed=3)).stored == 6
    assert calls(server, "Reserve") == 3


def test_a_spare_never_evicts_where_layouts_share_the_tier(start) -> None:
    """Held slots keep their chunk from changing layout: a spare that evicted in a tier two models
    share would keep one from taking room from the other (test_multi_model_workers.py)."""
    layout = layout_of()
    server = start(host_capacity=64 * layout.block_bytes, chunk_bytes=4 * layout.block_bytes, metrics_port=0)
    client = start.client(server)
    client.attach("model", layout)
    other = KVLayout(layers=2, kv_heads=1, head_dim=28, block_size=BLOCK, dtype="float32")
    start.client(server).attach("model-b", other, same_host=False)
    assert server.backend.cache.placement.shared(TierKind.HOST)
    evicted = lambda: sum(client.stats().snapshot.evictions.get("host", {}).values())  # noqa: E731
    used = lambda: server.backend.cache.placement.used(TierKind.HOST)  # noqa: E731
    for n in range(9):  # 54 blocks: 10 slots free, too few for a spare of 6 that evicts nothing
        assert client.store(prompt(6, start=10_000 * (n + 1)), random_kv(6, layout, seed=n)).stored == 6
    assert (calls(server, "Reserve"), evicted(), used()) == (1, 0, 54)  # (one tier alone: 60, the spare)
    # No spare: a plain Reserve, which evicts as always; still no spare after it.
    assert client.store(prompt(6, start=200_000), random_kv(6, layout, seed=20)).stored == 6
    assert (calls(server, "Reserve"), evicted(), used()) == (2, 0, 60)
    assert client.store(prompt(6, start=300_000), random_kv(6, layout, seed=21)).stored == 6
    assert (calls(server, "Reserve"), evicted(), used()) == (3, 2, 64)


def test_a_commit_publishes_only_the_slots_it_names(start) -> None:
    layout = layout_of()
    server = start(host_capacity=16 * layout.block_bytes)
    stub = stub_for(server)
    client = start.client(server)
    ns = client.attach("model", layout).namespace_id
    reservation = stub.Reserve(pb.ReserveRequest(namespace_id=ns, block_count=5))
    tokens = prompt(5, start=3000)
    code, field = rpc_code(
        stub.Commit,
        pb.CommitRequest(namespace_id=ns, tokens=tokens, reservation_id=reservation.reservation_id, block_count=6),
    )
    assert (code.name, field) == ("INVALID_ARGUMENT", "block_count")
    reply = stub.Commit(
        pb.CommitRequest(namespace_id=ns, tokens=tokens, reservation_id=reservation.reservation_id, block_count=3)
    )
    assert (reply.stored, reply.rejected) == (3, 0) and not reply.HasField("next")
    assert client.lookup(tokens, take_lease=False).hit_tokens == 3 * BLOCK
    assert server.backend.cache.placement.used(TierKind.HOST) == 3  # the 2 slots left over are free again


def test_a_store_written_in_place_is_one_commit_into_the_spare_reservation(start) -> None:
    """`reserve_mapped` hands out the spare reservation without a call while it fits; the caller
    writes its slots (`reserved_pieces`, e.g. straight out of vLLM's cache) and `commit_reserved`
    publishes them: the bytes written, with one Commit and no Reserve."""
    layout = layout_of()
    server = start(host_capacity=64 * layout.block_bytes, metrics_port=0)
    client = start.client(server)
    client.attach("model", layout)
    assert client.reserve_mapped(4) is None  # no Commit yet, so no spare
    client.store(prompt(4, start=0), random_kv(4, layout, seed=0))  # its Commit reserves 4 for the next store
    assert client.reserve_mapped(5) is None  # too small: left for a store that reserves anew
    reservation = client.reserve_mapped(3)
    assert reservation is not None and len(reservation.slots) == 3
    assert client.reserve_mapped(1) is None  # taken
    kv = random_kv(3, layout, seed=1)
    for first, view in client.reserved_pieces(reservation):
        view.copy_(kv[first : first + len(view)])
    tokens = prompt(3, start=7000)
    with pytest.raises(InvalidArgument) as error:
        client.commit_reserved(reservation, tokens[: 2 * BLOCK])  # 3 blocks need 3 blocks of tokens
    assert error.value.field == "start_block"
    assert client.commit_reserved(reservation, tokens).stored == 3
    assert (calls(server, "Reserve"), calls(server, "Commit")) == (1, 2)
    hit = client.lookup(tokens)
    try:
        assert hit.hit_tokens == 3 * BLOCK and same_bytes(client.read(hit), kv)
    finally:
        client.release(hit)
    assert client.reserve_mapped(3) is not None  # that Commit reserved the next store's 3
    remote = start.client(server)
    remote.attach("model", layout, same_host=False)
    remote.store(prompt(2, start=9000), random_kv(2, layout, seed=2))
    assert remote.reserve_mapped(1) is None  # nothing mapped: stores go by stream


def test_a_spare_of_scattered_slots_is_left_to_store(start) -> None:
    """In a full tier a spare's slots are what LRU freed, often apart: `reserve_mapped` hands out
    only a spare whose slots are one run (a writer copying straight into them would pay a copy
    per run); `store` uses the other, one call still, each block in its own slot."""
    layout = layout_of()
    server = start(host_capacity=16 * layout.block_bytes, metrics_port=0)
    stub = stub_for(server)
    client = start.client(server)
    ns = client.attach("model", layout).namespace_id
    singles = [prompt(1, start=1000 * (n + 1)) for n in range(14)]
    for tokens in singles:  # 14 one-block prompts, in slots of their own, with no spare
        reservation = stub.Reserve(pb.ReserveRequest(namespace_id=ns, block_count=1))
        stub.Commit(pb.CommitRequest(namespace_id=ns, tokens=tokens, reservation_id=reservation.reservation_id))
    slot_of = {n: int(client.lookup(t, take_lease=False).locations.slots[0]) for n, t in enumerate(singles)}
    assert slot_of[0] + 1 == slot_of[1] and slot_of[1] + 1 == slot_of[2]
    client.lookup(singles[1], take_lease=False)  # used again: singles 0 and 2 are the least recent
    for n in range(3, 14):
        client.lookup(singles[n], take_lease=False)
    assert client.store(prompt(2, start=90_000), random_kv(2, layout, seed=7)).stored == 2  # the 2 free slots
    # Its Commit's spare evicted singles 0 and 2: two slots apart.
    assert [client.lookup(singles[n], take_lease=False).hit_tokens for n in range(3)] == [0, BLOCK, 0]
    assert client.reserve_mapped(2) is None and client._spare is not None  # no run: left for `store`
    for n in range(4, 14):  # the least recent now: single 3, the store's blocks, single 1
        client.lookup(singles[n], take_lease=False)  # (slots 3, 15, 14, 1): the next spares are apart
    stored = []
    for start_token in (80_000, 70_000):
        tokens, kv = prompt(2, start=start_token), random_kv(2, layout, seed=start_token)
        assert client.store(tokens, kv).stored == 2
        stored.append((tokens, kv))
        assert client.reserve_mapped(2) is None and client._spare is not None
    assert calls(server, "Reserve") == 14 + 1  # both stores used the spare: one call each
    assert_read_back(client, stored)  # each block in the slot the spare gave it


def test_slots_out_of_order_are_written_each_where_it_belongs(start) -> None:
    """A reservation's slots in any order (4, 6, 5, 7 spans a run's width without being one)
    land block i in slots[i]; an ascending run is one view."""
    layout = layout_of()
    server = start(host_capacity=64 * layout.block_bytes)
    client = start.client(server)
    client.attach("model", layout)
    pools = client._pools  # the data plane under `store` and `reserved_pieces`
    kv = random_kv(4, layout, seed=5)
    pools.scatter((40, 42, 41, 43), kv)
    assert same_bytes(pools.host.run(40, 4), kv[[0, 2, 1, 3]])
    assert [(i, len(view)) for i, view in pools.host_pieces((44, 45, 46, 47))] == [(0, 4)]
    assert [i for i, _ in pools.host_pieces((47, 46, 45, 44))] == [0, 1, 2, 3]
