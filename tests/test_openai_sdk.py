"""The worker's HTTP API driven by the official `openai` SDK (sync, async, streaming, errors).

Against the session's real stack (service, cached worker, --no-cache reference worker):
greedy replies through the SDK equal the reference worker's and reuse the cache; streaming
with `stream_options.include_usage` ends with the usage chunk; logprobs have OpenAI's shape;
the sampling fields act on the logits; and every unsupported or out-of-range field is an
`openai.BadRequestError` whose `param` names it, an unknown model an `openai.NotFoundError`.
"""

from __future__ import annotations

import asyncio
import math
import time

import openai
import pytest

from tests.support.worker_procs import Stack

pytestmark = pytest.mark.process

MODEL = "prefixcache-tiny-llama"


def _client(worker, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{worker.port}/v1", api_key="unused", max_retries=0, timeout=120, **options
    )


@pytest.fixture(scope="module")
def stack(worker_stack) -> Stack:
    return worker_stack


@pytest.fixture(scope="module")
def cached(stack) -> openai.OpenAI:
    return _client(stack.cached)


@pytest.fixture(scope="module")
def reference(stack) -> openai.OpenAI:
    return _client(stack.reference)


def _messages(topic: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse. " * 6},
        {"role": "user", "content": f"Tell me about {topic}, in as much detail as you can muster today."},
    ]


def test_models_list_names_the_served_model(cached):
    assert [m.id for m in cached.models.list().data] == [MODEL]


def test_sync_chat_equals_the_uncached_reference_and_reuses_the_cache(cached, reference):
    salt = {"cache_salt": "sdk-sync"}
    args = {"model": MODEL, "messages": _messages("rivers"), "max_tokens": 12, "temperature": 0}
    first = cached.chat.completions.create(**args, extra_body=salt)
    second = cached.chat.completions.create(**args, extra_body=salt)
    expected = reference.chat.completions.create(**args)
    assert first.choices[0].message.content == second.choices[0].message.content == expected.choices[0].message.content
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_async_chat_runs_concurrent_requests(stack, reference):
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{stack.cached.port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        try:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=_messages(topic),
                        max_tokens=6,
                        temperature=0,
                        extra_body={"cache_salt": "sdk-async"},
                    )
                    for topic in ("owls", "tides", "owls")
                )
            )
        finally:
            await client.close()
        return [r.choices[0].message.content for r in replies]

    texts = asyncio.run(main())
    expected = [
        reference.chat.completions.create(model=MODEL, messages=_messages(t), max_tokens=6, temperature=0)
        .choices[0]
        .message.content
        for t in ("owls", "tides")
    ]
    assert texts == [expected[0], expected[1], expected[0]]


def test_streaming_with_include_usage_ends_with_the_usage_chunk(cached):
    args = {
        "model": MODEL,
        "messages": _messages("glaciers"),
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"cache_salt": "sdk-stream"},
    }
    whole = cached.chat.completions.create(**args)
    # The worker stores the prompt after the response, off its inference thread: wait until a
    # request sees it (each try stores nothing new), then stream.
    for _ in range(100):
        if cached.chat.completions.create(**{**args, "max_tokens": 1}).usage.prompt_tokens_details.cached_tokens:
            break
        time.sleep(0.1)
    chunks = list(cached.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the non-streamed request stored the prompt
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_and_echo(cached, reference):
    prompt = "The quick brown fox jumps over the lazy dog, and then"
    got = cached.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    expected = reference.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == expected.choices[0].text
    assert got.usage.completion_tokens == 7
    echoed = cached.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + got.choices[0].text
    default = cached.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert default.usage.completion_tokens == 16  # OpenAI's completions default


def test_chat_logprobs_have_openais_shape_and_match_greedy(cached):
    reply = cached.chat.completions.create(
        model=MODEL, messages=_messages("bees"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = cached.chat.completions.create(
        model=MODEL, messages=_messages("bees"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]
    plain = cached.chat.completions.create(model=MODEL, messages=_messages("bees"), max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(cached):
    reply = cached.completions.create(
        model=MODEL, prompt="Counting: one, two, three,", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and math.isclose(top[token], logprob) and logprob == max(top.values())


def test_sampling_fields_act_on_the_logits(cached):
    base = {"model": MODEL, "messages": _messages("maps"), "max_tokens": 8}
    greedy = cached.chat.completions.create(**base, temperature=0).choices[0].message.content
    # top_k 1 (and a tiny top_p) leave only the best token: sampling at temperature 1 is greedy.
    for extra in ({"top_k": 1}, {"top_p": 1e-9, "seed": 3}, {"min_p": 1.0, "seed": 4}):
        kwargs = {k: v for k, v in extra.items() if k in ("top_p", "seed")}
        body = {k: v for k, v in extra.items() if k not in kwargs}
        text = cached.chat.completions.create(**base, temperature=1.0, **kwargs, extra_body=body)
        assert text.choices[0].message.content == greedy, extra
    # logit_bias +100 on one token makes greedy emit only it.
    forced = cached.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logit_bias={"15339": 100}, logprobs=0
    )
    assert forced.choices[0].logprobs.tokens == ["hello"] * 4
    # The penalties' arithmetic is tested exactly in tests/test_sampling.py; here they reach it.
    penalised = [
        cached.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=6,
            temperature=0,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            extra_body={"repetition_penalty": 1.3},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert penalised[0] == penalised[1]
    # seeded sampling repeats; stop_token_ids end the reply with finish_reason "stop".
    seeded = [
        cached.chat.completions.create(**base, temperature=1.0, seed=11).choices[0].message.content for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    stopped = cached.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        logit_bias={"15339": 100},
        extra_body={"stop_token_ids": [15339]},
    )
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"


IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        ],
    }
]
USER = [{"role": "user", "content": "hi"}]

BAD_CHAT = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"max_tokens": 9000}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"messages": IMAGE}, "messages[0].content[1].type"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_unsupported_chat_fields_are_a_bad_request_naming_them(cached, extra, param):
    kwargs = {"model": MODEL, "messages": USER, "max_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        cached.chat.completions.create(**kwargs)
    assert caught.value.status_code == 400 and caught.value.param == param, caught.value.body
    assert caught.value.type == "invalid_request_error"


BAD_COMPLETIONS = [
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1] * 10000, "max_tokens": 8000}, "max_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_unsupported_completion_fields_are_a_bad_request_naming_them(cached, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        cached.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 1, **extra})
    assert caught.value.param == param, caught.value.body


def test_an_unknown_model_is_not_found(cached):
    for call in (
        lambda: cached.chat.completions.create(model="gpt-9", messages=USER, max_tokens=1),
        lambda: cached.completions.create(model="gpt-9", prompt="hi", max_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        assert "gpt-9" in caught.value.message


def test_accepted_no_op_fields_and_text_parts(cached):
    """Fields with no effect on one worker's output by OpenAI's definition are accepted."""
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ]
    reply = cached.chat.completions.create(
        model=MODEL,
        messages=parts,
        max_tokens=2,
        temperature=0,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        response_format={"type": "text"},
        tool_choice="none",
        safety_identifier="s",
        prompt_cache_key="p",
    )
    same = cached.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        temperature=0,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi there"}],
    )
    assert reply.choices[0].message.content == same.choices[0].message.content
