"""The library's fail-open link (prefixcache/client/link.py), against real services over gRPC.

Both engines (the reference worker's `WorkerLink`, the vLLM connector's `ConnectorLink`) use this
one link; their own tests (test_worker_failopen.py, tests/vllm_e2e/) cover the adapters.

- Attaches on first use and logs each state change once.
- A call's own error (a rejected salt) is raised to the caller and leaves the link up.
- A service that goes away: calls answer None; while inside the backoff the link does not even
  try (`skipping`); past it, it re-attaches to the service back on the same port.
- A service restarted while the link was up costs no call: the first call after the restart
  re-attaches on a fresh client and succeeds.
- A failure reported on a client another thread already replaced leaves the new one alone.
- Releasing a lease never raises, also once the service is gone.
- A client dropped by one thread's failure still serves another thread's call in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from prefixcache.client.link import CacheLink, LeaseReturns, service_level
from prefixcache.config import Namespace
from prefixcache.errors import InvalidArgument, PrefixCacheError, UnknownNamespace
from prefixcache_services.cache_server.server import CacheServer
from tests.support.core import ManualClock
from tests.support.poll import poll
from tests.support.service import layout_of, prompt, random_kv, running_servers

pytestmark = pytest.mark.process

LAYOUT = layout_of()


@pytest.fixture
def servers() -> Iterator:
    with running_servers() as make:
        yield make


def _link(server: CacheServer, clock: ManualClock, caplog: pytest.LogCaptureFixture) -> CacheLink:
    caplog.set_level(logging.INFO, logger="tests.link")
    namespace = Namespace("link-model", "r1", LAYOUT)
    return CacheLink(server.address, namespace, timeout_s=5.0, logger=logging.getLogger("tests.link"), clock=clock)


def _stored(link: CacheLink, tokens: list[int]) -> int:
    answer = link.call(lambda client, _: client.store(tokens, random_kv(len(tokens) // LAYOUT.block_size, LAYOUT, 1)))
    assert answer is not None
    return answer[0].stored


def _hit_blocks(link: CacheLink, tokens: list[int]) -> int | None:
    answer = link.call(lambda client, _: client.lookup(tokens, take_lease=False))
    return None if answer is None else answer[0].blocks


def _states(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(":")[0] for r in caplog.records if r.name == "tests.link"]


def test_service_level_is_the_one_classification() -> None:
    assert service_level(PrefixCacheError("unavailable"))
    assert service_level(UnknownNamespace("0" * 16))
    assert service_level(InvalidArgument("namespace_id", "unknown"))
    assert not service_level(InvalidArgument("cache_salt", "empty"))
    assert not service_level(InvalidArgument("lease_id", "expired"))


def test_attaches_on_first_use_and_a_calls_own_error_keeps_it_up(servers, caplog) -> None:
    server = servers()
    link = _link(server, ManualClock(), caplog)
    assert link.up is None and not link.skipping
    tokens = prompt(3)[: 3 * LAYOUT.block_size]
    assert _stored(link, tokens) == 3
    assert link.up is True and _hit_blocks(link, tokens) == 3
    client = link.client()
    with pytest.raises(InvalidArgument) as error:
        link.call(lambda c, _: c.lookup(tokens, cache_salt=""))
    assert error.value.field == "cache_salt" and not service_level(error.value)
    assert link.up is True and link.client() == client  # the same client: nothing was dropped
    assert _states(caplog) == ["cache link up"]


def test_a_service_that_goes_away_is_skipped_until_its_backoff_then_reattached(servers, caplog) -> None:
    server = servers()
    clock = ManualClock()
    link = _link(server, clock, caplog)
    tokens = prompt(2)[: 2 * LAYOUT.block_size]
    assert _stored(link, tokens) == 2
    port = server.port
    server.shutdown(0)
    assert _hit_blocks(link, tokens) is None  # failed, re-attaching at once failed too
    assert link.up is False
    assert link.skipping and link.client() is None  # inside the backoff: not even tried
    clock.advance(2.0)  # the backoff is at most 2 s
    assert not link.skipping and link.client() is None  # tried, the service is still gone
    assert link.skipping
    servers(listen=f"127.0.0.1:{port}")  # back on the same port, empty
    assert _hit_blocks(link, tokens) is None  # still inside the backoff
    clock.advance(2.0)
    assert _hit_blocks(link, tokens) == 0 and link.up is True
    assert _states(caplog) == ["cache link up", "cache link down", "cache link up"]  # each change once


def test_a_restart_while_up_costs_no_call(servers, caplog) -> None:
    server = servers()
    link = _link(server, ManualClock(), caplog)
    tokens = prompt(2)[: 2 * LAYOUT.block_size]
    assert _stored(link, tokens) == 2
    old_client, old_attachment = link.client() or (None, None)
    port = server.port
    server.shutdown(0)
    servers(listen=f"127.0.0.1:{port}")  # restarted: it forgot the namespace and its blocks
    assert _stored(link, tokens) == 2  # the first call after the restart already succeeds
    client, attachment = link.client() or (None, None)
    assert link.up is True and client is not old_client
    assert attachment is not None and old_attachment is not None
    assert _hit_blocks(link, tokens) == 2


def test_a_failure_on_a_replaced_client_leaves_the_new_one_alone(servers, caplog) -> None:
    server = servers()
    link = _link(server, ManualClock(), caplog)
    first = link.client()
    assert first is not None
    link.failed(PrefixCacheError("the service restarted"), first[0])  # one thread's failure
    second = link.client()  # re-attached at once: it was working
    assert second is not None and second[0] is not first[0]
    link.failed(PrefixCacheError("the same restart, seen late"), first[0])  # another thread's, on the old client
    assert link.client() == second and link.up is True


def test_releasing_never_raises(servers, caplog) -> None:
    server = servers(lease_ttl_s=30)
    link = _link(server, ManualClock(), caplog)
    tokens = prompt(2)[: 2 * LAYOUT.block_size]
    _stored(link, tokens)
    answer = link.call(lambda client, _: client.lookup(tokens + [1], take_lease=True))
    assert answer is not None and answer[0].lease_id
    hit = answer[0]
    link.release(hit)
    link.release(hit)  # already released: harmless
    link.release(None)
    leased = link.call(lambda client, _: client.lookup(tokens + [1], take_lease=True))
    assert leased is not None
    server.shutdown(0)
    link.release(leased[0])  # the service is gone: the lease dies with it, nothing raised
    assert link.up is False


def test_returned_leases_ride_on_the_next_lookup_or_go_by_themselves(servers, caplog) -> None:
    """A lease handed to `LeaseReturns` goes back with the next Lookup through the same client
    (no Release of its own), or, with no Lookup within the hold, by a Release from its thread;
    `close` releases what is left; a failed Lookup's carried leases are released by the caller."""
    server = servers(lease_ttl_s=30)
    link = _link(server, ManualClock(), caplog)
    tokens = prompt(2)[: 2 * LAYOUT.block_size]
    _stored(link, tokens)

    def leased() -> int:
        answer = link.call(lambda client, _: client.stats())
        assert answer is not None
        return answer[0].snapshot.active_leases

    def lookup(release: list) -> tuple:
        answer = link.call(lambda client, _: (client.lookup(tokens + [1], release=release), client))
        assert answer is not None
        return answer[0]

    returns = LeaseReturns(link, hold_s=60.0)
    try:
        first, client = lookup([])
        returns.add(first, client)
        assert leased() == 1 and returns.take(object()) == []  # another client's Lookup carries nothing
        carried = returns.take(client)
        assert carried == [first] and returns.take(client) == []
        second, _ = lookup(carried)
        assert leased() == 1  # only the new lease: the first went back with the Lookup
        returns.add(second, client)
    finally:
        returns.close()
    assert leased() == 0  # closing released what was waiting
    quick = LeaseReturns(link, hold_s=0.2)
    try:
        third, client = lookup([])
        quick.add(third, client)
        assert leased() == 1
        assert poll(lambda: leased() == 0, 5)  # no Lookup came: released by itself after the hold
        fourth, client = lookup([])
        quick.add(fourth, client)
        carried = quick.take(client)
        server.shutdown(0)
        quick.release(carried, client)  # what a failed Lookup's caller does: never raises
    finally:
        quick.close()


def test_a_dropped_client_still_serves_the_call_in_flight(servers, caplog) -> None:
    """Another thread's failure drops the client, never closes it under a copy in progress."""
    server = servers()
    link = _link(server, ManualClock(), caplog)
    tokens = prompt(2)[: 2 * LAYOUT.block_size]
    assert _stored(link, tokens) == 2
    attached = link.client()
    assert attached is not None and attached[1].shared_memory
    client = attached[0]
    hit = client.lookup(tokens + [1], take_lease=True)  # this thread's load, about to copy
    link.failed(PrefixCacheError("another thread's call failed"), client)
    fresh = link.client()
    assert fresh is not None and fresh[0] is not client
    assert client.read(hit).shape == (2, *LAYOUT.block_shape)  # its mapped memory is still there
    assert client.release(hit)
