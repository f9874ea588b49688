"""The cache store is off the response path: a slow service never delays a response's end.

A real service behind a slow TCP proxy (tests/slow_proxy.py): every gRPC call through it costs
at least two proxy latencies, so a store (Reserve + Commit) would hold a response for at least
four. The stream's `[DONE]` must follow its last chunk at once, the next request (non-streaming)
must end as soon as the first did, and the store must still land (in the background).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from tests.slow_proxy import SlowProxy
from tests.support.poll import poll
from tests.support.worker_procs import CacheService, WorkerProcess

pytestmark = pytest.mark.process

LATENCY_S = 0.3  # per direction: one RPC through the proxy takes >= 0.6 s, a store >= 1.2 s
PROMPT = "Plan a slow trip along the coast, with every stop, cost and risk listed in order. " * 3


@dataclass(frozen=True)
class _Via:
    address: str  # what WorkerProcess reads of a CacheService


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory, request):
    workdir = tmp_path_factory.mktemp("store-path")
    service = CacheService(workdir / "service", extra_args=["--no-control-socket"]).start()  # calls via the proxy
    proxy = SlowProxy(service.port, latency_s=0.0, bytes_per_s=1e9).start()  # fast while the worker attaches
    worker = WorkerProcess(workdir / "worker", _Via(f"127.0.0.1:{proxy.port}"), ("--cache-deadline-ms", "10000"))
    try:
        worker.launch().wait_ready()
        yield worker, proxy
    finally:
        worker.terminate()
        worker.stop()
        proxy.stop()
        service.stop()


def _stream_times(worker: WorkerProcess, salt: str) -> tuple[float, float, float]:
    """(seconds to the chunk with the finish reason, to [DONE], the sent time) of one streamed completion."""
    payload = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "cache_salt": salt}
    sent = time.monotonic()
    finished_at = done_at = None
    for event in worker.client.stream("/v1/completions", payload):
        now = time.monotonic()
        if event == "[DONE]":
            done_at = now
        elif event["choices"] and event["choices"][0]["finish_reason"] is not None:
            finished_at = now
    assert finished_at is not None and done_at is not None
    return finished_at - sent, done_at - sent, sent


def test_done_never_waits_for_a_slow_store(slow_worker) -> None:
    worker, proxy = slow_worker
    salt = f"store-path-{random.getrandbits(32):08x}"
    # The prompt's first block stored first (fast): the service's presence table then shows it
    # held, so the request below sends its Lookup (through the slow proxy), and stores the rest.
    tokenized = worker.client.post("/tokenize", {"prompt": PROMPT, "cache_salt": salt}).body
    first_block = tokenized["tokens"][: tokenized["block_size"] + 1]
    worker.client.complete(first_block, max_tokens=1, cache_salt=salt)
    poll(lambda: _cached_blocks(worker, salt) == 1, 30, "the first block stored")
    proxy.latency_s = LATENCY_S
    try:
        finished, done, _ = _stream_times(worker, salt)
        assert finished >= 2 * LATENCY_S, "the Lookup went through the slow proxy"
        assert done - finished < LATENCY_S, f"[DONE] came {done - finished:.2f} s after the last chunk"

        # The next request, sent at once, neither waits for the first one's store (>= 1.2 s, on
        # the store thread) nor, non-streaming, for its own: it ends as early as the first.
        sent = time.monotonic()
        reply = worker.client.complete(PROMPT, max_tokens=4, cache_salt=salt + "-b")
        whole = time.monotonic() - sent
        assert reply.body["usage"]["prompt_tokens"] >= 32
        assert whole < done + 4 * LATENCY_S * 0.75, f"non-streaming took {whole:.2f} s vs {done:.2f} s streamed"

        # ...and the store still landed, in the background.
        full = tokenized["count"] // tokenized["block_size"]
        poll(lambda: _cached_blocks(worker, salt) == full, 30, "the streamed request's blocks stored")
        # The gauge the replay's interleaved A/B waits on (worker_metrics.StoreSettle) says so too.
        assert ("prefixcache_worker_stores_pending", ()) in worker.client.metrics()
        poll(lambda: worker.client.metric("prefixcache_worker_stores_pending") == 0, 30, "no store pending")
    finally:
        proxy.latency_s = 0.0
    assert worker.client.metric("prefixcache_worker_stores_dropped_total") == 0


def _cached_blocks(worker: WorkerProcess, salt: str) -> int:
    return worker.client.post("/tokenize", {"prompt": PROMPT, "cache_salt": salt}).body["cached_blocks"]
