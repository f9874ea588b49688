"""Many machines on one: two service+worker pairs over one Redis Cluster.

Each pair is its own processes with its own host tier (shared memory segment),
as on two hosts; they share only the three-master Redis Cluster, with the same
key prefix. A conversation begun on pair A continues on pair B with cache hits
(B never computed those blocks) and outputs identical to a worker without any
cache, then returns to A and hits what B wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.poll import poll
from tests.support.worker_procs import CacheService, WorkerProcess, start_all, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.process]

BLOCK = 16
SYSTEM = (
    "You are the dispatcher of a regional rail network. Answer with the platform, the departure "
    "time and the connection, in that order. "
) * 3


def _drained(service: CacheService) -> bool:
    """Every block the service committed has been written to Redis (its queue is empty)."""
    with service.client() as client:
        snapshot = client.stats().snapshot
    return (
        snapshot is not None
        and snapshot.remote.get("queue_bytes", 1) == 0
        and snapshot.remote.get("bytes_written", 0) > 0
    )


@pytest.fixture(scope="module")
def two_pairs(redis_cluster, tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("many-machines"))
    service_a = CacheService(root / "a", host_capacity="64MiB", redis_url=redis_cluster.url)
    service_b = CacheService(root / "b", host_capacity="64MiB", redis_url=redis_cluster.url)
    service_b.redis_key_prefix = service_a.redis_key_prefix  # one shared tier, as deployed
    services = [service_a.start(), service_b.start()]
    exact = ("--cache-deadline-ms", "5000", "--hit-policy", "always")  # reuse is asserted, not the policy
    workers = [
        WorkerProcess(root / "wa", service_a, exact),
        WorkerProcess(root / "wb", service_b, exact),
        WorkerProcess(root / "ref", None),
    ]
    try:
        start_all(workers)
        yield services, workers
    finally:
        stop_all(workers)
        for service in services:
            service.stop()


def test_a_conversation_moves_between_machines_with_hits_and_identical_outputs(two_pairs) -> None:
    (service_a, service_b), (worker_a, worker_b, reference) = two_pairs
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which train reaches Lyon before noon on Saturday?"},
    ]
    turns = [(worker_a, service_a), (worker_b, service_b), (worker_a, service_a)]
    previous_prompt = 0
    for turn, (worker, service) in enumerate(turns):
        reply = worker.client.chat(messages, max_tokens=12)
        expected = reference.client.chat(messages, max_tokens=12)
        assert reply.text == expected.text, f"turn {turn}: output differs from the no-cache worker"
        assert reply.prompt_tokens == expected.prompt_tokens
        if turn == 0:
            assert reply.cached_tokens == 0
        else:
            # Everything the previous turn's prompt filled (full blocks) was computed on the
            # other machine and reaches this one only through the cluster.
            assert reply.cached_tokens >= previous_prompt // BLOCK * BLOCK > 0, f"turn {turn}"
            assert reply.cached_tokens % BLOCK == 0 and reply.cached_tokens < reply.prompt_tokens
        poll(lambda s=service: _drained(s), 20, f"service of turn {turn} wrote its blocks to Redis")
        previous_prompt = reply.prompt_tokens
        messages += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": f"And the connection after that, option {turn + 2}?"},
        ]
    with service_b.client() as client:
        promoted = client.stats().snapshot.promotions.get("host", 0)
    assert promoted > 0, "pair B's hits came from Redis (promoted into its host tier)"
