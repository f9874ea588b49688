"""Two vLLM engines of different models on one cache service (no Redis): both save, both hit.

Model M1 is the connector scenario's Llama (2 layers, 2 kv heads, head_dim 32: 16 KiB blocks of
32 tokens in bf16); M2 has 3 layers and 1 kv head (12 KiB blocks). Each engine (connector on,
vLLM prefix caching off) serves its prompts once (misses: nothing is cached yet, and no two
prompts share a block), waits until the service holds what it saved, then serves them again:
all but the last block of each prompt comes from the service, and the greedy outputs equal the
first run's, for both models. The service lists both models' namespaces.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.poll import poll
from tests.support.worker_procs import CacheService
from tests.vllm_e2e.test_vllm_connector import BS, VOCAB, _expected_external, _gen, _model, _start, _tokens

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]


def _other_model(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    torch.manual_seed(99)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def test_two_models_share_one_service_and_both_hit(tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = tmp_path_factory.mktemp("vllm-two-models")
    models = {"M1": _model(workdir / "m1"), "M2": _other_model(workdir / "m2")}
    rng = random.Random(11)
    prompts = {name: [_tokens(rng, rng.randrange(100, 200)) for _ in range(4)] for name in models}
    service = CacheService(workdir / "service", extra_args=["--block-size", str(BS)]).start()
    connector = {"hit_policy": "always", "timeout_s": 5.0, "lookup_timeout_s": 5.0}
    engines = {}
    try:
        for name, model in models.items():
            steps = [_gen("first", prompts[name]), {"barrier": "saved"}, _gen("again", prompts[name])]
            engines[name] = _start(workdir, name, model, steps, {"cache": service.address, **connector}, apc=False)
        for engine in engines.values():
            engine.wait_barrier("saved")
        want = {name: sum(len(p) // BS for p in prompts[name]) for name in models}
        saved = lambda: all(service.resident_blocks().get(models[n].name, 0) >= want[n] for n in models)  # noqa: E731
        assert poll(saved, 60, interval_s=0.5), service.resident_blocks()  # the connector attaches as the basename
        assert len(service.resident_blocks()) == 2  # one namespace per model, in one service
        for engine in engines.values():
            engine.go("saved")
        for name, engine in engines.items():
            steps = engine.result()["steps"]
            assert steps["first"]["cached"] == [0] * len(prompts[name])
            assert steps["again"]["cached"] == [_expected_external(p, [p]) for p in prompts[name]]
            assert steps["again"]["outputs"] == steps["first"]["outputs"], f"{name}: cached outputs differ"
    finally:
        for engine in engines.values():
            if engine.process.poll() is None:
                engine.process.kill()
                engine.process.wait(timeout=30)
        service.stop()
