"""Worker model/engine: tokenizers, chat template, model loading, and cached == recomputed.

Everything runs the real tiny Llama (cl100k vocabulary) on CPU, plus a small real checkpoint
written to a temporary directory with `save_pretrained` for the local-path loader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3NextConfig,
)

from prefixcache_services.worker.attention import prefix_exact_attention
from prefixcache_services.worker.chat import ChatMessage, ChatMLTemplate, Role, completion_prompt
from prefixcache_services.worker.compat import UnsupportedModelError, check_plain_kv
from prefixcache_services.worker.engine import Engine, FinishReason, bucket_length
from prefixcache_services.worker.hit_policy import HitPolicy
from prefixcache_services.worker.model import checkpoint_digest, configure_torch_threads, load_model
from prefixcache_services.worker.tokenizer import (
    CL100K_SHA256,
    TiktokenTokenizer,
    TokenizerIntegrityError,
    bundled_cl100k_path,
    verify_bpe_file,
)

pytestmark = pytest.mark.slow

BLOCK = 16
VOCAB_LIMIT = 100_000  # ordinary cl100k ids, below the control tokens


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer()


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {dtype: Engine(load_model("tiny", dtype)) for dtype in ("float32", "bfloat16")}


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_LIMIT, (n,), generator=g).tolist()


# --- tokenizer -------------------------------------------------------------------------


def test_bundled_bpe_file_matches_pinned_sha256():
    path = bundled_cl100k_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CL100K_SHA256
    verify_bpe_file(path)


def test_tampered_bpe_file_is_refused(tmp_path):
    tampered = tmp_path / "cl100k_base.tiktoken"
    shutil.copy(bundled_cl100k_path(), tampered)
    data = bytearray(tampered.read_bytes())
    data[100] ^= 1
    tampered.write_bytes(bytes(data))
    with pytest.raises(TokenizerIntegrityError, match="sha256"):
        TiktokenTokenizer(bpe_path=tampered)


def test_tiktoken_round_trip_and_special_tokens(tokenizer):
    text = "Prefix caching ♻️ reuses KV: naïve façade, 日本語, 12345\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("hello world") == [15339, 1917]  # cl100k ids
    assert (tokenizer.vocab_size, tokenizer.eos_token_id) == (100277, 100257)
    # Control-token text in input stays ordinary text.
    assert tokenizer.im_end_id not in tokenizer.encode("<|im_end|>")
    assert tokenizer.decode([tokenizer.im_start_id]) == "<|im_start|>"
    assert tokenizer.decode([100262]) == "\ufffd"  # unassigned cl100k id
    for bad in (-1, tokenizer.vocab_size):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tokenizer.decode([bad])


# --- chat template ---------------------------------------------------------------------


def test_chat_template_is_prefix_stable_over_three_turns(tokenizer):
    template = ChatMLTemplate(tokenizer)
    history = [ChatMessage(Role.SYSTEM, "You are terse.")]
    turns = [("Hello", "Hi!"), ("What is a KV cache?", "Keys and values,\nkept."), ("Thanks", "")]
    prompts = []
    for user, reply in turns:
        history.append(ChatMessage(Role.USER, user))
        prompts.append(template.render(history))
        history.append(ChatMessage(Role.ASSISTANT, reply))
    header = template.header(Role.ASSISTANT)
    assert header == [tokenizer.im_start_id, *tokenizer.encode("assistant\n")]
    for k in (1, 2):
        previous, current = prompts[k - 1], prompts[k]
        assert previous[-len(header) :] == header
        reply = ChatMessage(Role.ASSISTANT, turns[k - 1][1])
        assert template.message(reply)[: len(header)] == header
        assert (
            current
            == previous
            + template.message(reply)[len(header) :]
            + template.message(ChatMessage(Role.USER, turns[k][0]))
            + header
        )
    assert template.stop_token_ids == {tokenizer.im_end_id, tokenizer.eos_token_id}
    assert completion_prompt(tokenizer, "Hello") == tokenizer.encode("Hello")


def test_chat_message_validation():
    assert ChatMessage.from_mapping({"role": "user", "content": "x"}) == ChatMessage(Role.USER, "x")
    with pytest.raises(ValueError, match="'tool' is not one of"):
        ChatMessage.from_mapping({"role": "tool", "content": "x"})
    with pytest.raises(ValueError, match="content must be a string"):
        ChatMessage.from_mapping({"role": "user", "content": None})


# --- model loading ---------------------------------------------------------------------


def test_tiny_weights_and_digest_are_a_function_of_seed_and_dtype(engines):
    first = engines["float32"].loaded
    again = load_model("tiny", "float32", seed=0)
    other_seed = load_model("tiny", "float32", seed=1)
    state, state_again = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(state[name], state_again[name]) for name in state)
    assert first.weights_digest == again.weights_digest
    assert not torch.equal(
        state["model.embed_tokens.weight"], other_seed.model.state_dict()["model.embed_tokens.weight"]
    )
    digests = {first.weights_digest, other_seed.weights_digest, engines["bfloat16"].loaded.weights_digest}
    assert len(digests) == 3
    assert first.kv.layers == 4 and first.kv.kv_heads == 2 and first.kv.head_dim == 32
    assert (first.kv.dtype.value, engines["bfloat16"].loaded.kv.dtype.value) == ("float32", "bfloat16")
    assert engines["bfloat16"].loaded.kv.bytes_per_token == 2 * 4 * 2 * 32 * 2


def test_load_model_rejects_bad_specs():
    with pytest.raises(ValueError, match="neither 'tiny' nor a local checkpoint"):
        load_model("/nonexistent/model")
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model("tiny", "float8")


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (MistralConfig(sliding_window=4096), "sliding_window=4096"),
        (Qwen2Config(use_sliding_window=True, max_window_layers=0), "sliding_attention"),
        (Gemma3TextConfig(), "sliding_attention"),
        (Qwen3NextConfig(), "linear_attention"),
        (LlamaConfig(attention_chunk_size=8192), "chunked attention"),
    ],
)
def test_non_plain_kv_models_are_refused(config, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        check_plain_kv(config)


def test_plain_kv_models_are_accepted():
    check_plain_kv(LlamaConfig())
    check_plain_kv(Qwen2Config())  # sliding window present in the family but switched off
    check_plain_kv(MistralConfig(sliding_window=None))


def test_configure_torch_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert configure_torch_threads(1) == 1 and torch.get_num_threads() == 1
        n = configure_torch_threads()
        assert n >= 1 and torch.get_num_threads() == n
        with pytest.raises(ValueError, match="thread count"):
            configure_torch_threads(0)
    finally:
        torch.set_num_threads(before)


# --- exactness: cached prefix == recomputation -------------------------------------------


@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 1), (1, 700), (5, 29), (40, 40), (600, 600), (300, 1100), (9, 530)])
def test_prefix_exact_attention_is_causal_attention(q_len, kv_len):
    g = torch.Generator().manual_seed(q_len * 10_000 + kv_len)
    query = torch.randn(1, 8, q_len, 32, generator=g)
    key, value = torch.randn(2, 1, 2, kv_len, 32, generator=g)
    out, _ = prefix_exact_attention(torch.nn.Module(), query, key, value, None, scaling=32**-0.5)

    q, k, v = query.double(), key.double().repeat_interleave(4, 1), value.double().repeat_interleave(4, 1)
    scores = q @ k.transpose(-1, -2) * 32**-0.5
    future = torch.arange(kv_len)[None, :] > torch.arange(kv_len - q_len, kv_len)[:, None]
    expected = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
    assert out.shape == (1, q_len, 8, 32)
    torch.testing.assert_close(out.double(), expected.transpose(1, 2), atol=1e-5, rtol=0)


def _greedy(engine: Engine, prompt: list[int], blocks: torch.Tensor | None = None):
    generation = engine.generate(prompt, blocks, max_tokens=16, stop_token_ids=())
    return list(generation), generation


@pytest.mark.parametrize(
    ("dtype", "prompt_len", "shared_blocks", "other_len"),
    [("float32", 200, 5, 150), ("bfloat16", 200, 5, 150), ("bfloat16", 700, 40, 1100)],
)
def test_partial_hit_matches_full_prefill(engines, dtype, prompt_len, shared_blocks, other_len):
    engine = engines[dtype]
    prompt = _ids(1, prompt_len)
    other = prompt[: shared_blocks * BLOCK] + _ids(2, other_len - shared_blocks * BLOCK)
    earlier = engine.prefill(other)
    blocks = engine.extract_blocks(earlier.cache, 0, shared_blocks, BLOCK)

    reference, full = _greedy(engine, prompt)
    cached, hit = _greedy(engine, prompt, blocks)

    assert hit.prefill.prefix_tokens == shared_blocks * BLOCK
    assert hit.prefill.computed_tokens == prompt_len - shared_blocks * BLOCK
    assert len(set(reference)) > 4  # a varied continuation, so equality means something
    assert cached == reference
    n_full = prompt_len // BLOCK
    kv_full = engine.extract_blocks(full.cache, 0, n_full, BLOCK)
    kv_hit = engine.extract_blocks(hit.cache, 0, n_full, BLOCK)
    if dtype == "bfloat16":  # bit for bit (see services/worker/attention.py)
        assert torch.equal(hit.prefill.logits, full.prefill.logits)
        assert torch.equal(kv_hit, kv_full)
    else:  # float32 CPU kernels round differently with the row count: ~1e-6
        torch.testing.assert_close(hit.prefill.logits, full.prefill.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(kv_hit, kv_full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_hit_on_block_multiple_keeps_last_block(engines, dtype):
    engine = engines[dtype]
    prompt = _ids(3, 13 * BLOCK)
    reference, full = _greedy(engine, prompt)
    blocks = engine.extract_blocks(full.cache, 0, 13, BLOCK)

    cached, hit = _greedy(engine, prompt, blocks[:12])
    assert hit.prefill.computed_tokens == BLOCK
    assert cached == reference
    if dtype == "bfloat16":
        assert torch.equal(hit.prefill.logits, full.prefill.logits)
    with pytest.raises(ValueError, match="at least one prompt token must be computed"):
        engine.prefill(prompt, blocks)


def test_extract_blocks_from_an_unfilled_cache_is_a_clear_error(engines):
    """A cache no prefill has filled has layers without KV tensors: a ValueError naming the
    layer, not an AttributeError on None."""
    engine = engines["float32"]
    empty = DynamicCache(config=engine.loaded.model.config)
    with pytest.raises(ValueError, match=r"cache layer 0 \(DynamicLayer\) holds no KV tensors"):
        engine.extract_blocks(empty, 0, 0, BLOCK)


# --- prefill buckets: padded prefill == unpadded, bit for bit ------------------------------


def _real_kv(cache, n: int) -> torch.Tensor:
    return torch.stack([torch.stack([layer.keys[0, :, :n], layer.values[0, :, :n]]) for layer in cache.layers])


@pytest.fixture(scope="module")
def plain_bf16(engines) -> Engine:
    return Engine(engines["bfloat16"].loaded, prefill_buckets=False)


def test_bucket_lengths_are_few_aligned_and_tight():
    buckets = sorted({bucket_length(n) for n in range(1, 16_385)})
    assert buckets[:16] == list(range(16, 257, 16)) and len(buckets) == 52
    assert sum(b <= 2048 for b in buckets) == 33
    for n in range(1, 20_000):
        b = bucket_length(n)
        assert b >= n and b % 16 == 0  # whole attention q chunks (attention.Q_CHUNK)
        assert b - n < 16 or b - n <= 0.125 * n + 16
        assert bucket_length(b) == b
    with pytest.raises(ValueError):
        bucket_length(0)


def test_buckets_default_on_only_for_onednn_bfloat16(engines):
    assert engines["bfloat16"].prefill_buckets and not engines["float32"].prefill_buckets
    enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = False  # --no-onednn: memory is flat without padding
        assert not Engine(engines["bfloat16"].loaded).prefill_buckets
    finally:
        torch.backends.mkldnn.enabled = enabled


@pytest.mark.parametrize("n", [1, 15, 17, 100, 257, 300, 513, 833, 1500])
def test_bucketed_prefill_is_bitwise_the_unpadded_one(engines, plain_bf16, n):
    bucketed = engines["bfloat16"]
    prompt = _ids(100 + n, n)
    padded, plain = bucketed.prefill(prompt), plain_bf16.prefill(prompt)

    assert padded.padding_tokens == bucket_length(n) - n and plain.padding_tokens == 0
    assert padded.computed_tokens == n and padded.cache.get_seq_length() == n  # pads cropped
    assert torch.equal(padded.logits, plain.logits)  # the last real token's, not a pad's
    assert torch.equal(_real_kv(padded.cache, n), _real_kv(plain.cache, n))

    if n > 2 * BLOCK:  # a prefix hit: only the suffix is padded
        shared = (n - 1) // BLOCK // 2
        blocks = plain_bf16.extract_blocks(plain.cache, 0, shared, BLOCK)
        hit = bucketed.prefill(prompt, blocks)
        suffix = n - shared * BLOCK
        assert hit.padding_tokens == bucket_length(suffix) - suffix and hit.cache.get_seq_length() == n
        assert torch.equal(hit.logits, plain.logits)
        assert torch.equal(_real_kv(hit.cache, n), _real_kv(plain.cache, n))


def test_decode_after_a_bucketed_prefill_is_unchanged(engines, plain_bf16):
    prompt = _ids(8, 300)  # bucket 336: 36 pads cropped before decoding at position 300
    blocks = plain_bf16.extract_blocks(plain_bf16.prefill(prompt).cache, 0, 10, BLOCK)
    reference, plain = _greedy(plain_bf16, prompt)
    for prefix in (None, blocks):
        tokens, generation = _greedy(engines["bfloat16"], prompt, prefix)
        assert generation.prefill.padding_tokens > 0
        assert tokens == reference and len(set(reference)) > 4
        assert generation.cache.get_seq_length() == 300 + 15  # 16 tokens, the last not yet fed back
        assert torch.equal(_real_kv(generation.cache, 315), _real_kv(plain.cache, 315))


def test_buckets_bound_the_lengths_the_model_sees(engines):
    engine = engines["bfloat16"]
    seen = []
    hook = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1])
    )
    try:
        lengths = range(40, 440, 10)
        for n in lengths:
            engine.prefill(_ids(n, n))
    finally:
        hook.remove()
    assert sorted(set(seen)) == sorted({bucket_length(n) for n in lengths})
    assert len(set(seen)) == 19 < len(lengths)  # 40 distinct prompt lengths, 19 matmul shapes


def test_buckets_stop_at_the_position_limit(engines, plain_bf16):
    # The same real model declaring 1000 positions: bucket(990) = 1056 is cut to 1000, as a
    # learned position table could not index past its end.
    limited = Engine(dataclasses.replace(engines["bfloat16"].loaded, max_positions=1000))
    prompt = _ids(9, 990)
    padded, plain = limited.prefill(prompt), plain_bf16.prefill(prompt)
    assert padded.padding_tokens == 10 and padded.cache.get_seq_length() == 990
    assert torch.equal(padded.logits, plain.logits)
    assert torch.equal(_real_kv(padded.cache, 990), _real_kv(plain.cache, 990))


def test_prefix_blocks_must_match_the_layout(engines):
    engine = engines["bfloat16"]
    prompt = _ids(4, 100)
    blocks = engine.extract_blocks(engine.prefill(prompt).cache, 0, 2, BLOCK)
    with pytest.raises(ValueError, match="dtype"):
        engine.prefill(prompt, blocks.float())
    with pytest.raises(ValueError, match="does not match"):
        engine.prefill(prompt, blocks[:, :, :, :1])
    with pytest.raises(ValueError, match="6-D"):
        engine.prefill(prompt, blocks[0])
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        engine.prefill([0, 200_000])


def test_extract_blocks_layout(engines):
    engine = engines["float32"]
    cache = engine.prefill(_ids(5, 70)).cache
    blocks = engine.extract_blocks(cache, 1, 3, BLOCK)
    assert blocks.shape == (3, 4, 2, 2, BLOCK, 32) and blocks.is_contiguous()
    layer = cache.layers[2]
    assert torch.equal(blocks[1, 2, 0, 1, 5], layer.keys[0, 1, (1 + 1) * BLOCK + 5])
    assert torch.equal(blocks[2, 2, 1, 0, 15], layer.values[0, 0, (1 + 2) * BLOCK + 15])
    blocks.add_(1.0)  # an ordinary tensor the caller may write into
    with pytest.raises(ValueError, match="cache holds 70"):
        engine.extract_blocks(cache, 2, 3, BLOCK)


# --- generation control ---------------------------------------------------------------------


def test_generation_stops_on_stop_token_length_and_cancel(engines):
    engine = engines["float32"]
    prompt = _ids(6, 40)
    reference = list(engine.generate(prompt, max_tokens=6, stop_token_ids=()))

    stopped = engine.generate(prompt, max_tokens=6, stop_token_ids=[reference[2]])
    assert list(stopped) == reference[: reference.index(reference[2])]
    assert stopped.finish_reason is FinishReason.STOP

    limited = engine.generate(prompt, max_tokens=3, stop_token_ids=())
    assert list(limited) == reference[:3] and limited.finish_reason is FinishReason.LENGTH

    calls = []
    cancelled = engine.generate(prompt, max_tokens=6, stop_token_ids=(), should_stop=lambda: len(calls) >= 2)
    for token in cancelled:
        calls.append(token)
    assert calls == reference[:2] and cancelled.finish_reason is FinishReason.CANCELLED

    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompt, temperature=-1.0)


def test_sampling_is_reproducible_per_seed(engines):
    engine = engines["bfloat16"]
    prompt = _ids(7, 50)

    def sample(seed):
        return list(engine.generate(prompt, max_tokens=12, stop_token_ids=(), temperature=1.0, seed=seed))

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    assert engine.generate(prompt, max_tokens=1, temperature=0.7).seed is not None


# --- prefill rate --------------------------------------------------------------------------


def test_the_hit_policy_calibrates_its_prefill_cost_on_real_prefills(engines):
    """The worker's one prefill estimator (the library's PrefillMeter, in its hit policy) learns
    from the engine's own timed prefills: the start-up calibration runs two real ones."""
    policy = HitPolicy(CollectorRegistry())
    prior = policy.estimates().prefill
    assert prior.samples == 0
    measured = policy.calibrate(engines["float32"], sizes=(64, 256))
    assert measured.samples == 2 and measured is not prior
    assert policy.recompute_s_per_token() == pytest.approx(1.0 / measured.bytes_per_s)


# --- local checkpoint directories -----------------------------------------------------------


def _save_tokenizer(path) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(path)
    return tok


def _small_config(cls, vocab_size: int, **extra):
    return cls(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=1,
        **extra,
    )


def test_checkpoint_directory_loads_and_serves_exactly(tmp_path):
    tok = _save_tokenizer(tmp_path)
    torch.manual_seed(0)
    LlamaForCausalLM(_small_config(LlamaConfig, len(tok))).save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path), "bfloat16")
    assert loaded.kv.layers == 2 and loaded.kv.kv_heads == 2 and loaded.kv.head_dim == 16
    assert loaded.stop_token_ids == {1} and loaded.model_id == tmp_path.name
    assert loaded.weights_digest == checkpoint_digest(tmp_path)
    text = "the lazy dog jumps"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
    ids = loaded.render_chat([ChatMessage(Role.USER, text)])
    assert loaded.tokenizer.decode(ids) == f"<|user|>{text}</s><|assistant|>"

    engine = Engine(loaded)
    prompt = ids * 8
    reference, full = _greedy(engine, prompt)
    cached, hit = _greedy(engine, prompt, engine.extract_blocks(full.cache, 0, 3, BLOCK))
    assert cached == reference and torch.equal(hit.prefill.logits, full.prefill.logits)

    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert checkpoint_digest(tmp_path) != loaded.weights_digest


def test_checkpoint_with_sliding_window_is_refused(tmp_path):
    tok = _save_tokenizer(tmp_path)
    MistralForCausalLM(_small_config(MistralConfig, len(tok), sliding_window=64)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        load_model(str(tmp_path))


@pytest.mark.skipif("amx_bf16" not in open("/proc/cpuinfo").read(), reason="needs a CPU with AMX bf16")
def test_amx_bf16_matmuls_break_row_invariance_and_the_isa_cap_restores_it(engines):
    """On AMX hardware oneDNN's bf16 kernels give a row other bits in a 144-row call than in a
    640-row one, which would make cached prefills differ from full ones; the engine's probe sees
    it, and the cap that importing the worker's model module sets (worker/model.py) removes it."""
    probe = (
        "import torch; from prefixcache_services.worker.model import load_model; "
        "from prefixcache_services.worker.engine import rows_invariant; "
        "print(rows_invariant(load_model('tiny', 'bfloat16')))"
    )
    results = {}
    for cap in (None, "DEFAULT"):  # unset: the module's own cap; DEFAULT: oneDNN's every ISA, AMX included
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if cap is not None:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        results[cap] = out.stdout.strip().splitlines()[-1]
    assert results == {None: "True", "DEFAULT": "False"}
    assert engines["bfloat16"].rows_invariant  # this process imported worker/model.py before any matmul
