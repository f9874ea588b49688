"""The load-or-recompute decision and the online estimates behind it (pure logic, no processes).

- `choose` (prefixcache/client/hit_policy.py, both engines' one rule): taken / partial /
  recompute / miss from the bytes per read path and the prefill cost, with the break-even
  prefix length computed by hand; as vLLM's scheduler asks it (past its own prefix cache's
  blocks, all or nothing, on the fixed `UNTIMED_LOADS` priors);
- `PrefillMeter`: the one prefill-cost estimator, from timed prefills or from an engine's steps
  (what is not the engine's compute left out);
- `Hit.usable_blocks`: the engine computes at least the last prompt token;
- `TransferMeter` (prefixcache/transfer.py): recovers latency and bandwidth from timed
  transfers, follows a link that slows down, falls back to its prior when samples are alike
  in size or stale;
- `blocks_worth_fetching` and `ProbeBudget`: the service's Redis probe plan and time cap;
- `HitPolicy` (services/worker/hit_policy.py): decisions and estimates show up in the worker's
  Prometheus metrics.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.client.api import Hit
from prefixcache.client.hit_policy import (
    HIT_ODDS_HIT_WEIGHT,
    HIT_ODDS_WEIGHT,
    UNTIMED_LOADS,
    Decision,
    Estimates,
    HitOdds,
    PrefillMeter,
    ReadPath,
    Verdict,
    choose,
    worth_waiting,
)
from prefixcache.config import DType, KVLayout
from prefixcache.kinds import TierKind
from prefixcache.results import BlockLocations
from prefixcache.transfer import ProbeBudget, TransferEstimate, TransferMeter, blocks_worth_fetching
from prefixcache_services.worker.engine import PrefillResult
from prefixcache_services.worker.hit_policy import HitPolicy
from tests.support.core import ManualClock

pytestmark = pytest.mark.unit

TOKENS = 16
FAST_MAPPED = TransferEstimate(latency_s=10e-6, bytes_per_s=4e9)
FAST_STREAM = TransferEstimate(latency_s=1e-3, bytes_per_s=500e6)
INSTALL = TransferEstimate(latency_s=0.0, bytes_per_s=4e9)
PREFILL = TransferEstimate(latency_s=5e-3, bytes_per_s=20e3)  # 50 us per token: 0.8 ms per block


def estimates(prefill=PREFILL, mapped=FAST_MAPPED, stream=FAST_STREAM, install=INSTALL) -> Estimates:
    return Estimates(prefill, mapped, stream, install)


LAYOUT = KVLayout(layers=4, kv_heads=2, head_dim=32, block_size=TOKENS, dtype=DType.BFLOAT16)
BLOCK_BYTES = LAYOUT.block_bytes


def hit(usable: int, mapped: int | None = None, leased: int | None = None) -> Hit:
    """A leased hit of `leased` blocks (default `usable`), the first `mapped` of them mapped, on a
    prompt that leaves `usable` of them loadable (it ends inside block `usable`)."""
    leased = usable if leased is None else leased
    tiers = [TierKind.HOST] * leased
    locations = BlockLocations([int(t) for t in tiers], list(range(leased)))
    prompt = usable * TOKENS + 1
    return Hit("0" * 16, prompt, leased * TOKENS, locations, None, 7, 1e9, 0, usable if mapped is None else mapped)


# -- choose ------------------------------------------------------------------------------------


def test_nothing_usable_is_a_miss():
    decision = choose(hit(0), LAYOUT, estimates())
    assert decision == Decision(Verdict.MISS, 0, None, 0.0, 0.0)


def test_mapped_hit_is_taken_whole():
    decision = choose(hit(8), LAYOUT, estimates())
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.TAKEN, 8, ReadPath.MAPPED)
    assert decision.recompute_s == pytest.approx(8 * TOKENS / PREFILL.bytes_per_s)
    assert decision.load_s == pytest.approx(FAST_MAPPED.seconds(8 * BLOCK_BYTES) + INSTALL.seconds(8 * BLOCK_BYTES))
    assert decision.saved_s > 0


def test_recompute_when_prefill_is_faster_than_loading():
    # 1e9 tokens/s: 16 ns per block to recompute, far less than any copy.
    decision = choose(hit(8), LAYOUT, estimates(prefill=TransferEstimate(0.0, 1e9)))
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.RECOMPUTE, 0, ReadPath.MAPPED)
    assert decision.load_s > decision.recompute_s


def test_always_take_loads_even_when_recomputing_is_estimated_faster():
    fast_prefill = estimates(prefill=TransferEstimate(0.0, 1e9))
    decision = choose(hit(8), LAYOUT, fast_prefill, always_take=True)
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.TAKEN, 8, ReadPath.MAPPED)
    assert choose(hit(0), LAYOUT, fast_prefill, always_take=True).verdict is Verdict.MISS


def test_slow_stream_short_prefix_recomputes_long_prefix_is_taken():
    """A 20 ms stream latency is worth paying only once enough blocks ride on it."""
    slow = TransferEstimate(latency_s=0.02, bytes_per_s=1e9)
    est = estimates(stream=slow)
    block_s = TOKENS / PREFILL.bytes_per_s
    per_block_load = BLOCK_BYTES / slow.bytes_per_s + BLOCK_BYTES / INSTALL.bytes_per_s
    break_even = math.ceil(slow.latency_s / (block_s - per_block_load))  # first n with n*saving > latency
    short = choose(hit(break_even - 1, mapped=0), LAYOUT, est)
    long = choose(hit(break_even + 1, mapped=0), LAYOUT, est)
    assert (short.verdict, short.blocks, short.path) == (Verdict.RECOMPUTE, 0, ReadPath.STREAM)
    assert (long.verdict, long.blocks, long.path) == (Verdict.TAKEN, break_even + 1, ReadPath.STREAM)


def test_stream_cost_counts_the_whole_lease():
    """Usable is one block short of the lease (the last token is computed), but the stream moves all."""
    slow = TransferEstimate(latency_s=0.0, bytes_per_s=BLOCK_BYTES / 1e-3)  # 1 ms per block moved
    est = estimates(stream=slow, prefill=TransferEstimate(0.0, TOKENS / 1.5e-3))  # 1.5 ms per block recomputed
    assert choose(hit(2, mapped=0, leased=2), LAYOUT, est).verdict is Verdict.TAKEN  # 2 ms < 3 ms
    assert choose(hit(1, mapped=0, leased=2), LAYOUT, est).verdict is Verdict.RECOMPUTE  # 2 ms > 1.5 ms


def test_partial_takes_the_mapped_prefix_when_the_stream_is_slow():
    slow = TransferEstimate(latency_s=0.5, bytes_per_s=1e6)
    decision = choose(hit(10, mapped=3), LAYOUT, estimates(stream=slow))
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.PARTIAL, 3, ReadPath.MAPPED)


def test_stream_of_everything_beats_a_short_mapped_prefix_when_fast():
    decision = choose(hit(10, mapped=3), LAYOUT, estimates())
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.TAKEN, 10, ReadPath.STREAM)


@pytest.mark.parametrize("usable,mapped", [(1, 0), (1, 1), (5, 2), (7, 7), (7, 9)])
def test_never_more_than_usable(usable, mapped):
    for prefill in (PREFILL, TransferEstimate(0.0, 1e9), TransferEstimate(0.0, 1.0)):
        decision = choose(hit(usable, mapped=mapped, leased=max(usable, mapped)), LAYOUT, estimates(prefill=prefill))
        assert 0 <= decision.blocks <= usable
        assert (decision.blocks == 0) == (decision.verdict is Verdict.RECOMPUTE)


# -- choose as vLLM's scheduler asks it ---------------------------------------------------------------

VLLM_LAYOUT = KVLayout(layers=8, kv_heads=2, head_dim=128, block_size=32, dtype=DType.BFLOAT16)  # 256 KiB blocks


def worth_loading(blocks: int, mapped: bool, leased: int, tokens_per_s: float, local: int = 0) -> bool:
    """vLLM's question: load blocks `local` .. `local + blocks` of a `leased`-block hit (all of
    them mapped, or none) at a prefill of `tokens_per_s`, or recompute them?"""
    bs = VLLM_LAYOUT.block_size
    locations = BlockLocations([int(TierKind.HOST)] * leased, list(range(leased)))
    lease = Hit("0" * 16, leased * bs + 1, leased * bs, locations, None, 7, 1e9, 0, leased if mapped else 0)
    estimates = replace(UNTIMED_LOADS, prefill=TransferEstimate(5e-3, tokens_per_s))
    decision = choose(lease, VLLM_LAYOUT, estimates, first=local, end=local + blocks, partial=False)
    assert decision.blocks in (0, blocks)  # all it offered or nothing
    return decision.blocks > 0


def test_the_auto_policy_loads_only_what_beats_prefill() -> None:
    assert worth_loading(10, mapped=True, leased=10, tokens_per_s=5e3)
    # a very fast prefill (a big GPU) beats a stream of the whole lease
    assert not worth_loading(1, mapped=False, leased=40, tokens_per_s=1e6)
    # ...but not a memcpy of the same block out of shared memory at a CPU's prefill rate
    assert worth_loading(1, mapped=True, leased=40, tokens_per_s=5e3)
    # the stream path pays for the whole lease: one usable block of a 40-block lease is not worth it
    assert not worth_loading(1, mapped=False, leased=40, tokens_per_s=5e3)
    # blocks vLLM holds itself are neither loaded nor counted as saved
    # (a stream of a 10-block lease, ~10.7 ms: worth it for 9 blocks, not for the 1 past vLLM's own 8)
    assert worth_loading(9, mapped=False, leased=10, tokens_per_s=5e3)
    assert not worth_loading(1, mapped=False, leased=10, tokens_per_s=5e3, local=8)


def test_all_or_nothing_never_loads_a_mapped_part() -> None:
    """With `partial` False a hit mapped only in part goes by the stream or not at all."""
    slow = TransferEstimate(latency_s=0.5, bytes_per_s=1e6)
    est = estimates(stream=slow)
    assert choose(hit(10, mapped=3), LAYOUT, est).verdict is Verdict.PARTIAL
    decision = choose(hit(10, mapped=3), LAYOUT, est, partial=False)
    assert (decision.verdict, decision.blocks, decision.path) == (Verdict.RECOMPUTE, 0, ReadPath.STREAM)
    fast = choose(hit(10, mapped=3), LAYOUT, estimates(), first=1, partial=False)
    assert (fast.verdict, fast.blocks, fast.path) == (Verdict.TAKEN, 9, ReadPath.STREAM)
    assert choose(hit(10), LAYOUT, estimates(), first=10).verdict is Verdict.MISS


# -- PrefillMeter -------------------------------------------------------------------------------------


def test_prefill_meter_learns_from_timed_prefills() -> None:
    meter = PrefillMeter(TransferEstimate(5e-3, 5e3), clock=ManualClock())
    assert meter.tokens_per_s == 5e3 and meter.estimate().samples == 0  # the prior
    for tokens in (64, 512, 128, 1024):
        meter.observe(tokens, 0.004 + tokens * 100e-6)
    assert meter.s_per_token == pytest.approx(100e-6) and meter.estimate().latency_s == pytest.approx(0.004)


def test_prefill_meter_measures_an_engines_steps() -> None:
    clock = ManualClock()
    meter = PrefillMeter(TransferEstimate(5e-3, 5e3), stale_s=120.0, clock=clock)
    # vLLM's steps: 20 ms a step + 2000 tokens/s (a slow CPU), prefill and decode steps mixed.
    for tokens in [512, 4, 4, 256, 4, 1024, 8, 128] * 3:
        meter.step(tokens)
        clock.advance(0.020 + tokens / 2000)
    meter.step(0)
    estimate = meter.estimate()
    assert estimate.samples == 24 and meter.steps == 24
    assert estimate.latency_s == pytest.approx(0.020, rel=1e-6) and meter.tokens_per_s == pytest.approx(2000, rel=1e-6)
    # At the measured 2000 tokens/s one block's recompute (16 ms) is slower than streaming a
    # 10-block lease (~11 ms); at the prior's 5000 tokens/s (6.4 ms) it is not.
    assert not worth_loading(1, mapped=False, leased=10, tokens_per_s=5e3)
    assert worth_loading(1, mapped=False, leased=10, tokens_per_s=meter.tokens_per_s)

    # What is not the engine's compute stays out: the caller's own Lookups, the planned loads, idle waits.
    clock = ManualClock()
    meter = PrefillMeter(TransferEstimate(5e-3, 5e3), stale_s=120.0, clock=clock)
    for tokens in [64, 640] * 4:
        meter.step(tokens, load_s=0.5)  # the worker copies for 0.5 s inside this step's forward
        clock.advance(0.5 + 0.010 + tokens / 1000)
        meter.exclude(0.3)  # a Lookup in the next step's scheduling
        clock.advance(0.3)
    meter.step(64)
    clock.advance(30.0)  # the engine waited 30 s for a request...
    meter.idle()  # ...which the scheduler saw arrive with nothing running
    meter.step(64)
    assert meter.estimate().samples == 8 and meter.tokens_per_s == pytest.approx(1000, rel=1e-6)


def test_prefill_meter_logs_its_fit_in_the_line_the_vllm_tests_read(caplog) -> None:
    """tests/vllm_e2e/test_vllm_connector.py finds vLLM's fit in the engine's log by this line."""
    clock = ManualClock()
    meter = PrefillMeter(clock=clock, name="prefixcache scheduler: vLLM's measured step cost", unit="steps")
    with caplog.at_level(logging.INFO, logger="prefixcache.client.hit_policy"):
        meter.log()
        for tokens in [64, 640] * 4 + [0]:
            meter.step(tokens)
            clock.advance(0.010 + tokens / 1000)
    first, eighth = (r.getMessage() for r in caplog.records)
    assert first == "prefixcache scheduler: vLLM's measured step cost 5 ms + 5000 tokens/s (the prior)"
    found = re.search(r"measured step cost ([\d.e+-]+) ms \+ ([\d.e+-]+) tokens/s \((\d+) steps\)", eighth)
    assert found is not None and found.groups() == ("10", "1000", "8")  # logged at the 8th timed step


# -- Hit: usable and mapped blocks -------------------------------------------------------------------


@pytest.mark.parametrize("prompt,usable", [(100, 4), (64, 3), (65, 4), (17, 1), (16, 0), (1, 0)])
def test_usable_blocks_leave_the_last_prompt_token_to_compute(prompt, usable):
    locations = BlockLocations([int(TierKind.HOST)] * 4, range(4))
    assert Hit("0" * 16, prompt, 4 * TOKENS, locations, None, 7, 1e9).usable_blocks == usable
    assert Hit("0" * 16, prompt, 0, BlockLocations([], []), None, None, None).usable_blocks == 0


def test_a_hit_pickles_as_it_is():
    """vLLM's scheduler hands its Hit to the workers pickled: equal, and its arrays still read-only."""
    original = replace(hit(3, mapped=2, leased=4), remote_blocks_declined=1)
    copy = pickle.loads(pickle.dumps(original))
    assert copy == original and copy.usable_blocks == 3 and copy.mapped_blocks == 2
    assert not copy.locations.tiers.flags.writeable and not copy.locations.slots.flags.writeable


@pytest.mark.parametrize(
    "mapped_tiers,mapped",
    [({TierKind.HOST}, 2), ({TierKind.HOST, TierKind.DEVICE}, 4), (set(), 0), ({TierKind.DEVICE}, 0)],
)
def test_client_counts_leading_mapped_blocks(mapped_tiers, mapped):
    from prefixcache.client.api import _leading_in

    tiers = np.array([TierKind.HOST, TierKind.HOST, TierKind.DEVICE, TierKind.HOST], dtype=np.int8)
    assert _leading_in(tiers, [int(t) for t in mapped_tiers]) == mapped


# -- TransferMeter ----------------------------------------------------------------------------------


def test_meter_returns_the_prior_until_measured():
    prior = TransferEstimate(0.001, 1e8)
    assert TransferMeter(prior).estimate() is prior


def test_meter_recovers_latency_and_bandwidth():
    meter = TransferMeter(TransferEstimate(0.0005, 1e9))
    for nbytes in [0, 16 << 10, 1 << 20, 64 << 10, 4 << 20, 0, 256 << 10] * 3:
        meter.observe(nbytes, 0.002 + nbytes / 100e6)
    got = meter.estimate()
    assert got.latency_s == pytest.approx(0.002, rel=1e-6)
    assert got.bytes_per_s == pytest.approx(100e6, rel=1e-6)
    assert got.samples == 21


def test_meter_with_alike_sizes_keeps_the_prior_bandwidth():
    meter = TransferMeter(TransferEstimate(0.0005, 1e9))
    for _ in range(5):
        meter.observe(16 << 10, 0.03)
    got = meter.estimate()
    assert got.bytes_per_s == pytest.approx(1e9)
    assert got.latency_s == pytest.approx(0.03 - (16 << 10) / 1e9)


def test_meter_follows_a_link_that_slows_down():
    meter = TransferMeter(TransferEstimate(0.0005, 1e9), alpha=0.2)
    sizes = [0, 1 << 20, 64 << 10, 512 << 10]
    for i in range(20):
        meter.observe(sizes[i % 4], 0.0002 + sizes[i % 4] / 1e9)
    assert meter.estimate().latency_s < 0.001
    for i in range(40):
        meter.observe(sizes[i % 4], 0.02 + sizes[i % 4] / 4e6)
    got = meter.estimate()
    assert got.latency_s == pytest.approx(0.02, rel=0.05)
    assert got.bytes_per_s == pytest.approx(4e6, rel=0.05)


def test_a_clipped_meter_moves_a_bounded_step_for_one_preempted_transfer():
    """One transfer 50x slower than the rest (preempted on a busy host), of any of the sizes seen:
    unclipped it multiplies the estimate (up to ~33x here, enough to turn the next hits into
    recomputes); clipped at 2x the fit moves by under 1.8x at every size."""
    sizes = [64 << 10, 1 << 20, 256 << 10, 512 << 10]
    worst = {None: 0.0, 2.0: 0.0}
    for clip in worst:
        for slow in sizes:
            meter = TransferMeter(TransferEstimate(0.0005, 1e9), clip=clip)
            for i in range(20):
                meter.observe(sizes[i % 4], 0.0001 + sizes[i % 4] / 1e9)
            steady = {size: meter.estimate().seconds(size) for size in sizes}
            meter.observe(slow, 50 * steady[slow])
            worst[clip] = max(worst[clip], *(meter.estimate().seconds(size) / steady[size] for size in sizes))
    assert worst[None] > 10
    assert 1.0 < worst[2.0] < 1.8


def test_a_clipped_meter_still_follows_a_link_that_slows_down():
    meter = TransferMeter(TransferEstimate(0.0005, 1e9), alpha=0.2, clip=2.0)
    sizes = [0, 1 << 20, 64 << 10, 512 << 10]
    for i in range(20):
        meter.observe(sizes[i % 4], 0.0002 + sizes[i % 4] / 1e9)
    for i in range(80):  # 100x slower for good: followed a bounded step per sample
        meter.observe(sizes[i % 4], 0.02 + sizes[i % 4] / 4e6)
    got = meter.estimate()
    assert got.latency_s == pytest.approx(0.02, rel=0.05)
    assert got.bytes_per_s == pytest.approx(4e6, rel=0.05)
    with pytest.raises(ValueError, match="clip"):
        TransferMeter(TransferEstimate(0.0005, 1e9), clip=1.0)


def test_meter_goes_back_to_the_prior_when_stale():
    clock = ManualClock()
    prior = TransferEstimate(0.0005, 1e9)
    meter = TransferMeter(prior, stale_s=30.0, clock=clock)
    meter.observe(0, 0.5)
    assert meter.estimate().latency_s == pytest.approx(0.5)
    clock.advance(31.0)
    assert meter.estimate() is prior
    meter.observe(0, 0.1)  # the old samples are gone, not averaged in
    assert meter.estimate().latency_s == pytest.approx(0.1)


def test_meter_ignores_clockless_samples_and_rejects_negative_sizes():
    meter = TransferMeter(TransferEstimate(0.0005, 1e9))
    meter.observe(100, 0.0)
    meter.observe(100, float("nan"))
    assert meter.estimate().samples == 0
    with pytest.raises(ValueError, match="nbytes"):
        meter.observe(-1, 0.1)
    with pytest.raises(ValueError, match="bytes_per_s"):
        TransferEstimate(0.0, 0.0)


# -- the service's probe plan -------------------------------------------------------------------------


def test_no_blocks_worth_fetching_when_each_costs_more_than_it_saves():
    slow = TransferEstimate(0.0, 4e6)  # 4 ms per 16 KiB block
    assert blocks_worth_fetching(slow, 1000, BLOCK_BYTES, 32, saving_per_block_s=0.001) == 0


def test_latency_bound_probe_only_pays_for_long_prefixes():
    link = TransferEstimate(0.02, 1e9)  # 20 ms per round trip, bandwidth no object
    saving = 0.001  # 1 ms per block recomputed
    assert blocks_worth_fetching(link, 8, BLOCK_BYTES, 32, saving) == 0
    assert blocks_worth_fetching(link, 128, BLOCK_BYTES, 32, saving) == 128
    # A last trip for a few blocks costs more than it saves: stop after the whole trips.
    assert blocks_worth_fetching(link, 100, BLOCK_BYTES, 32, saving) == 96
    assert blocks_worth_fetching(link, 33, BLOCK_BYTES, 32, saving) == 32


def test_probe_budget_plans_once_and_stops_at_its_deadline():
    link = TransferEstimate(0.0005, 1e9)
    budget = ProbeBudget(blocks=100, saving_per_block_s=0.001)
    assert budget.grant(32, link, BLOCK_BYTES, 32, now=0.0) == 32
    assert budget.planned == 100 and budget.deadline == pytest.approx(100 * 0.001 / budget.margin)
    assert budget.grant(32, link, BLOCK_BYTES, 32, now=0.05) == 32  # on time
    assert budget.grant(32, link, BLOCK_BYTES, 32, now=0.079) == 0  # past the time the blocks would save
    assert (budget.closed, budget.asked, budget.declined) == (True, 64, 36)
    assert budget.grant(4, link, BLOCK_BYTES, 32, now=0.0) == 0  # closed for good
    assert budget.declined == 36


def test_probe_budget_that_plans_nothing_declines_everything():
    budget = ProbeBudget(blocks=5, saving_per_block_s=0.0)
    assert budget.grant(5, TransferEstimate(0.0, 1e12), BLOCK_BYTES, 32, now=0.0) == 0
    assert (budget.planned, budget.declined) == (0, 5)
    with pytest.raises(ValueError, match="saving_per_block_s"):
        ProbeBudget(blocks=1, saving_per_block_s=-1.0)


# -- HitPolicy ----------------------------------------------------------------------------------------------


def _metric(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _prefill(tokens: int, seconds: float) -> PrefillResult:
    return PrefillResult(
        cache=None,
        logits=None,
        prompt_tokens=tokens,
        prefix_tokens=0,
        computed_tokens=tokens,
        load_seconds=0.0,
        compute_seconds=seconds,
    )


def test_policy_learns_prefill_cost_and_exports_decisions():
    registry = CollectorRegistry()
    policy = HitPolicy(registry, clock=ManualClock())
    for tokens in (64, 512, 128, 1024):
        policy.observe(_prefill(tokens, 0.004 + tokens * 100e-6))
    assert policy.recompute_s_per_token() == pytest.approx(100e-6)
    assert _metric(registry, "prefixcache_worker_prefill_seconds_per_token") == pytest.approx(100e-6)

    taken = policy.decide(replace(hit(3, leased=4), remote_blocks_declined=5), LAYOUT)
    missed = policy.decide(hit(0), LAYOUT)
    assert (taken.verdict, taken.blocks, missed.verdict) == (Verdict.TAKEN, 3, Verdict.MISS)
    assert _metric(registry, "prefixcache_worker_hit_decisions_total", decision="taken") == 1
    assert _metric(registry, "prefixcache_worker_hit_decisions_total", decision="miss") == 1
    assert _metric(registry, "prefixcache_worker_hit_decisions_total", decision="recompute") == 0
    assert _metric(registry, "prefixcache_worker_hit_blocks_total", outcome="loaded") == 3
    assert _metric(registry, "prefixcache_worker_remote_blocks_declined_total") == 5
    assert _metric(registry, "prefixcache_worker_hit_estimated_seconds_total", estimate="recompute") == pytest.approx(
        3 * 16 * 100e-6
    )
    text = generate_latest(registry).decode()
    assert 'prefixcache_worker_transfer_bytes_per_second{path="shared_memory"}' in text
    assert 'prefixcache_worker_transfer_latency_seconds{path="stream"}' in text


def test_policy_recomputes_when_prefill_gets_cheap():
    registry = CollectorRegistry()
    policy = HitPolicy(registry, clock=ManualClock())
    for tokens in (64, 4096, 512):
        policy.observe(_prefill(tokens, 1e-9 * tokens + 1e-4))  # a billion tokens per second
    decision = policy.decide(hit(3, leased=4), LAYOUT)
    assert (decision.verdict, decision.blocks) == (Verdict.RECOMPUTE, 0)
    assert _metric(registry, "prefixcache_worker_hit_blocks_total", outcome="declined") == 3
    assert np.isclose(_metric(registry, "prefixcache_worker_hit_decisions_total", decision="recompute"), 1)


def test_replay_report_section_counts_decisions_during_the_run():
    from prefixcache_services.replay.worker_metrics import parse, section

    registry = CollectorRegistry()
    policy = HitPolicy(registry, clock=ManualClock())
    policy.decide(hit(1, leased=2), LAYOUT)  # before the run
    before = parse(generate_latest(registry).decode())
    policy.decide(replace(hit(3, leased=4), remote_blocks_declined=7), LAYOUT)
    policy.decide(hit(0), LAYOUT)
    got = section("http://127.0.0.1:8000/v1", before, parse(generate_latest(registry).decode()))
    assert got["url"] == "http://127.0.0.1:8000/metrics"
    assert got["decisions"] == {"miss": 1, "partial": 0, "recompute": 0, "taken": 1}
    assert got["hit_blocks"] == {"declined": 0, "loaded": 3} and got["remote_blocks_declined"] == 7
    assert got["estimates"]["prefill_seconds_per_token"] == pytest.approx(policy.recompute_s_per_token())
    assert set(got["estimates"]["bytes_per_s"]) == {"shared_memory", "stream", "install"}
    assert parse("# HELP other_metric x\n# TYPE other_metric counter\nother_metric_total 1.0\n") is None
    assert section("http://x", None, before) is None


def test_always_take_sends_no_budget_so_the_service_fetches_all_it_holds():
    assert HitPolicy(CollectorRegistry(), always_take=True).recompute_s_per_token() is None
    assert HitPolicy(CollectorRegistry()).recompute_s_per_token() > 0


def test_a_lookup_is_worth_a_wait_only_when_its_most_could_repay_it() -> None:
    """At 20k tokens/s, 200 tokens take 10 ms to prefill: worth a 9 ms wait, not an 11 ms one
    (a hit saves at most that; a miss nothing); nothing to gain is never worth waiting for."""
    assert worth_waiting(200, PREFILL, 9e-3)
    assert not worth_waiting(200, PREFILL, 11e-3)
    assert not worth_waiting(0, PREFILL, 0.0)
    assert worth_waiting(1, PREFILL, 0.0)


def test_the_odds_of_a_hit_discount_what_a_lookup_could_bring() -> None:
    """At even odds the same 200 tokens (10 ms) are worth a 4 ms wait, not a 6 ms one."""
    assert worth_waiting(200, PREFILL, 4e-3, odds=0.5)
    assert not worth_waiting(200, PREFILL, 6e-3, odds=0.5)
    assert not worth_waiting(200, PREFILL, 0.0, odds=0.0)


def test_hit_odds_fall_with_misses_and_rise_again_with_hits() -> None:
    """A mean with the prior as one answer until there are 16 answers, then each miss weighs 1/16
    and each hit 1/4: after a run of misses one hit lifts the odds to about a quarter."""
    odds = HitOdds()
    assert odds.value == 1.0  # wait for Lookups until their answers show otherwise
    odds.observe(False)
    assert odds.value == pytest.approx(1 / 2)
    for _ in range(2):
        odds.observe(False)
    assert odds.value == pytest.approx(1 / 4)  # a fresh engine learns within a few answers
    for _ in range(12):
        odds.observe(False)
    assert odds.value == pytest.approx(1 / 16)
    for _ in range(16):
        odds.observe(False)
    assert odds.value == pytest.approx((1 - HIT_ODDS_WEIGHT) ** 16 / 16)
    low = odds.value
    odds.observe(True)
    assert odds.value == pytest.approx(low + HIT_ODDS_HIT_WEIGHT * (1 - low))  # one hit: about 1/4
    assert odds.value > 0.25
    even = HitOdds(hit_weight=HIT_ODDS_WEIGHT)  # hits weighing as misses: one hit, about 1/16
    for _ in range(31):  # as many misses as above
        even.observe(False)
    even.observe(True)
    assert even.value == pytest.approx(low + HIT_ODDS_WEIGHT * (1 - low))
    for weight, prior, hit_weight in (
        (0.0, 1.0, None),
        (1.5, 1.0, None),
        (0.5, -0.1, None),
        (0.5, 1.1, None),
        (0.5, 1.0, 0.0),
    ):
        with pytest.raises(ValueError, match="hit odds"):
            HitOdds(weight, prior, hit_weight)


def test_hit_odds_lose_no_answer_to_threads_counting_at_once() -> None:
    """Answers arrive on Lookup threads and on the scheduler's: 8 threads x 4,000 misses, then as
    many hits, five times over, with the interpreter switching threads every microsecond, end
    where the same answers one after another do (a lost update moves the value by ~1e-4 of it)."""
    weight, n = 1e-4, 32_000
    odds, alone = HitOdds(weight, hit_weight=weight), HitOdds(weight, hit_weight=weight)

    def count(hit: bool, start: threading.Barrier) -> None:
        start.wait()
        for _ in range(n // 8):
            odds.observe(hit)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for hit in (False, True) * 5:
            start = threading.Barrier(8)
            threads = [threading.Thread(target=count, args=(hit, start)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for _ in range(n):
                alone.observe(hit)
            assert odds.value == pytest.approx(alone.value, rel=1e-9)
    finally:
        sys.setswitchinterval(interval)
