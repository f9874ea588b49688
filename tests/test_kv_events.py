"""KV events (services/cache_server/kv_events.py): a subscriber on real ZMQ sockets rebuilds the
cache's block set exactly after stores, LRU evictions, TTL expiry and a flush; a late joiner
catches up through replay; salted blocks carry their salt. tests/vllm_e2e/test_kv_events_vllm.py
decodes the same stream with vLLM's own classes."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from prefixcache.kinds import TierKind
from prefixcache_services.cache_server.kv_events import END_SEQ, KvEventPublisher
from tests.support.core import TINY, ManualClock, kv_for, make_cache, namespace
from tests.support.poll import poll

pytestmark = pytest.mark.unit

BS = TINY.block_size


def blocks(*ids: int) -> list[int]:
    return [b for b in ids for _ in range(BS)]


class Subscriber:
    """Applies every batch in sequence order to a set of (medium, hash); checks the sequence."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.held: set[tuple[str, bytes]] = set()
        self.stored: dict[bytes, dict] = {}
        self.next_seq = 0

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, (seq, self.next_seq)
        self.next_seq += 1
        _ts, events, _rank = msgspec.msgpack.decode(payload)
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.held.clear()
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    self.held.remove((event["medium"], h))
            else:
                assert event["type"] == "BlockStored" and len(event["block_hashes"]) == 1
                self.held.add((event["medium"], event["block_hashes"][0]))
                self.stored[event["block_hashes"][0]] = event

    def drain(self) -> None:
        while self.socket.poll(50):
            _topic, seq, payload = self.socket.recv_multipart()
            self.apply(int.from_bytes(seq, "big"), payload)


def cache_blocks(cache) -> set[tuple[str, bytes]]:
    index = cache.index
    return {
        ({TierKind.DEVICE: "GPU", TierKind.HOST: "CPU"}[TierKind(int(index.tier[r]))], bytes(index.hash_of(r)))
        for r in range(index.capacity)
        if index.tier[r] >= 0
    }


def synced(publisher, subscriber, cache) -> bool:
    publisher.publish_changes()  # as the thread would, now (serialised with it)
    subscriber.drain()
    return subscriber.held == cache_blocks(cache)


def test_a_subscriber_rebuilds_the_block_set_through_every_kind_of_change() -> None:
    clock = ManualClock()
    ctx = zmq.Context()
    with make_cache(host_slots=6, device_slots=2, clock=clock, ttl_s=10.0) as cache:
        publisher = KvEventPublisher(lambda: cache, "tcp://127.0.0.1:0", interval_s=3600)
        subscriber = Subscriber(ctx, publisher.endpoint)
        try:
            ns = cache.attach(namespace())
            assert synced(publisher, subscriber, cache) and subscriber.held == set()  # nothing yet
            a = blocks(1, 2, 3)
            cache.store(ns, a, kv_for(a, cache.layout))  # stores
            assert poll(lambda: synced(publisher, subscriber, cache), 5)
            assert len(subscriber.held) == 3
            stored = next(e for e in subscriber.stored.values() if e["parent_block_hash"] is None)
            assert stored["token_ids"] == [1] * BS and stored["block_size"] == BS and stored["extra_keys"] is None
            cache.lookup(ns, a)  # promotes a0, a1 to the device tier (2 slots): CPU -> GPU
            b = blocks(4, 5, 6, 7, 8)
            cache.store(ns, b, kv_for(b, cache.layout))  # 8 blocks in 6 host slots: LRU evictions
            assert poll(lambda: synced(publisher, subscriber, cache), 5)
            assert {medium for medium, _ in subscriber.held} == {"GPU", "CPU"}
            clock.advance(11)
            assert cache.expire() > 0  # TTL expiry
            assert poll(lambda: synced(publisher, subscriber, cache), 5)
            assert subscriber.held == set()
            salted = cache.attach(namespace(cache_salt="s1"))
            c = blocks(1, 2)
            cache.store(salted, c, kv_for(c, cache.layout))
            assert poll(lambda: synced(publisher, subscriber, cache), 5)
            assert [e["extra_keys"] for e in subscriber.stored.values() if e["token_ids"] == [2] * BS][-1] == [["s1"]]
            cache.flush()
            publisher.publish_changes()
            _topic, _seq, payload = subscriber.socket.recv_multipart()
            assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
        finally:
            subscriber.socket.close(0)
            publisher.close()
            ctx.destroy(linger=0)  # closes any socket an assertion left open


def test_a_late_subscriber_catches_up_through_replay() -> None:
    ctx = zmq.Context()
    with make_cache(host_slots=8) as cache:
        publisher = KvEventPublisher(lambda: cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", interval_s=0.02)
        try:
            ns = cache.attach(namespace())
            for first in (10, 20, 30):
                tokens = blocks(first, first + 1)
                cache.store(ns, tokens, kv_for(tokens, cache.layout))
                assert poll(lambda n=publisher.published: publisher.published > n, 5)
            late = Subscriber(ctx, publisher.endpoint)  # joins after three batches
            replay = ctx.socket(zmq.DEALER)
            replay.connect(publisher.replay_endpoint)
            replay.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert replay.poll(5000)
                _empty, _topic, seq, payload = replay.recv_multipart()
                if seq == END_SEQ:
                    break
                late.apply(int.from_bytes(seq, "big"), payload)
            assert late.next_seq == 3 and late.held == cache_blocks(cache) and len(late.held) == 6
            tokens = blocks(40)
            cache.store(ns, tokens, kv_for(tokens, cache.layout))  # live again after the replay
            assert poll(lambda: (late.drain(), late.held == cache_blocks(cache))[1], 5)
            replay.close(0)
            late.socket.close(0)
        finally:
            publisher.close()
            ctx.destroy(linger=0)  # closes any socket an assertion left open
