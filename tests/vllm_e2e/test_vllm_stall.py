"""Never block vLLM: a slow service never stalls the requests vLLM is already running.

One engine (the connector scenario's tiny Llama, vLLM prefix caching off) talks to its service
through a loopback proxy whose latency the test sets between phases (tests/slow_proxy.py).
Each phase steps the engine by hand (tests/vllm_driver.py "stall"): request R1 decodes 96
tokens; after its 16th, R2 arrives, whose prompt shares 320 tokens with one the service holds.
- fast link: the baseline of R1's token gaps;
- 0.15 s each way (a Lookup takes ~0.3 s, under the 1.0 s lookup_timeout_s): R2 still loads its
  prefix, and R1's longest gap grows by no more than 0.2 s (a Lookup on the scheduler thread
  stalled it for the whole round trip);
- 0.8 s each way (past the deadline): R2 prefills in full, R1's gaps as above.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.slow_proxy import SlowProxy
from tests.support.poll import poll
from tests.support.worker_procs import CacheService
from tests.vllm_e2e.test_vllm_connector import _gen, _model, _start, _tokens

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]
GRPC_ONLY = ["--no-control-socket"]  # every call through the proxy: no same-host socket around it


def test_a_slow_service_never_stalls_running_requests(tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = tmp_path_factory.mktemp("vllm-stall")
    model = _model(workdir / "model")
    rng = random.Random(5)
    shared = _tokens(rng, 330)
    phases = ("baseline", "in_time", "late")
    arriving = {phase: shared + _tokens(rng, 20) for phase in phases}
    running = {phase: _tokens(rng, 64) for phase in phases}
    service = CacheService(workdir / "service", extra_args=["--block-size", "32", *GRPC_ONLY]).start()
    proxy = SlowProxy(service.port, latency_s=0.0, bytes_per_s=1e9).start()
    connector = {"cache": f"127.0.0.1:{proxy.port}", "hit_policy": "always", "lookup_timeout_s": 1.0, "timeout_s": 10}
    steps: list[dict] = [_gen("warm", [shared])]
    for phase in phases:
        steps.append({"barrier": phase})
        steps.append(
            {
                "stall": phase,
                "running": running[phase],
                "running_tokens": 96,
                "arriving": arriving[phase],
                "arrive_after": 16,
            }
        )
    engine = _start(workdir, "stall", model, steps, connector, apc=False)
    try:
        for phase, latency in zip(phases, (0.0, 0.15, 0.8), strict=True):
            engine.wait_barrier(phase)
            if phase == "baseline":
                assert poll(lambda: service.resident_blocks().get(model.name, 0) >= 10, 60, interval_s=0.2)
            proxy.latency_s = latency
            engine.go(phase)
        result = engine.result()["steps"]
    finally:
        if engine.process.poll() is None:
            engine.process.kill()
            engine.process.wait(timeout=30)
        proxy.stop()
        service.stop()
    worst = {phase: max(result[phase]["gaps"][result[phase]["arrived_at"] :]) for phase in phases}
    print(
        "\nR1's longest token gap after R2 arrives: "
        + ", ".join(f"{p} {1000 * worst[p]:.0f} ms" for p in phases)
        + "; R2 cached / TTFT: "
        + ", ".join(f"{p} {result[p]['cached']} / {1000 * result[p]['ttft_s']:.0f} ms" for p in phases)
    )
    assert result["baseline"]["cached"] == 320 and result["in_time"]["cached"] == 320
    assert result["late"]["cached"] == 0  # past lookup_timeout_s: prefilled in full
    assert worst["in_time"] <= worst["baseline"] + 0.2
    assert worst["late"] <= worst["baseline"] + 0.2


def _decode_step(tokens: int = 8):
    """vLLM's SchedulerOutput of a step that decodes other requests (the engine is busy)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"running": tokens},
        total_num_scheduled_tokens=tokens,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def test_a_lookup_about_to_answer_is_waited_for_within_the_grace(tmp_path: Path) -> None:
    """While vLLM steps others, a request whose Lookup is in flight is skipped a whole step
    (None); with `lookup_grace_s` the scheduler first waits for it, within the grace and within
    a quarter of the last step, so a loopback Lookup answers the first ask."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    block, cached = 32, 8
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=block, dtype="bfloat16")
    namespace = Namespace("grace", "r1", layout)
    rng = random.Random(11)
    prompts = [_tokens(rng, cached * block + 5) for _ in range(10)]
    service = CacheService(tmp_path / "service", extra_args=["--block-size", str(block)]).start()
    try:
        writer = CacheClient(service.address)
        writer.attach(namespace.model, layout, namespace.revision)
        for prompt in prompts:
            kv = torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16)
            assert writer.store(prompt[: cached * block], kv).stored == cached
        writer.close()
        first_ask: dict[float, int] = {}
        for grace in (0.0, 0.1):
            settings = ConnectorSettings.parse(
                {"cache": service.address, "hit_policy": "always", "lookup_timeout_s": 10.0, "lookup_grace_s": grace}
            )
            scheduler = SchedulerSide(ConnectorLink(settings, namespace, "scheduler"), StatsBox(), block)
            try:
                first_ask[grace] = 0
                scheduler.build(_decode_step())
                for number, prompt in enumerate(prompts):
                    time.sleep(0.4)  # vLLM's step: the grace may reach a quarter of it (0.1 s)
                    scheduler.build(_decode_step())
                    request = Request(f"g{grace}-{number}", prompt, SamplingParams(max_tokens=1), None)
                    scheduler.started(request)
                    asks = 0
                    while True:
                        started = time.perf_counter()
                        tokens, load_async = scheduler.match(request, 0)
                        assert time.perf_counter() - started < grace + 0.1  # never beyond the grace
                        asks += 1
                        if tokens is not None:
                            break
                        scheduler.build(_decode_step())  # the step it was skipped for
                    assert tokens == cached * block
                    first_ask[grace] += asks == 1
                    scheduler.finished(request)  # releases the lease
                totals = scheduler.stats.totals
                assert totals.get("lookup_grace_seconds", 0.0) <= len(prompts) * grace
            finally:
                scheduler.close()
    finally:
        service.stop()
    print(f"\nanswered at the first ask: {first_ask}")
    assert first_ask[0.0] <= 2  # without grace: a loopback Lookup is still in flight when vLLM asks
    assert first_ask[0.1] >= len(prompts) - 1  # with it: waited for (one slow answer allowed on a loaded box)


def test_a_lookup_is_awaited_only_when_a_hit_could_repay_the_step(tmp_path: Path) -> None:
    """hit_policy auto, while vLLM steps others: a request whose Lookup is in flight is skipped a
    step (None) only when recomputing what the Lookup could bring at most takes longer than such
    a step (`worth_waiting`); otherwise it prefills now, and saves from the end of vLLM's own
    prefix instead of copying out blocks the cache holds."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    block, cached = 32, 8
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=block, dtype="bfloat16")
    namespace = Namespace("worth", "r1", layout)
    prompt = _tokens(random.Random(12), cached * block + 5)
    service = CacheService(tmp_path / "service", extra_args=["--block-size", str(block), *GRPC_ONLY]).start()
    proxy = SlowProxy(service.port, latency_s=0.1, bytes_per_s=1e9).start()  # every Lookup in flight when asked
    try:
        writer = CacheClient(service.address)
        writer.attach(namespace.model, layout, namespace.revision)
        assert (
            writer.store(
                prompt[: cached * block], torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16)
            ).stored
            == cached
        )
        writer.close()
        # Prefill prior 5 ms + 1 ms per token; no grace, so only the rule decides.
        extra = {"cache": f"127.0.0.1:{proxy.port}", "lookup_timeout_s": 10.0, "lookup_grace_s": 0.0}
        settings = ConnectorSettings.parse(extra | {"prefill_tokens_per_s": 1000})

        def scheduler_after(step_tokens: int) -> SchedulerSide:
            scheduler = SchedulerSide(ConnectorLink(settings, namespace, "scheduler"), StatsBox(), block)
            scheduler.build(_decode_step(step_tokens))  # vLLM is stepping others
            return scheduler

        # A step of 8 tokens (~13 ms): the 256 tokens the Lookup may bring (~256 ms) are worth it.
        waits = scheduler_after(8)
        request = Request("waits", prompt, SamplingParams(max_tokens=1), None)
        waits.started(request)
        assert waits.match(request, 0) == (None, False)
        while (answer := waits.match(request, 0))[0] is None:
            time.sleep(0.02)
        assert answer[0] == cached * block
        assert waits.stats.totals.get("lookup_deferrals", 0) >= 2
        assert waits.stats.totals.get("lookups_not_awaited", 0) == 0
        waits.finished(request)
        waits.close()

        # A step of 1,024 tokens (~1 s): one block beyond vLLM's own 7 (~32 ms) is not.
        goes = scheduler_after(1024)
        request = Request("goes", prompt, SamplingParams(max_tokens=1), None)
        goes.started(request)
        started = time.perf_counter()
        assert goes.match(request, 7 * block) == (0, False)
        assert time.perf_counter() - started < 0.05  # answered without waiting for the Lookup
        assert goes.stats.totals.get("lookups_not_awaited") == 1
        assert goes.stats.totals.get("lookup_deferrals", 0) == 0
        goes.allocated(request, (list(range(cached + 1)),), 0)
        meta = goes.build(_prefill_step(request, (list(range(cached + 1)),), 7 * block))
        assert [(op.start_block, op.block_ids[0]) for op in meta.saves] == [(7, (7,))]  # not blocks 0-6 again
        goes.finished(request)
        goes.close()
    finally:
        proxy.stop()
        service.stop()


def test_lookups_that_keep_missing_are_not_waited_for_until_they_hit_again(tmp_path: Path) -> None:
    """hit_policy auto, while vLLM steps others: every Lookup that brings nothing lowers the hit
    odds (`HitOdds`), until a Lookup in flight is worth neither a grace wait nor a step and its
    request prefills at once, also when vLLM is idle (a workload without reuse stops paying for
    its Lookups). Those Lookups still answer and count, so hits make Lookups worth waiting for
    again."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    block, cached = 32, 8
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=block, dtype="bfloat16")
    namespace = Namespace("odds", "r1", layout)
    rng = random.Random(13)
    stored = _tokens(rng, cached * block + 5)
    service = CacheService(tmp_path / "service", extra_args=["--block-size", str(block), *GRPC_ONLY]).start()
    proxy = SlowProxy(service.port, latency_s=0.1, bytes_per_s=1e9).start()  # every Lookup in flight when asked
    try:
        writer = CacheClient(service.address)
        writer.attach(namespace.model, layout, namespace.revision)
        kv = torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16)
        assert writer.store(stored[: cached * block], kv).stored == cached
        writer.close()
        # Prefill at the prior, 5 ms + 100 tokens/s: the 256 cached tokens are worth 2.56 s at
        # even odds, a decode step of 8 tokens costs 85 ms, the grace 25 ms (a quarter of a step).
        settings = ConnectorSettings.parse(
            {
                "cache": f"127.0.0.1:{proxy.port}",
                "lookup_timeout_s": 10.0,
                "lookup_grace_s": 0.025,
                "prefill_tokens_per_s": 100,
                "presence_table": False,  # else the misses below send no Lookup at all (the next test)
            }
        )
        scheduler = SchedulerSide(ConnectorLink(settings, namespace, "scheduler"), StatsBox(), block)
        totals = scheduler.stats.totals
        numbers = iter(range(1_000))

        def step(tokens: int) -> None:
            time.sleep(0.1)  # stands in for one of vLLM's steps...
            scheduler.prefill.idle()  # ...whose cost stays the prior's (not timed from the sleep)
            scheduler.build(_decode_step(tokens))

        def arrives(prompt: list[int]) -> Request:
            request = Request(f"r{next(numbers)}", prompt, SamplingParams(max_tokens=1), None)
            scheduler.started(request)
            return request

        def waited_for(prompt: list[int]) -> None:
            """Asked while vLLM steps others: grace waits, skipped steps, then the hit."""
            graces, deferrals = totals.get("lookup_grace_waits", 0), totals.get("lookup_deferrals", 0)
            request = arrives(prompt)
            while (answer := scheduler.match(request, 0))[0] is None:
                step(8)
            assert answer[0] == cached * block
            assert totals.get("lookup_grace_waits") > graces and totals.get("lookup_deferrals", 0) > deferrals
            scheduler.finished(request)

        try:
            step(8)
            waited_for(stored)  # odds 1

            step(0)  # vLLM idle: 80 requests whose Lookups find nothing (the last few not awaited)
            misses = [arrives(_tokens(rng, cached * block + 5)) for _ in range(80)]
            for request in misses:
                assert scheduler.match(request, 0) == (0, False)
                scheduler.finished(request)
            assert poll(lambda: scheduler.hit_odds.value < 0.006, 5)  # ~0.002: 2.56 s x 0.006 < a grace
            idle = totals.get("lookup_idle_waits", 0)  # the first of them waited, ~0.1 s (the proxy)
            assert 1 <= idle < 80 and totals.get("lookup_idle_seconds") >= 0.05

            graces, not_awaited = totals.get("lookup_grace_waits"), totals.get("lookups_not_awaited", 0)
            odds, went_ahead = scheduler.hit_odds.value, []
            for tokens in (8, 0):  # stepping others, then idle (0.1 s on: before the first answer can be back)
                step(tokens)
                request = arrives(stored)
                started = time.perf_counter()
                assert scheduler.match(request, 0) == (0, False)  # the odds repay no wait: it prefills now
                assert time.perf_counter() - started < 0.02
                went_ahead.append(request)
            assert totals.get("lookup_grace_waits") == graces and totals.get("lookups_not_awaited") == not_awaited + 2
            assert totals.get("lookup_idle_waits") == idle  # nor an idle wait
            assert poll(lambda: scheduler.hit_odds.value > odds + 0.1, 5)  # their answers, hits, still count
            for request in went_ahead:
                scheduler.finished(request)

            step(8)  # after two hits (odds ~0.44: 1.1 s to gain), both waits are worth it again
            not_awaited = totals.get("lookups_not_awaited")
            waited_for(stored)
            assert totals.get("lookups_not_awaited") == not_awaited
        finally:
            scheduler.close()
    finally:
        proxy.stop()
        service.stop()


def test_prompts_the_service_holds_nothing_more_of_send_no_lookup_and_wait_for_none(tmp_path: Path) -> None:
    """A same-host service without Redis publishes its indexed blocks (prefixcache/presence.py):
    a prompt with nothing cached past vLLM's own prefix sends no Lookup and is answered 0 at once
    (no grace, no deferral, whatever the odds), and its saves start where the cache's copy ends,
    before vLLM's prefix where that is shorter. A prompt the cache holds more of is looked up
    and hits as before, a salted prompt under its own salt; `presence_table: false` looks up every
    prompt."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    block, cached = 32, 8
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=block, dtype="bfloat16")
    namespace = Namespace("presence", "r1", layout)
    rng = random.Random(14)
    stored = _tokens(rng, cached * block)
    service = CacheService(tmp_path / "service", extra_args=["--block-size", str(block)]).start()
    try:
        writer = CacheClient(service.address)
        writer.attach(namespace.model, layout, namespace.revision)
        kv = torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16)
        assert writer.store(stored, kv).stored == cached
        assert writer.store(stored, kv, cache_salt="tenant-1").stored == cached
        writer.close()

        def scheduler_of(presence: bool) -> SchedulerSide:
            extra = {
                "cache": service.address,
                "hit_policy": "always",
                "lookup_grace_s": 0.1,
                "presence_table": presence,
            }
            scheduler = SchedulerSide(
                ConnectorLink(ConnectorSettings.parse(extra), namespace, "scheduler"), StatsBox(), block
            )
            assert scheduler.link.client() is not None  # attached (the connector attaches at start)
            scheduler.build(_decode_step())  # vLLM is stepping others: a Lookup in flight would be waited for
            return scheduler

        scheduler = scheduler_of(True)
        totals = scheduler.stats.totals
        try:
            fresh = Request("fresh", _tokens(rng, cached * block + 5), SamplingParams(max_tokens=1), None)
            scheduler.started(fresh)
            started = time.perf_counter()
            assert scheduler.match(fresh, 0) == (0, False)
            assert time.perf_counter() - started < 0.05
            assert totals.get("lookups", 0) == 0 and totals.get("lookups_skipped") == 1
            scheduler.finished(fresh)

            # vLLM holds the stored 8 blocks itself (sticky routing): nothing to wait for.
            sticky = Request("sticky", stored + _tokens(rng, 40), SamplingParams(max_tokens=1), None)
            scheduler.started(sticky)
            started = time.perf_counter()
            assert scheduler.match(sticky, cached * block) == (0, False)
            assert time.perf_counter() - started < 0.05
            assert totals.get("lookups_skipped") == 2 and totals.get("lookup_grace_waits", 0) == 0
            assert totals.get("lookups", 0) == 0  # the table showed the cache holds nothing more: none sent
            scheduler.finished(sticky)

            # The cache holds 5 blocks of a prompt whose 7 vLLM holds (it cached the reply it
            # decoded): no Lookup is waited for, and the saves start at block 5, not 7.
            turn = Request(
                "turn", stored[: 5 * block] + _tokens(rng, 3 * block + 5), SamplingParams(max_tokens=1), None
            )
            scheduler.started(turn)
            assert scheduler.match(turn, 7 * block) == (0, False)
            assert totals.get("lookups_skipped") == 3
            ids = (list(range(cached + 1)),)
            scheduler.allocated(turn, ids, 0)
            meta = scheduler.build(_prefill_step(turn, ids, 7 * block))
            assert [(op.start_block, op.block_ids[0]) for op in meta.saves] == [(5, (5, 6, 7))]
            scheduler.finished(turn)

            # The cache holds more than vLLM: looked up, and hit.
            behind = Request("behind", stored + _tokens(rng, 5), SamplingParams(max_tokens=1), None)
            scheduler.started(behind)
            while (answer := scheduler.match(behind, 2 * block))[0] is None:
                scheduler.build(_decode_step())
            assert answer[0] == (cached - 2) * block and totals.get("lookups_skipped") == 3
            assert totals.get("lookups") == 1  # behind's, the one that could (and did) hit
            scheduler.finished(behind)

            # Salted requests read the table under their salt: nothing held under "tenant-2", so
            # no Lookup; "tenant-1" holds the prompt, so a Lookup, and a hit.
            salts = []
            for salt in ("tenant-2", "tenant-1"):
                salted = Request(salt, stored + _tokens(rng, 5), SamplingParams(max_tokens=1), None, cache_salt=salt)
                scheduler.started(salted)
                while (answer := scheduler.match(salted, 0))[0] is None:
                    scheduler.build(_decode_step())
                salts.append((answer[0], totals.get("lookups"), totals.get("lookups_skipped")))
                scheduler.finished(salted)
            assert salts == [(0, 1, 4), (cached * block, 2, 4)]
        finally:
            scheduler.close()

        unread = scheduler_of(False)
        try:
            fresh = Request("fresh-2", _tokens(rng, cached * block + 5), SamplingParams(max_tokens=1), None)
            unread.started(fresh)
            while unread.match(fresh, 0)[0] is None:
                unread.build(_decode_step())
            assert unread.stats.totals.get("lookups") == 1 and unread.stats.totals.get("lookups_skipped", 0) == 0
            unread.finished(fresh)
        finally:
            unread.close()
    finally:
        service.stop()


def _prefill_step(request, block_ids: tuple[list[int], ...], computed: int):
    """vLLM's SchedulerOutput of the step that prefills `request` from `computed` tokens on."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    request.num_computed_tokens = computed
    new = NewRequestData.from_request(request, block_ids)
    scheduled = len(request.prompt_token_ids) - computed
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={request.request_id: scheduled},
        total_num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def test_leases_vllm_did_not_need_go_back_with_the_next_lookup(tmp_path: Path, monkeypatch) -> None:
    """A request whose hit vLLM holds itself (sticky routing: its earlier turns ran here) needs
    no lease: the scheduler hands it back with the next request's Lookup, not by a Release of its
    own (one RPC fewer per request); closing hands back what is left."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client import link as client_link
    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    monkeypatch.setattr(client_link, "RELEASE_HOLD_S", 60.0)  # no Release of its own during the test
    block, cached = 32, 8
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=block, dtype="bfloat16")
    namespace = Namespace("returns", "r1", layout)
    stored = _tokens(random.Random(17), cached * block + 5)
    service = CacheService(tmp_path / "service", extra_args=["--block-size", str(block)]).start()
    observer = CacheClient(service.address)
    try:
        observer.attach(namespace.model, layout, namespace.revision)
        kv = torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16)
        assert observer.store(stored[: cached * block], kv).stored == cached

        def leases() -> int:
            return observer.stats().snapshot.active_leases

        # The presence table unread: with it, these requests (vLLM holds all the cache does) send none.
        settings = ConnectorSettings.parse(
            {"cache": service.address, "lookup_timeout_s": 10.0, "presence_table": False}
        )
        scheduler = SchedulerSide(ConnectorLink(settings, namespace, "scheduler"), StatsBox(), block)
        try:
            for number in range(3):
                request = Request(f"held-{number}", stored, SamplingParams(max_tokens=1), None)
                pending = scheduler.started(request).pending
                assert pending is not None and pending.result(5) is not None  # answered, with its lease
                assert leases() == 1  # this one's; the one before went back with this Lookup
                assert scheduler.match(request, cached * block) == (0, False)  # vLLM holds the whole hit
                scheduler.finished(request)
            assert leases() == 1  # waiting for the next Lookup
        finally:
            scheduler.close()
        assert leases() == 0
    finally:
        observer.close()
        service.stop()
