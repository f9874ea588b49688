"""KV events in vLLM's wire format: what the local tiers gain and lose, for routers' indexers.

The service publishes vLLM's `KVEventBatch` (vllm/distributed/kv_events.py) as msgpack over a
ZMQ PUB socket (encoded with msgspec, as vLLM does), so an indexer that subscribes to vLLM engines (Dynamo's KV router, llm-d's
precise-prefix scorer) subscribes to the service the same way:

- each message is three frames: topic, an 8-byte big-endian sequence number (0, 1, 2, ... per
  publisher) and the payload `[ts, [event, ...], data_parallel_rank]`;
- an event is a map tagged by `type`: `BlockStored` (`block_hashes`, `parent_block_hash`,
  `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys`), `BlockRemoved`
  (`block_hashes`, `medium`) or `AllBlocksCleared`, as msgspec encodes vLLM's classes;
- a ROUTER socket (the replay endpoint) answers a request frame holding a start sequence number
  (8 bytes, big-endian) with every buffered message from there, then `(b"", -1, b"")`.

What is published. `medium` is `GPU` for the device tier and `CPU` for the host tier; a block
moving between them is removed from one and stored in the other. Block hashes are the cache's
own 16-byte chained xxh3_128 digests (bytes): the hash of a block's namespace root (model,
revision, layout, kv_scale, tenant and salt) chained over each block's token ids
(`prefixcache.hashing.Hasher.block_hashes`), not vLLM's hashes; a router keyed by them asks
Match, or recomputes them with that function. A salted namespace's blocks carry the salt as
`extra_keys` (one `(salt,)` per block, as vLLM publishes a `cache_salt`); its hashes already differ
from every other namespace's, so no router can score one tenant's or salt's prefix for another.
Blocks that only Redis holds are not published.

How. No hook in the cache's hot paths: every `interval_s` the publisher copies each index row's
tier and digest under the cache lock, compares them with the previous copy (two vectorised
passes over the arrays) and turns the rows that changed into events, reading the new blocks'
token ids and parents under the same lock. Every store, spill, promotion, eviction (LRU,
capacity, TTL, manual) and flush therefore shows up within one interval, and a subscriber that
applies every batch in order holds exactly the block set of the last copy. A change undone
within one interval is not seen. The cost is O(index rows) per interval while something changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from prefixcache.cache import PrefixCache
from prefixcache.index import ROOT
from prefixcache.kinds import TierKind

log = logging.getLogger(__name__)

MEDIUM = {TierKind.DEVICE: "GPU", TierKind.HOST: "CPU"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENCODER = msgspec.msgpack.Encoder()  # the encoder vLLM's publisher uses: the same bytes for the same values


class KvEventPublisher:
    """Publishes the cache's block changes (`cache()` is None until the first Attach)."""

    def __init__(
        self,
        cache: Callable[[], PrefixCache | None],
        endpoint: str,
        replay_endpoint: str | None = None,
        interval_s: float = 0.05,
        buffer_steps: int = 10_000,
        topic: str = "",
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"kv events interval must be > 0, got {interval_s}")
        self._cache = cache
        self._interval_s = interval_s
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._tier: np.ndarray | None = None
        self._words: np.ndarray | None = None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self.endpoint = _bind(self._pub, endpoint)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, replay_endpoint)
        self._publishing = threading.Lock()  # the thread and a direct `publish_changes` share the PUB socket
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # -- the publisher thread (owns both sockets) ------------------------------------------
    def _run(self) -> None:
        """Publish every `interval_s`; answer replay requests as they come (within 50 ms)."""
        due = 0.0
        while not self._stop.is_set():
            try:
                self._serve_replay()
                if time.monotonic() >= due:
                    due = time.monotonic() + self._interval_s
                    self.publish_changes()
            except Exception:  # a failed diff must not end the stream; the next one retries
                log.exception("kv events: publishing failed")
            wait = max(0.0, min(due - time.monotonic(), 0.05))
            if self._replay is not None:
                self._replay.poll(int(wait * 1000))
            else:
                self._stop.wait(wait)
        try:
            self.publish_changes()  # the last changes before the service closes
        except Exception:
            log.exception("kv events: the last batch failed")

    def publish_changes(self) -> None:
        """Diff the index now and publish one batch if anything changed (the thread's step)."""
        cache = self._cache()
        if cache is None:
            return
        with self._publishing:
            events = self._diff(cache)
            if not events:
                return
            payload = _ENCODER.encode([time.time(), events, None])
            seq = self._seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: malformed replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._publishing:  # the buffer is appended to under it
                batches = list(self._buffer)
            for seq, payload in batches:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _diff(self, cache: PrefixCache) -> list[dict]:
        index = cache.index
        with cache._lock:  # one consistent copy of the rows (the cache exposes no snapshot call)
            tier = index.tier.copy()
            words = index.map.words.copy()
            if self._tier is None or self._words is None:
                self._tier, self._words = np.full_like(tier, -1), np.zeros_like(words)
            changed = np.flatnonzero((tier != self._tier) | (words != self._words).any(axis=0))
            if not len(changed):
                return []
            digest_size = index.map.digest_size
            old_tier, old_words = self._tier, self._words

            def digest(table: np.ndarray, row: int) -> bytes:
                return table[:, row].tobytes()[:digest_size]

            removed: dict[str, list[bytes]] = {}
            stored: list[dict] = []
            for row in changed.tolist():
                if old_tier[row] >= 0:
                    removed.setdefault(MEDIUM[TierKind(int(old_tier[row]))], []).append(digest(old_words, row))
                if tier[row] >= 0:
                    parent = int(index.parent[row])
                    salt = cache.namespaces.by_row(int(index.namespace[row])).namespace.cache_salt
                    stored.append(
                        {
                            "type": "BlockStored",
                            "block_hashes": [digest(words, row)],
                            "parent_block_hash": None if parent == ROOT else digest(words, parent),
                            "token_ids": index.tokens[row].tolist(),
                            "block_size": index.block_size,
                            "lora_id": None,
                            "medium": MEDIUM[TierKind(int(tier[row]))],
                            "lora_name": None,
                            "extra_keys": None if not salt else [[salt]],
                        }
                    )
            self._tier, self._words = tier, words
        events: list[dict] = []
        if not (tier >= 0).any() and (old_tier >= 0).any():
            events.append({"type": "AllBlocksCleared"})  # a flush (or the last block leaving)
        else:
            events.extend(
                {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium} for medium, hashes in removed.items()
            )
        return events + stored


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind `endpoint` (a port of 0 binds a free one) and return the bound address."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = socket.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    socket.bind(endpoint)
    return endpoint
