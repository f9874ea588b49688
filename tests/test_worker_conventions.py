"""The worker's operator routes: /tokenize (with what the cache holds), /detokenize, /version,
--api-key, and chat's default max_tokens (the context the prompt leaves)."""

from __future__ import annotations

import json

import openai
import pytest

from prefixcache.version import version
from tests.support.poll import poll
from tests.support.worker_procs import Stack, WorkerProcess

pytestmark = pytest.mark.process

KEY = "sk-test-0123456789abcdef"
MODEL = "prefixcache-tiny-llama"


@pytest.fixture(scope="module")
def stack(worker_stack) -> Stack:
    return worker_stack


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    worker = WorkerProcess(tmp_path_factory.mktemp("keyed"), None, ["--api-key", KEY]).launch().wait_ready()
    try:
        yield worker
    finally:
        worker.stop()


def _post(worker, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    connection = worker.client.connection()
    try:
        connection.request(
            "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_tokenize_applies_the_chat_template_and_says_how_much_is_cached(stack):
    messages = [
        {"role": "system", "content": "Answer in French. " * 8},
        {"role": "user", "content": "How long is the Loire, and where does it rise?"},
    ]
    salt = "tokenize-route"
    status, before = _post(stack.cached, "/tokenize", {"messages": messages, "cache_salt": salt})
    assert status == 200 and before["cached_blocks"] == 0 and before["block_size"] == 16
    reply = stack.cached.client.chat(messages, max_tokens=2, cache_salt=salt)
    assert before["count"] == len(before["tokens"]) == reply.prompt_tokens  # exactly what the chat prefills
    # the chat's store lands after its response, off the inference thread
    assert poll(
        lambda: _post(stack.cached, "/tokenize", {"messages": messages, "cache_salt": salt})[1]["cached_blocks"], 30
    )
    _, after = _post(stack.cached, "/tokenize", {"messages": messages, "cache_salt": salt})
    assert after["tokens"] == before["tokens"]
    assert (
        after["cached_blocks"] == reply.prompt_tokens // 16 > 0
        and after["cached_tokens"] == after["cached_blocks"] * 16
    )
    _, other_salt = _post(stack.cached, "/tokenize", {"messages": messages, "cache_salt": "another"})
    assert other_salt["cached_blocks"] == 0  # salts isolate, also in what /tokenize reports
    _, reference = _post(stack.reference, "/tokenize", {"messages": messages})
    assert reference["tokens"] == before["tokens"] and reference["cached_blocks"] is None  # --no-cache


def test_tokenize_and_detokenize_round_trip_a_prompt(stack):
    text = "Prefix caches reuse KV blocks: ünïcödé too."
    _, tokenized = _post(stack.cached, "/tokenize", {"prompt": text, "model": MODEL})
    status, detokenized = _post(stack.cached, "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and detokenized == {"prompt": text}
    assert tokenized["max_model_len"] == 16384


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": []}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ],
)
def test_tokenize_routes_reject_bad_input_naming_the_field(stack, path, body, status, param):
    got, error = _post(stack.cached, path, body)
    assert got == status and error["error"]["param"] == param, error


def test_version_route(stack):
    status, data, _ = stack.cached.client.request("GET", "/version")
    assert status == 200 and json.loads(data) == {"version": version()}


def test_api_key_guards_every_route_but_health_and_metrics(keyed):
    good = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key=KEY, max_retries=0)
    reply = good.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert reply.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key=KEY + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.code == "invalid_api_key"
    for path in ("/version", "/v1/models"):
        assert keyed.client.request("GET", path)[0] == 401  # no Authorization header at all
    assert _post(keyed, "/tokenize", {"prompt": "x"})[0] == 401
    assert _post(keyed, "/tokenize", {"prompt": "x"}, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert _post(keyed, "/tokenize", {"prompt": "x"}, {"Authorization": f"Basic {KEY}"})[0] == 401
    assert keyed.client.healthy() and keyed.client.request("GET", "/metrics")[0] == 200


def test_chat_max_tokens_defaults_to_the_context_the_prompt_leaves(keyed):
    """A prompt 5 tokens short of the context: with no max_tokens the reply runs to the end."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key=KEY, max_retries=0, timeout=300)
    head = [{"role": "user", "content": ""}]
    _, empty = _post(keyed, "/tokenize", {"messages": head}, {"Authorization": f"Bearer {KEY}"})
    filler = " hello" * (16384 - 5 - empty["count"])  # one cl100k token each
    messages = [{"role": "user", "content": filler}]
    _, counted = _post(keyed, "/tokenize", {"messages": messages}, {"Authorization": f"Bearer {KEY}"})
    assert counted["count"] == 16384 - 5
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, logit_bias={"100265": -100, "100257": -100}
    )  # no end token
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
