"""A cache hit is never slower than recomputing: Redis behind a deliberately slow link.

Redis sits behind `tests/slow_proxy.py` (latency per chunk, a bandwidth cap). Two levels:

- The cache and its Redis tier (no model): with the asking worker's prefill cost as budget,
  a short prefix held only by the slow Redis is declined without any I/O once the link has
  been measured; a probe whose link turns out slower than its estimate stops at the budget's
  deadline; a fast Redis is still probed and hit.
- End to end (service + cached worker + `--no-cache` worker as processes): blocks computed
  earlier sit in Redis; the service is restarted (empty host tier) onto the slow proxy. For
  short prefixes the cached worker recomputes instead of waiting, and its time to first token
  stays within a few percent of the no-cache worker's on the same prompts (medians of
  interleaved requests); the decision counters say why. Back on a direct Redis, the same kind
  of hit (longer prefixes) is taken, with outputs identical to the no-cache worker's.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.cache import PrefixCache
from prefixcache.config import CacheConfig, DType, KVLayout
from prefixcache.remote_link import PROBE_BATCH
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.redis import RedisOptions, RedisTier
from prefixcache.transfer import ProbeBudget, TransferEstimate
from tests.slow_proxy import SlowProxy
from tests.support.core import ManualClock, kv_for, namespace, read_blocks, same_bytes
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.process]

LAYOUT = KVLayout(layers=4, kv_heads=2, head_dim=32, block_size=16, dtype=DType.BFLOAT16)  # the tiny model's
BS = LAYOUT.block_size
WORKER_S_PER_TOKEN = 20e-6  # 0.32 ms to recompute a block
PROXY_LATENCY_S = 0.1  # per direction: a probe round trip takes >= 0.2 s
PROXY_BYTES_PER_S = 8e6  # 2 ms per 16 KiB block


@contextmanager
def tier_cache(url: str, key_prefix: str, host_slots: int = 256) -> Iterator[tuple[PrefixCache, str]]:
    options = RedisOptions(url=url, key_prefix=key_prefix, socket_timeout_s=5.0, write_timeout_s=5.0)
    host = HostTier(LAYOUT, host_slots * LAYOUT.block_bytes)
    cache = PrefixCache(
        CacheConfig(host_capacity=host_slots * LAYOUT.block_bytes),
        LAYOUT,
        host,
        remote=RedisTier(options),
        clock=ManualClock(),
    )
    try:
        yield cache, cache.attach(namespace(LAYOUT))
    finally:
        cache.close()


def tokens_for(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BS)]


@pytest.fixture
def populated(private_redis: RedisServer) -> Iterator[tuple[RedisServer, str, dict[str, list[int]]]]:
    """Redis holding a few prompts' blocks, written by a cache that has gone away since."""
    prefix = f"ns{secrets.token_hex(4)}"
    prompts = {
        "teach": tokens_for(1, 4),
        "short": tokens_for(2, 4),
        "long": tokens_for(3, 96),
        "medium": tokens_for(4, 16),
    }
    with tier_cache(private_redis.url, prefix) as (writer, ns):
        for tokens in prompts.values():
            writer.store(ns, tokens, kv_for(tokens, LAYOUT))
        assert writer.remote_link.tier.wait_idle(10)
    yield private_redis, prefix, prompts


def _timed_lookup(cache: PrefixCache, ns: str, tokens: list[int], budget: float | None):
    started = time.perf_counter()
    result = cache.lookup(ns, tokens, recompute_s_per_token=budget)
    return result, time.perf_counter() - started


def test_short_prefix_in_a_slow_redis_is_declined_without_waiting(populated) -> None:
    server, prefix, prompts = populated
    with (
        SlowProxy(server.port, PROXY_LATENCY_S, PROXY_BYTES_PER_S) as proxy,
        tier_cache(proxy.url, prefix) as (cache, ns),
    ):
        _, taught = _timed_lookup(cache, ns, prompts["teach"], WORKER_S_PER_TOKEN)  # the prior says fast: it probes
        assert taught >= 2 * PROXY_LATENCY_S
        link = cache.remote_link.tier.link_estimate()
        assert link.samples >= 1 and link.latency_s >= PROXY_LATENCY_S

        result, seconds = _timed_lookup(cache, ns, prompts["short"], WORKER_S_PER_TOKEN)
        assert result.hit_tokens == 0 and result.remote_blocks_declined == 4
        assert seconds < PROXY_LATENCY_S, "a declined probe must not touch the slow link"
        remote = cache.stats().remote
        assert remote["probes_declined"] == 1 and remote["probe_blocks_declined"] == 4

        # Without a budget the same lookup waits for the slow link, and the blocks were there.
        result, seconds = _timed_lookup(cache, ns, prompts["short"], None)
        assert result.hit_tokens == 4 * BS and seconds >= 2 * PROXY_LATENCY_S
        assert same_bytes(read_blocks(cache, result.locations), kv_for(prompts["short"], LAYOUT))


def test_probe_stops_at_the_budget_deadline(populated) -> None:
    """The estimate is still the (fast) prior, the link is slow: one round trip, then no more."""
    server, prefix, prompts = populated
    with (
        SlowProxy(server.port, PROXY_LATENCY_S, PROXY_BYTES_PER_S) as proxy,
        tier_cache(proxy.url, prefix) as (cache, ns),
    ):
        per_trip = min(cache.remote_link.tier.options.max_fetch_bytes // LAYOUT.block_bytes, PROBE_BATCH)
        result, seconds = _timed_lookup(cache, ns, prompts["long"], WORKER_S_PER_TOKEN)
        assert result.hit_tokens == per_trip * BS
        assert result.remote_blocks_declined == 96 - per_trip
        one_trip = 2 * PROXY_LATENCY_S + per_trip * LAYOUT.block_bytes / PROXY_BYTES_PER_S
        assert one_trip <= seconds < 2.5 * one_trip  # uncapped, it would take three such trips


def test_fast_redis_is_still_probed_and_hit(populated) -> None:
    server, prefix, prompts = populated
    with tier_cache(server.url, prefix) as (cache, ns):
        result, _ = _timed_lookup(cache, ns, prompts["medium"], WORKER_S_PER_TOKEN)
        assert result.hit_tokens == 16 * BS and result.remote_blocks_declined == 0
        assert same_bytes(read_blocks(cache, result.locations), kv_for(prompts["medium"], LAYOUT))
        assert cache.stats().remote["probes_declined"] == 0


def test_checking_fetched_frames_counts_against_the_budget(populated) -> None:
    """Over a fast Redis, a probe is still declined when checking what comes back (a frame MAC,
    say) would cost more than recomputing; and the cache measures that check as it fetches."""
    server, prefix, prompts = populated
    with tier_cache(server.url, prefix) as (cache, ns):
        prompt = cache.namespaces.prompt(ns, prompts["medium"])
        saving = WORKER_S_PER_TOKEN * BS
        slow_check = TransferEstimate(latency_s=0.0, bytes_per_s=LAYOUT.block_bytes / (10 * saving))
        declined = ProbeBudget(16, saving)
        frames = cache.remote_link.tier.fetch(
            ns, prompt.hashes, frame_bytes=LAYOUT.block_bytes, prefix_only=True, budget=declined, verify=slow_check
        )
        assert frames == [None] * 16 and declined.declined == 16
        taken = ProbeBudget(16, saving)
        frames = cache.remote_link.tier.fetch(
            ns,
            prompt.hashes,
            frame_bytes=LAYOUT.block_bytes,
            prefix_only=True,
            budget=taken,
            verify=TransferEstimate(0.0, 10e9),
        )
        assert all(frames) and taken.declined == 0
        assert cache.remote_link.verify_estimate().samples == 0  # the prior, until it has checked
        assert cache.lookup(ns, prompts["medium"], recompute_s_per_token=WORKER_S_PER_TOKEN).hit_tokens == 16 * BS
        assert cache.remote_link.verify_estimate().samples == 1


def test_estimates_of_consecutive_steps_add() -> None:
    fetch, check = TransferEstimate(1e-3, 1e9), TransferEstimate(1e-5, 1e9)
    both = fetch.then(check)
    assert both.seconds(2e9) == pytest.approx(fetch.seconds(2e9) + check.seconds(2e9))


# ---- end to end: service + workers as processes ----------------------------------------------------

E2E_LATENCY_S = 0.05  # per direction through the proxy: a probe costs >= 0.1 s
E2E_BYTES_PER_S = 4e6  # 4 ms per 16 KiB block, or slower: see slow_as_recomputing
PROMPT_BLOCKS = 48  # 768-token prompts: prefill dominates the cache's fixed costs
SHORT_PREFIX_BLOCKS = 4  # held in Redis, recomputed over the slow link
LONG_PREFIX_BLOCKS = 16  # held in Redis, taken over a direct link
PAIRS = 12  # interleaved (cached, no-cache) TTFT samples
TTFT_RATIO = 1.10  # median of per-pair ratios cached / no-cache <= 1.10 (+ 5 ms of slack):
TTFT_SLACK_S = 0.005  # pairs share the box's load at that moment, so drift cancels out
WARMUP = 3


def e2e_prompt(kind: int, index: int, prefix_blocks: int, suffix: int = 0) -> list[int]:
    """`prefix_blocks` blocks shared by every prompt of (kind, index), then a tail unique to `suffix`."""
    base = 1000 + 5000 * kind + 97 * index
    prefix = [(base + i) % 90_000 + 10 for i in range(prefix_blocks * BS)]
    tail = [(base * 7 + 31 * suffix + i) % 90_000 + 10 for i in range((PROMPT_BLOCKS - prefix_blocks) * BS)]
    return prefix + tail


def stream_ttft(worker, tokens: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed bytes, cached_tokens) of a one-token completion."""
    connection = worker.client.connection()
    try:
        body = {
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        connection.request(
            "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        first = time.perf_counter() - started
        assert response.status == 200, response.read()
        cached = None
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: ") :]).get("usage")
                if usage:
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached is not None, "no usage chunk"
        return first, cached
    finally:
        connection.close()


def worker_metrics(worker) -> dict[tuple[str, tuple], float]:
    status, body, _ = worker.client.request("GET", "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def metric(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def reconnect(worker, timeout_s: float = 60.0) -> None:
    """Until the worker's cache link is up again after a service restart (prompts too short to cache)."""
    deadline = time.monotonic() + timeout_s
    while True:
        worker.client.complete([11, 12, 13], max_tokens=1)
        status, body, _ = worker.client.request("GET", "/health")
        if status == 200 and json.loads(body).get("cache") == "up":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker cache link not up after {timeout_s}s: {body!r}")
        time.sleep(0.25)


def redis_keys(server: RedisServer, key_prefix: str) -> int:
    with server.client() as client:
        return sum(1 for _ in client.scan_iter(match=f"{key_prefix}:*", count=1000))


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Redis (and a slow proxy to it), a service over the direct Redis, a cached and a no-cache worker;
    Redis already holds the prefixes both tests use (computed by the cached worker)."""
    from tests.support.poll import poll
    from tests.support.worker_procs import CacheService, WorkerProcess, start_all

    workdir = tmp_path_factory.mktemp("never-slower")
    redis_server = RedisServer(workdir / "redis").start()
    proxy = SlowProxy(redis_server.port, E2E_LATENCY_S, E2E_BYTES_PER_S).start()
    service = CacheService(workdir / "service", redis_url=redis_server.url).start()
    cached = WorkerProcess(workdir / "cached", service, ("--cache-deadline-ms", "5000"))
    reference = WorkerProcess(workdir / "reference", None)
    try:
        start_all([cached, reference])
        expected = 0
        for kind, count, blocks in ((0, WARMUP + PAIRS, SHORT_PREFIX_BLOCKS), (1, 4, LONG_PREFIX_BLOCKS)):
            for index in range(count):
                cached.client.complete(e2e_prompt(kind, index, blocks)[: blocks * BS + 1], max_tokens=1)
                expected += blocks
                # The worker stores after the response, on a queue of its own: one prompt at a time, so
                # none is dropped and none lands late in the restarted service's local tier.
                assert poll(
                    lambda held=expected: redis_keys(redis_server, service.redis_key_prefix) >= held,
                    30.0,
                    "prefix in Redis",
                )
        yield redis_server, proxy, service, cached, reference
    finally:
        with ThreadPoolExecutor(3) as pool:  # each takes seconds to drain on a busy box; overlap them
            list(pool.map(lambda process: process.stop(), (cached, reference, service)))
        proxy.stop()
        redis_server.stop()


def _restart_onto(service, url: str, worker) -> None:
    service.redis_url = url
    service.restart()
    reconnect(worker)


def slow_as_recomputing(proxy: SlowProxy, reference) -> float:
    """Slows the proxy until a block takes 4x as long to cross it as the no-cache worker takes to
    prefill one (a whole prompt's time over its blocks: an upper bound of the marginal cost), so
    the premise holds on a CPU of any speed; returns the bandwidth set."""
    prompt_s = min(stream_ttft(reference, e2e_prompt(0, 900 + i, SHORT_PREFIX_BLOCKS, suffix=7))[0] for i in range(3))
    proxy.bytes_per_s = min(E2E_BYTES_PER_S, LAYOUT.block_bytes / (4 * prompt_s / PROMPT_BLOCKS))
    return proxy.bytes_per_s


def test_short_prefixes_over_a_slow_redis_are_recomputed_as_fast_as_without_a_cache(e2e) -> None:
    _redis, proxy, service, cached, reference = e2e
    slow_as_recomputing(proxy, reference)
    _restart_onto(service, proxy.url, cached)
    for index in range(WARMUP):  # the service's first probes teach it how slow the link is
        stream_ttft(cached, e2e_prompt(0, index, SHORT_PREFIX_BLOCKS, suffix=1))
    before, stats_before = worker_metrics(cached), service.client().stats().snapshot.remote

    ttft_cached, ttft_reference = [], []
    fetched = 0  # prefixes the service fetched over the slow link all the same (see below)
    for pair in range(PAIRS):
        tokens = e2e_prompt(0, WARMUP + pair, SHORT_PREFIX_BLOCKS, suffix=1)
        order = (cached, reference) if pair % 2 == 0 else (reference, cached)
        for worker in order:
            seconds, cached_tokens = stream_ttft(worker, tokens)
            (ttft_cached if worker is cached else ttft_reference).append(seconds)
            if worker is cached and cached_tokens:
                fetched += 1
                assert cached_tokens == SHORT_PREFIX_BLOCKS * BS  # a whole prefix, never a part of it
            else:
                assert cached_tokens == 0, "over the slow link the prefix must be recomputed"
    # The link's estimate is refreshed by fresh samples (write-through included) and falls back
    # to its prior once stale, so the service fetches again now and then to re-measure the link.
    # On a slow machine (2026-12-06, AMD EPYC without AVX-512: 6 of 11 runs, main before the
    # control socket) one of the twelve pairs did, the last; more than one would be a real regression.
    assert fetched <= 1, f"{fetched} of {PAIRS} short prefixes were fetched over the slow link"

    after, stats_after = worker_metrics(cached), service.client().stats().snapshot.remote
    taken = metric(after, "prefixcache_worker_hit_decisions_total", decision="taken") - metric(
        before, "prefixcache_worker_hit_decisions_total", decision="taken"
    )
    misses = metric(after, "prefixcache_worker_hit_decisions_total", decision="miss") - metric(
        before, "prefixcache_worker_hit_decisions_total", decision="miss"
    )
    declined = metric(after, "prefixcache_worker_remote_blocks_declined_total") - metric(
        before, "prefixcache_worker_remote_blocks_declined_total"
    )
    assert taken == fetched and misses == PAIRS - fetched
    assert declined >= (PAIRS - fetched) * SHORT_PREFIX_BLOCKS  # the service declined on the worker's budget ...
    assert stats_after["probe_blocks_declined"] - stats_before["probe_blocks_declined"] >= declined
    assert stats_after["link_latency_s"] >= E2E_LATENCY_S  # ... because it measured the link
    # Meanwhile the service wrote the prompts' blocks through at the link's pace (batches sized to
    # their deadline): none failed, and the link's breaker, which reads go by too, never tripped.
    assert stats_after["bytes_written"] > stats_before["bytes_written"]
    assert stats_after["writes_failed"] == stats_before["writes_failed"] == 0
    assert stats_after["breaker_trips"] == stats_before["breaker_trips"] == 0

    median_cached, median_reference = statistics.median(ttft_cached), statistics.median(ttft_reference)
    ratio = statistics.median(c / r for c, r in zip(ttft_cached, ttft_reference))
    print(
        f"TTFT medians over {PAIRS} interleaved pairs: cached {median_cached * 1e3:.1f} ms, "
        f"no-cache {median_reference * 1e3:.1f} ms; median ratio {ratio:.3f}"
    )
    assert ratio <= TTFT_RATIO + TTFT_SLACK_S / median_reference


def _why_not_taken(before: dict, after: dict, service) -> str:
    """The worker's decisions and estimates and the service's Redis counters, for a failure message."""
    changed = {
        f"{name}{dict(labels)}": value - before.get((name, labels), 0.0)
        for (name, labels), value in after.items()
        if "decision" in name or "declined" in name or name.endswith("seconds_per_token")
    }
    return f"worker: {changed}; service Redis: {service.client().stats().snapshot.remote}"


def test_longer_prefixes_over_a_fast_redis_are_still_taken(e2e) -> None:
    """Each of four 16-block prefixes held in Redis over a direct link is loaded, all but at most
    one: the worker decides on timings it measured, and on a loaded 2-core box one read that was
    preempted can make one load look slower than a 5 ms prefill (seen in CI twice). A declined
    hit is recomputed whole, never loaded in part, and the output is the same either way."""
    redis_server, _proxy, service, cached, reference = e2e
    _restart_onto(service, redis_server.url, cached)
    before = worker_metrics(cached)
    loaded = []
    for index in range(4):
        tokens = e2e_prompt(1, index, LONG_PREFIX_BLOCKS, suffix=2)
        hit = cached.client.complete(tokens, max_tokens=8)
        assert hit.cached_tokens in (0, LONG_PREFIX_BLOCKS * BS)
        loaded.append(hit.cached_tokens > 0)
        assert hit.text == reference.client.complete(tokens, max_tokens=8).text
    after = worker_metrics(cached)
    assert sum(loaded) >= 3, _why_not_taken(before, after, service)

    def decided(decision: str) -> float:
        return metric(after, "prefixcache_worker_hit_decisions_total", decision=decision) - metric(
            before, "prefixcache_worker_hit_decisions_total", decision=decision
        )

    assert (decided("taken"), decided("recompute")) == (sum(loaded), 4 - sum(loaded))
