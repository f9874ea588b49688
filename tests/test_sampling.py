"""The sampler's arithmetic on small, known logits (services/worker/sampling.py, vLLM's semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache_services.worker.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.unit


def _sampler(seed: int = 0, prompt=(), **params) -> Sampler:
    return Sampler(SamplingParams(**params), prompt, 8, torch.Generator().manual_seed(seed))


LOGITS = torch.tensor([2.0, 1.9, 0.5, -1.0, -3.0, 0.0, 0.1, -0.2])


def test_greedy_without_processing_is_the_raw_argmax_and_leaves_logits_untouched():
    logits = LOGITS.clone()
    assert _sampler().choose(logits) == 0 and torch.equal(logits, LOGITS)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    sampler = _sampler(prompt=[1], frequency_penalty=0.06, presence_penalty=0.0)
    assert [sampler.choose(LOGITS) for _ in range(3)] == [0, 0, 1]  # 1.94 > 1.9, then 1.88 < 1.9
    presence = _sampler(presence_penalty=0.2)
    assert [presence.choose(LOGITS) for _ in range(3)] == [0, 1, 0]  # 1.8 < 1.9, then both penalised once
    assert [_sampler(frequency_penalty=-2.0).choose(LOGITS) for _ in range(1)] == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    sampler = _sampler(prompt=[0], repetition_penalty=2.0)
    assert sampler.choose(LOGITS) == 1  # 2.0 / 2 = 1.0 < 1.9
    assert sampler.choose(LOGITS) == 0  # 1 is seen now too: 1.9 / 2 = 0.95 < 1.0
    processed = _sampler(prompt=[3], repetition_penalty=2.0)._processed(LOGITS)
    assert processed[3] == -2.0 and torch.equal(processed[:3], LOGITS[:3])


def test_logit_bias_adds_to_the_logits():
    assert _sampler(logit_bias={4: 6.0}).choose(LOGITS) == 4
    with pytest.raises(ValueError, match="logit_bias names token 9"):
        _sampler(logit_bias={9: 1.0})


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 0.3}, {"min_p": 0.95}])
def test_truncation_to_one_token_is_greedy(params):
    sampler = _sampler(seed=1, temperature=1.0, **params)
    assert {sampler.choose(LOGITS) for _ in range(50)} == {0}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # 0 alone holds ~0.39, with 1 ~0.74
    sampler = _sampler(temperature=1.0, top_p=0.6)
    kept = torch.isfinite(sampler._truncated(LOGITS))
    assert kept.tolist() == [True, True] + [False] * 6 and probs[0] < 0.6 < probs[0] + probs[1]
    seen = {_sampler(seed=s, temperature=1.0, top_p=0.6).choose(LOGITS) for s in range(40)}
    assert seen == {0, 1}


def test_top_k_and_min_p_keep_what_they_say():
    assert torch.isfinite(_sampler(temperature=1.0, top_k=3)._truncated(LOGITS)).sum() == 3
    kept = torch.isfinite(_sampler(temperature=1.0, min_p=0.2)._truncated(LOGITS))
    probs = torch.softmax(LOGITS, -1)
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist()


def test_logprobs_are_the_raw_distributions():
    entry = _sampler(logprobs=2, logit_bias={4: 9.0}).logprob(LOGITS, 4)
    raw = torch.log_softmax(LOGITS, -1)
    assert math.isclose(entry.logprob, float(raw[4]), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == [0, 1]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("top_p", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("temperature", -1.0),
        ("top_k", -2),
    ],
)
def test_out_of_range_parameters_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
