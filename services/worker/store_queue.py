"""A request's store and lease release, run off the inference thread.

The inference thread only copies the prompt's new blocks out of the model's KV (the one copy
it must make while that KV is alive) and hands them here; the Reserve, the shared-memory
scatter and the Commit, then the Release of the request's lease, run on one background thread.
So neither the client's response nor the next request waits for a store. A job may name an
event to wait for first (the request's `Finished.delivered`, set once its response's end is
written, at most `AFTER_WAIT_S`): the store's Python work would otherwise contend for the GIL
with the event loop writing that response's last chunks.

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
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixcache.client.api import Hit

from .cache_link import WorkerLink

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4  # stores waiting at once: a few requests' worth of KV copies
AFTER_WAIT_S = 1.0  # the longest a job waits for its `after` event (a response that is never written)


@dataclass(frozen=True)
class _Job:
    tokens: list[int]
    kv: torch.Tensor | None  # None: only the release
    start_block: int
    salt: str | None
    hit: Hit | None
    after: threading.Event | None = None
    retention_s: float | None = None  # the request's retention hint (prompt_cache_retention)


class StoreQueue:
    def __init__(self, link: WorkerLink, registry: CollectorRegistry, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.link = link
        self.capacity = capacity
        self.dropped = Counter(
            "prefixcache_worker_stores_dropped",
            "Stores dropped because the background store queue was full",
            registry=registry,
        )
        self.pending = Gauge(
            "prefixcache_worker_stores_pending",
            "Requests in progress that will queue a store, and background stores and lease releases queued "
            "or running (0: the store thread is idle and nothing will be queued before the next request)",
            registry=registry,
        )
        self._jobs: deque[_Job] = deque()
        self._stores = 0  # queued jobs that carry KV
        self._expected = 0  # requests announced (`expect`) whose job is not submitted yet
        self._busy = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cache-store", daemon=True)
        self._thread.start()

    def expect(self) -> None:
        """A request that will `submit` when it ends has started: the pending gauge counts it
        from now on, so a reader never sees 0 between a response's end and its store's submit."""
        with self._cond:
            self._expected += 1
            self._publish()

    def _publish(self) -> None:  # under self._cond
        self.pending.set(len(self._jobs) + self._busy + self._expected)

    def submit(
        self,
        tokens: list[int],
        kv: torch.Tensor | None,
        start_block: int,
        salt: str | None,
        hit: Hit | None,
        after: threading.Event | None = None,
        retention_s: float | None = None,
    ) -> None:
        """Queue a store of `kv` (None or empty: nothing to store) and then `hit`'s release, to run
        once `after` is set (or `AFTER_WAIT_S` has passed); never blocks."""
        if kv is not None and not len(kv):
            kv = None
        with self._cond:
            self._expected = max(0, self._expected - 1)
            if kv is not None and self._stores >= self.capacity:
                self.dropped.inc()
                kv = None
            if kv is not None or (hit is not None and hit.lease_id is not None):
                self._jobs.append(_Job(tokens, kv, start_block, salt, hit, after, retention_s))
                self._stores += kv is not None
                self._cond.notify()
            self._publish()

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
                if job.after is not None:
                    job.after.wait(AFTER_WAIT_S)
                if job.kv is not None:
                    self.link.store(job.tokens, job.kv, job.start_block, job.salt, job.retention_s)
                self.link.release(job.hit)
            except Exception:  # noqa: BLE001 - a store must never stop the thread (the link is fail-open)
                log.exception("background cache store failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._publish()
                    self._cond.notify_all()
