"""Two real workers of different models on one cache service: both hit, both exact, one budget.

Real processes (tests/worker_procs.py): one `prefixcache serve` (host tier in shared memory,
2 MiB in chunks of 128 KiB), a worker with the built-in tiny Llama (4 layers, 2 kv heads,
head_dim 32: 16 KiB blocks in bfloat16) and a worker with a random-weight Llama checkpoint
written here (3 layers, 3 kv heads, head_dim 16: 9 KiB blocks, 14 a chunk, not tiling it), each
with a `--no-cache` twin. Greedy output with the cache equals the twin's for both models; both
get hits on repeated prefixes through the mapped segment; the service lists both namespaces;
and once model A has filled the budget, model B's traffic takes its room (A's least recently
used blocks are evicted, B's stay resident).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from prefixcache.kinds import TierKind
from prefixcache_services.worker.model import TINY_MODEL_ID
from tests.support.poll import poll
from tests.support.worker_procs import CacheService, Reply, WorkerProcess, start_all, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.process]

BLOCK = 16
PROMPT_BLOCKS = 12  # 192 tokens of each prompt are cached
MAX_TOKENS = 6
WORKER_ARGS = ("--cache-deadline-ms", "5000", "--hit-policy", "always")
TINY_BLOCK_BYTES = 4 * 2 * 2 * BLOCK * 32 * 2
OTHER_BLOCK_BYTES = 3 * 2 * 3 * BLOCK * 16 * 2


def _save_checkpoint(path: Path) -> None:
    """A Llama of another geometry than the tiny one, random weights, with a small BPE tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def _prompt(n: int) -> list[int]:
    """Token ids both vocabularies hold, distinct per `n` from the first block on."""
    return [5 + (n * 37 + i * 11) % 280 for i in range(PROMPT_BLOCKS * BLOCK + 5)]  # the BPE has 290


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict[str, WorkerProcess]]:
    root = tmp_path_factory.mktemp("two-models")
    checkpoint = root / "other-model"
    _save_checkpoint(checkpoint)
    service = CacheService(
        root / "service", host_capacity="2MiB", extra_args=("--chunk-bytes", "128KiB", "--min-block-bytes", "8KiB")
    ).start()
    first = WorkerProcess(root / "tiny", service, WORKER_ARGS)
    others = {
        "tiny-ref": WorkerProcess(root / "tiny-ref", None),
        "other": WorkerProcess(root / "other", service, (*WORKER_ARGS, "--model", str(checkpoint))),
        "other-ref": WorkerProcess(root / "other-ref", None, ("--model", str(checkpoint))),
    }
    try:
        start_all([first])  # the tiny model attaches first: its layout is the arena's first
        start_all(list(others.values()))
        yield {"tiny": first, **others, "service": service}  # type: ignore[dict-item]
    finally:
        service.process.terminate()
        stop_all([first, *others.values()])
        service.stop()


def _complete(worker: WorkerProcess, tokens: list[int]) -> Reply:
    return worker.client.complete(tokens, max_tokens=MAX_TOKENS)


def _hit(worker: WorkerProcess, tokens: list[int]) -> Reply:
    """The reply once the prompt's blocks are committed (a commit lands after the response)."""
    return poll(lambda: (r := _complete(worker, tokens)).cached_tokens > 0 and r, 30, "a hit on a repeated prompt")


def test_both_models_hit_and_equal_their_no_cache_twins(workers) -> None:
    for name in ("tiny", "other"):
        cached, reference = workers[name], workers[f"{name}-ref"]
        for n in (1, 2):
            tokens = _prompt(n)
            miss = _complete(cached, tokens)
            hit = _hit(cached, tokens)
            want = _complete(reference, tokens)
            assert miss.text == hit.text == want.text, f"{name}: cached output diverged"
            assert hit.cached_tokens == PROMPT_BLOCKS * BLOCK and want.cached_tokens == 0
        assert "(shared memory)" in cached.log(), f"{name} did not map the host tier"
    resident = workers["service"].resident_blocks()
    assert set(resident) == {TINY_MODEL_ID, "other-model"}
    assert all(blocks >= 2 * PROMPT_BLOCKS for blocks in resident.values())


def test_one_budget_model_b_takes_room_from_model_a(workers) -> None:
    service, tiny, other = workers["service"], workers["tiny"], workers["other"]
    client = service.client()
    try:
        for n in range(100, 112):  # 12 prompts x 192 KiB of the tiny model: past the 2 MiB budget
            _hit(tiny, _prompt(n))
        host = next(t for t in client.stats().snapshot.tiers if t.kind is TierKind.HOST)
        assert host.bytes_used > host.capacity_bytes - 2 * (128 << 10)  # full, short of a chunk or so
        before = service.resident_blocks()
        for n in range(200, 206):  # the other model's traffic: 6 prompts x 108 KiB
            assert _hit(other, _prompt(n)).text == _complete(workers["other-ref"], _prompt(n)).text
        after = service.resident_blocks()
        stats = client.stats().snapshot
    finally:
        client.close()
    tiny_model, other_model = TINY_MODEL_ID, "other-model"
    assert after[tiny_model] < before[tiny_model]  # A lost room...
    assert after[other_model] >= before[other_model] + 6 * PROMPT_BLOCKS  # ...to B's new prompts
    host = next(t for t in stats.tiers if t.kind is TierKind.HOST)
    assert host.bytes_used <= host.capacity_bytes
    assert host.bytes_used == after[tiny_model] * TINY_BLOCK_BYTES + after[other_model] * OTHER_BLOCK_BYTES
    assert stats.evictions["host"]["lru"] > 0
    assert _hit(other, _prompt(200)).cached_tokens == PROMPT_BLOCKS * BLOCK  # B's early prompts stayed
