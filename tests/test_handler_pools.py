"""Handler pools (services/cache_server/pools.py): unary calls on a few threads, streams apart,
and a call waiting on Redis never holds local hits up. Pool units first, then a real server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from prefixcache.rpc import cache_pb2 as pb
from prefixcache_services.cache_server.pools import ElasticPool, waiting
from tests.support.isolation import serve
from tests.support.poll import poll
from tests.support.service import layout_of, prompt, random_kv, running_servers

pytestmark = [pytest.mark.redis, pytest.mark.process]

pytest_plugins = ["tests.support.redis_server"]


class Concurrency:
    """Counts calls running at once, and the most seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.most = 0

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *_exc) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def pool():
    pools: list[ElasticPool] = []

    def make(active: int, max_threads: int = 8) -> ElasticPool:
        pools.append(ElasticPool(active, max_threads, "test-pool"))
        return pools[-1]

    yield make
    for made in pools:
        made.shutdown(wait=True, cancel_futures=True)


def test_runs_at_most_active_calls_at_once(pool):
    elastic, running = pool(2), Concurrency()

    def call(i: int) -> int:
        with running:
            time.sleep(0.02)
        return i * i

    results = [future.result(10) for future in [elastic.submit(call, i) for i in range(12)]]
    assert results == [i * i for i in range(12)]
    assert running.most == 2
    assert elastic.threads == 2  # queued calls wait for a thread; none is started for them


def test_a_waiting_call_lets_another_run(pool):
    elastic, release = pool(1), threading.Event()

    def waits_on_the_network() -> str:
        with waiting():
            assert release.wait(10)
        return "slow"

    slow = elastic.submit(waits_on_the_network)
    quick = elastic.submit(lambda: "quick")
    assert quick.result(5) == "quick" and not slow.done()
    release.set()
    assert slow.result(5) == "slow"


def test_a_blocked_call_outside_waiting_holds_its_slot(pool):
    elastic, release = pool(1), threading.Event()
    blocked = elastic.submit(release.wait, 10)
    queued = elastic.submit(lambda: "queued")
    with pytest.raises(TimeoutError):
        queued.result(0.3)
    release.set()
    assert blocked.result(5) is True and queued.result(5) == "queued"


def test_threads_are_capped(pool):
    elastic, release = pool(1, max_threads=2), threading.Event()

    def waits() -> None:
        with waiting():
            release.wait(10)

    first, second = elastic.submit(waits), elastic.submit(waits)
    third = elastic.submit(lambda: "third")
    with pytest.raises(TimeoutError):
        third.result(0.3)  # two calls wait: the pool would run a third, but has no third thread
    assert elastic.threads == 2
    release.set()
    first.result(5), second.result(5)
    assert third.result(5) == "third"


def test_errors_reach_the_future_and_shutdown_cancels_the_queue(pool):
    elastic, release = pool(1), threading.Event()

    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        elastic.submit(fails).result(5)
    blocked = elastic.submit(release.wait, 10)
    assert poll(blocked.running, 5)
    queued = elastic.submit(lambda: "never")
    elastic.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        elastic.submit(lambda: None)
    release.set()
    assert blocked.result(5) is True


def test_waiting_outside_a_pool_does_nothing():
    with waiting():
        pass


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="active"):
        ElasticPool(0, 4, "x")
    with pytest.raises(ValueError, match="max_threads"):
        ElasticPool(5, 4, "x")


# -- a real server ---------------------------------------------------------------------
def _stream_threads() -> int:
    return sum(thread.name.startswith("rpc-stream") for thread in threading.enumerate())


def test_open_streams_do_not_take_the_unary_threads():
    """One unary thread; two reflection streams held open (each handler blocks for the next
    request) and two Fetch streams nobody reads. A Lookup still answers at once."""
    layout = layout_of()
    with running_servers() as start:
        server = start(host_capacity=64 << 20, workers=1, stream_workers=8)
        client = start.client(server)
        client.attach("m", layout)
        tokens = prompt(4096)
        client.store(tokens, random_kv(4096, layout, seed=3))  # 15 MiB: a Fetch outruns any window
        before = _stream_threads()
        channel = grpc.insecure_channel(server.address)
        held = threading.Event()
        replies = []

        def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            held.wait(20)

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        streams = [stub.ServerReflectionInfo(requests(), timeout=30) for _ in range(2)]
        for stream in streams:
            replies.append(next(stream))  # the handler is now waiting for a second request
        leases = [client.lookup(tokens) for _ in range(2)]
        fetches = [
            client._stub.Fetch(pb.FetchRequest(lease_id=hit.lease_id, max_chunk_bytes=1 << 20), timeout=30)
            for hit in leases
        ]
        for fetch in fetches:
            next(fetch)  # started; the rest is never read
        assert poll(lambda: _stream_threads() - before >= 4, 10)
        started = time.monotonic()
        hit = client.lookup(tokens, take_lease=False)
        assert hit.hit_tokens == 4096 * 16 and time.monotonic() - started < 2.0
        assert all(reply.list_services_response.service for reply in replies)
        held.set()
        for stream in (*streams, *fetches):
            stream.cancel()
        for lease in leases:
            client.release(lease)
        channel.close()


def test_a_lookup_waiting_on_redis_does_not_hold_up_local_hits(private_redis):
    """One unary thread. A Lookup that must ask a paused Redis waits in `waiting()`, so a
    Lookup of a locally cached prompt, sent after it, answers long before Redis does."""
    from prefixcache.client import CacheClient

    layout = layout_of()
    with serve(
        "--block-size",
        "16",
        "--host-capacity",
        "4MiB",
        "--workers",
        "1",
        "--redis-url",
        private_redis.url,
        "--redis-key-prefix",
        "pooltest",
        "--redis-timeout-ms",
        "5000",
    ) as server:
        # Over gRPC, whose unary pool this is about (the control socket runs a thread per connection).
        grpc_only = {"timeout_s": 20, "control_socket": False}
        with CacheClient(server.address, **grpc_only) as client, CacheClient(server.address, **grpc_only) as other:
            client.attach("m", layout)
            other.attach("m", layout)
            local = prompt(4, start=10)
            client.store(local, random_kv(4, layout, seed=5))
            assert server.backend.cache.remote_link.tier.wait_idle(10)
            private_redis.pause(2500)
            slow = threading.Thread(target=lambda: other.lookup(prompt(4, start=90_000), take_lease=False))
            slow.start()
            assert poll(lambda: server.unary_pool.load()["waiting"] == 1, 5), "the Redis read never started"
            started = time.monotonic()
            assert client.lookup(local, take_lease=False).hit_tokens == 4 * 16
            assert time.monotonic() - started < 1.0 and slow.is_alive()
            slow.join(20)
            assert not slow.is_alive()
