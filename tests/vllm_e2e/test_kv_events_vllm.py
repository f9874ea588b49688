"""The service's KV events decoded with vLLM's own classes (`vllm.distributed.kv_events`), as
Dynamo's and llm-d's indexers decode a vLLM engine's: a `KVEventBatch` decoder rebuilds the
cache's block set after stores, evictions, TTL expiry and a flush; a late subscriber catches up
through the replay endpoint; a salted block carries its salt in `extra_keys`. No engine runs."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from prefixcache_services.cache_server.kv_events import END_SEQ, KvEventPublisher
from tests.support.core import TINY, ManualClock, kv_for, make_cache, namespace
from tests.test_kv_events import cache_blocks

pytestmark = pytest.mark.unit

BS = TINY.block_size
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def blocks(*ids: int) -> list[int]:
    return [b for b in ids for _ in range(BS)]


class VllmIndexer:
    """What a router's indexer keeps: (medium, block hash), from vLLM's event classes only."""

    def __init__(self) -> None:
        self.held: set[tuple[str | None, bytes | int]] = set()
        self.salts: dict[bytes | int, object] = {}
        self.seq = 0

    def apply(self, seq: bytes, payload: bytes) -> None:
        assert int.from_bytes(seq, "big") == self.seq
        self.seq += 1
        for event in DECODER.decode(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockRemoved):
                self.held -= {(event.medium, h) for h in event.block_hashes}
            else:
                assert isinstance(event, BlockStored) and event.block_size == BS
                assert len(event.token_ids) == BS * len(event.block_hashes)
                self.held |= {(event.medium, h) for h in event.block_hashes}
                for i, h in enumerate(event.block_hashes):
                    self.salts[h] = None if event.extra_keys is None else event.extra_keys[i]


def test_vllm_classes_rebuild_the_block_set_and_replay_catches_up() -> None:
    clock = ManualClock()
    ctx = zmq.Context()
    with make_cache(host_slots=6, device_slots=2, clock=clock, ttl_s=10.0) as cache:
        publisher = KvEventPublisher(lambda: cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", interval_s=3600)
        live = ctx.socket(zmq.SUB)
        live.setsockopt(zmq.SUBSCRIBE, b"")
        live.connect(publisher.endpoint)
        indexer = VllmIndexer()

        def sync() -> bool:
            publisher.publish_changes()
            while live.poll(100):
                _topic, seq, payload = live.recv_multipart()
                indexer.apply(seq, payload)
            return indexer.held == cache_blocks(cache)

        try:
            ns = cache.attach(namespace())
            salted = cache.attach(namespace(cache_salt="tenant-salt"))
            while not sync():  # the SUB socket's subscription reaches the PUB socket asynchronously
                pass
            a, b = blocks(1, 2, 3), blocks(4, 5, 6, 7, 8)
            cache.store(ns, a, kv_for(a, cache.layout))
            assert sync() and len(indexer.held) == 3
            cache.lookup(ns, a)  # promotion to the device tier: CPU -> GPU
            cache.store(ns, b, kv_for(b, cache.layout))  # LRU evictions
            assert sync() and {m for m, _ in indexer.held} == {"GPU", "CPU"}
            clock.advance(11)
            assert cache.expire() > 0
            assert sync() and indexer.held == set()
            c = blocks(9, 9)
            cache.store(salted, c, kv_for(c, cache.layout))
            assert sync() and len(indexer.held) == 2
            assert {indexer.salts[h] for _, h in indexer.held} == {("tenant-salt",)}
            cache.flush()
            assert sync() and indexer.held == set()

            late = VllmIndexer()  # replays everything from sequence 0
            replay = ctx.socket(zmq.DEALER)
            replay.connect(publisher.replay_endpoint)
            replay.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert replay.poll(5000)
                _empty, _topic, seq, payload = replay.recv_multipart()
                if seq == END_SEQ:
                    break
                late.apply(seq, payload)
            assert late.seq == indexer.seq and late.held == indexer.held == set()
            replay.close(0)
        finally:
            live.close(0)
            publisher.close()
            ctx.destroy(linger=0)  # closes any socket an assertion left open
