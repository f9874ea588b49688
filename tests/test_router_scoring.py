"""The router's model (services/router/scoring.py): pure arithmetic, no processes."""

from __future__ import annotations

import pytest

from prefixcache_services.router.scoring import EngineLoad, Estimate, Hit, PrefillModel, TierRates, rank

pytestmark = pytest.mark.unit


def test_the_prefill_model_recovers_overhead_and_rate_from_observed_ttfts():
    model = PrefillModel(initial_rate=100.0, initial_overhead_s=0.5)
    assert model.seconds_for(1000) == pytest.approx(0.5 + 10.0)  # nothing measured: the initial values
    for tokens in (40, 400, 1200, 80, 900, 2000, 300):
        model.observe(tokens, 0.02 + tokens / 8000.0)
    assert model.rate == pytest.approx(8000.0, rel=1e-6)
    assert model.overhead_s == pytest.approx(0.02, abs=1e-9)
    assert model.seconds_for(4000) == pytest.approx(0.52, rel=1e-6)


def test_the_prefill_model_forgets_an_old_rate():
    model = PrefillModel(alpha=0.3)
    for tokens in (100, 500, 900) * 3:
        model.observe(tokens, tokens / 1000.0)
    for tokens in (100, 500, 900) * 12:
        model.observe(tokens, tokens / 4000.0)  # the engine got faster (or less loaded)
    assert model.rate == pytest.approx(4000.0, rel=0.05)


def test_same_sized_samples_give_an_ewma_rate_under_the_initial_overhead():
    model = PrefillModel(initial_overhead_s=0.01)
    for _ in range(5):
        model.observe(500, 0.01 + 500 / 2000.0)
    assert model.rate == pytest.approx(2000.0)
    assert model.seconds_for(500) == pytest.approx(0.26)


def test_a_hit_is_the_longer_of_local_and_redis_and_costs_its_tiers_transfer():
    rates = TierRates(device=1e6, host=1e5, redis=1e4)
    hit = Hit(prompt_tokens=200, block_size=16, device_blocks=2, host_blocks=3, remote_blocks=8)
    assert hit.hit_tokens == 128 and hit.prefill_tokens == 72
    assert hit.transfer_s(rates) == pytest.approx(32 / 1e6 + 48 / 1e5 + 48 / 1e4)
    assert Hit(prompt_tokens=20, block_size=16, host_blocks=4).hit_tokens == 20  # never past the prompt
    # What the disk holds past the local hit adds to it, at the disk's rate (a warm restarted service).
    warm = Hit(prompt_tokens=200, block_size=16, host_blocks=3, disk_blocks=6, remote_blocks=2)
    assert warm.hit_tokens == 144 and warm.transfer_s(rates) == pytest.approx(48 / 1e5 + 96 / rates.disk)
    assert Hit(prompt_tokens=300).hit_tokens == 0 and Hit(prompt_tokens=300).transfer_s(rates) == 0.0


def test_queueing_is_the_remaining_work_in_flight():
    load = EngineLoad(PrefillModel(initial_rate=1000.0, initial_overhead_s=0.0))
    rates = TierRates()
    assert load.queue_s(now=0.0) == 0.0
    first = load.estimate("a", Hit(prompt_tokens=500), rates, now=0.0)
    load.start(1, first, now=0.0)
    second = load.estimate("a", Hit(prompt_tokens=300), rates, now=0.1)
    assert second.queue_s == pytest.approx(0.4)  # 0.5 s of prefill, 0.1 s of it done
    load.start(2, second, now=0.1)
    assert load.queue_s(now=0.2) == pytest.approx(0.6)
    assert load.first_token(1, now=0.5) == pytest.approx(0.5)
    load.finish(1, now=0.6, streamed=True)
    assert load.decode_s == pytest.approx(0.1)
    # The second was served from the first's completion: its observed prefill is 0.9 - 0.6.
    assert load.first_token(2, now=0.9) == pytest.approx(0.8)
    load.finish(2, now=1.0, streamed=True)
    assert load.queue_s(now=1.0) == 0.0
    assert load.prefill.samples == 2 and load.prefill.seconds_for(300) < 0.35


def _estimate(engine: str, ttft_s: float) -> Estimate:
    return Estimate(engine, 0.0, ttft_s, 0.0, Hit(0))


def test_the_conversations_engine_wins_only_a_tie():
    close = [_estimate("a", 0.100), _estimate("b", 0.103)]
    ordered, reason = rank(close, sticky="b")
    assert [e.engine for e in ordered] == ["b", "a"] and reason == "sticky"
    far = [_estimate("a", 0.100), _estimate("b", 0.200)]
    ordered, reason = rank(far, sticky="b")
    assert [e.engine for e in ordered] == ["a", "b"] and reason == "score"
    assert rank(far, sticky=None)[1] == "score"


@pytest.mark.parametrize(
    ("text", "named"),
    [("host=fast", "host"), ("nvme=1e6", "nvme"), ("redis=0", "redis"), ("device", "device"), ("host=inf", "host")],
)
def test_bad_tier_rates_name_the_tier(text, named):
    with pytest.raises(ValueError, match="--tier-rates") as error:
        TierRates.parse(text)
    assert named in str(error.value)


def test_tier_rates_parse_overrides_only_the_named_tiers():
    assert TierRates.parse("host=3e6, redis=4e5") == TierRates(host=3e6, redis=4e5)
    assert TierRates.parse("disk=5e5") == TierRates(disk=5e5)
