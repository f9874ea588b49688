"""A request's store and lease release, run off the inference thread.

The inference thread only copies the prompt's new blocks out of the model's KV (the one copy
it must make while that KV is alive) and hands them here; the Reserve, the shared-memory
scatter and the Commit, then the Release of the request's lease, run on one background thread.
So neither the client's response nor the next request waits for a store.

Bounded: at most `capacity` stores wait at a time (each holds a copy of KV); a store that
finds the queue full is dropped and counted (`prefixcache_worker_stores_dropped`), but its
lease release is still queued (a release holds no KV, and a lease left to expire pins blocks
for its TTL). The store goes before the release: the lease keeps the hit's blocks, the parents
of the stored ones, resident until their children are committed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter

from prefixcache.client.api import Hit

from .cache_link import CacheLink

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4  # stores waiting at once: a few requests' worth of KV copies


@dataclass(frozen=True)
class _Job:
    tokens: list[int]
    kv: torch.Tensor | None  # None: only the release
    start_block: int
    salt: str | None
    hit: Hit | None


class StoreQueue:
    def __init__(self, link: CacheLink, registry: CollectorRegistry, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.link = link
        self.capacity = capacity
        self.dropped = Counter(
            "prefixcache_worker_stores_dropped",
            "Stores dropped because the background store queue was full",
            registry=registry,
        )
        self._jobs: deque[_Job] = deque()
        self._stores = 0  # queued jobs that carry KV
        self._busy = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cache-store", daemon=True)
        self._thread.start()

    def submit(
        self, tokens: list[int], kv: torch.Tensor | None, start_block: int, salt: str | None, hit: Hit | None
    ) -> None:
        """Queue a store of `kv` (None or empty: nothing to store) and then `hit`'s release; never blocks."""
        if kv is not None and not len(kv):
            kv = None
        if kv is None and (hit is None or hit.lease_id is None):
            return
        with self._cond:
            if kv is not None and self._stores >= self.capacity:
                self.dropped.inc()
                kv = None
                if hit is None or hit.lease_id is None:
                    return
            self._jobs.append(_Job(tokens, kv, start_block, salt, hit))
            self._stores += kv is not None
            self._cond.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once every queued job has run (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued (up to `timeout_s`), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return  # closed and drained
                job = self._jobs.popleft()
                self._stores -= job.kv is not None
                self._busy = True
            try:
                if job.kv is not None:
                    self.link.store(job.tokens, job.kv, job.start_block, job.salt)
                self.link.release(job.hit)
            except Exception:  # noqa: BLE001 - a store must never stop the thread (the link is fail-open)
                log.exception("background cache store failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
