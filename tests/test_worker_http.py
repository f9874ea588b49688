"""The worker's HTTP surface over a real process: bad input, /health, /metrics, /v1/models.

Bad input gets a 400 whose OpenAI-style body (`error.message`, `error.type`, `error.param`)
names the offending field, and the worker keeps serving: a valid request right after each
bad one succeeds.
"""

from __future__ import annotations

import json

import pytest

from prefixcache.client import CacheClient
from tests.support.poll import poll
from tests.support.worker_procs import Stack

pytestmark = pytest.mark.process


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def stack(worker_stack) -> Stack:
    return worker_stack


BAD_REQUESTS = [
    # (path, raw body, param named in the error, words the message must contain)
    (CHAT, b'{"messages": [', None, "not valid JSON"),
    (CHAT, b"\xff\xfe{}", None, "not valid JSON"),
    (CHAT, b"[1, 2]", None, "JSON object"),
    (CHAT, {}, "messages", "non-empty list"),
    (CHAT, {"messages": []}, "messages", "non-empty list"),
    (CHAT, {"messages": "hi"}, "messages", "non-empty list"),
    (CHAT, {"messages": ["hi"]}, "messages[0]", "object"),
    (
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
        "system, developer, user or assistant",
    ),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", "string"),
    (CHAT, {"messages": USER, "max_tokens": -1}, "max_tokens", "got -1"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", "got 0"),
    (CHAT, {"messages": USER, "max_tokens": "16"}, "max_tokens", "integer"),
    (CHAT, {"messages": USER, "max_tokens": 1.5}, "max_tokens", "integer"),
    (CHAT, {"messages": USER, "max_completion_tokens": True}, "max_completion_tokens", "integer"),
    (CHAT, {"messages": USER, "temperature": -0.5}, "temperature", "number"),
    (CHAT, {"messages": USER, "temperature": "0"}, "temperature", "number"),
    (CHAT, {"messages": USER, "stop": 5}, "stop", "stop"),
    (CHAT, {"messages": USER, "stop": [""]}, "stop", "stop"),
    (CHAT, {"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    (CHAT, {"messages": USER, "stream": "false"}, "stream", "boolean"),
    (
        CHAT,
        {"messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "boolean",
    ),
    (CHAT, {"messages": USER, "stream_options": []}, "stream_options", "object"),
    (CHAT, {"messages": USER, "n": 2}, "n", "must be 1"),
    (CHAT, {"messages": USER, "seed": -1}, "seed", "integer"),
    (CHAT, {"messages": USER, "cache_salt": ""}, "cache_salt", "printable"),
    (COMPLETIONS, {}, "prompt", "non-empty"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "non-empty"),
    (COMPLETIONS, {"prompt": []}, "prompt", "non-empty"),
    (COMPLETIONS, {"prompt": [1, -2]}, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": [1, True]}, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": [10**9]}, "prompt", "outside the model vocabulary"),
    (COMPLETIONS, {"prompt": [2**40]}, "prompt", "outside the model vocabulary"),
    (COMPLETIONS, {"prompt": [1] * 20000}, "prompt", "the model allows"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -5}, "max_tokens", "got -5"),
    (CHAT, {"messages": USER, "prompt_cache_retention": "forever"}, "prompt_cache_retention", "'24h'"),
    (CHAT, {"messages": USER, "prompt_cache_retention": -3}, "prompt_cache_retention", "'in_memory'"),
    (COMPLETIONS, {"prompt": "x", "prompt_cache_max_tokens": -1}, "prompt_cache_max_tokens", "integer"),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    BAD_REQUESTS,
    ids=[f"{'chat' if p == CHAT else 'completions'}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)],
)
def test_bad_input_is_a_400_naming_the_field_and_the_worker_stays_up(stack, path, body, param, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, data, content_type = stack.cached.client.request("POST", path, raw)
    assert status == 400 and content_type.startswith("application/json"), (status, data)
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error
    good = {"messages": USER} if path == CHAT else {"prompt": "Say something."}
    assert stack.cached.client.post(path, {**good, "max_tokens": 2, "temperature": 0}).status == 200
    assert stack.cached.client.health()["cache"] == "up"  # one request's bad input never costs the others the cache


@pytest.mark.parametrize(("method", "path", "status"), [("GET", CHAT, 405), ("POST", "/v1/nothing", 404)])
def test_unknown_routes_get_an_error_body(stack, method, path, status):
    got, data, _ = stack.cached.client.request(method, path, b"{}" if method == "POST" else None)
    assert got == status and "message" in json.loads(data)["error"]


def test_health_reports_the_model_and_the_cache_link(stack):
    cached, reference = stack.cached.client.health(), stack.reference.client.health()
    assert cached == {"status": "ok", "model": "prefixcache-tiny-llama", "cache": "up"}
    assert reference["cache"] == "off" and reference["model"] == cached["model"]


def test_models_lists_the_served_model(stack):
    status, data, _ = stack.cached.client.request("GET", "/v1/models")
    body = json.loads(data)
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["prefixcache-tiny-llama"]


def test_metrics_count_requests_tokens_and_time_to_first_token(stack):
    client = stack.cached.client
    before = client.metrics()
    prompt = list(range(1000, 1000 + 40))
    held = sum(stack.service.resident_blocks().values())
    assert client.complete(prompt, max_tokens=2, cache_salt="metrics").status == 200
    # the store runs after the response, off the inference thread: wait until it landed
    assert poll(lambda: sum(stack.service.resident_blocks().values()) >= held + 2, 30)
    assert client.complete(prompt, max_tokens=2, cache_salt="metrics").status == 200
    after = client.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("prefixcache_worker_requests_total", outcome="ok") == 2
    assert delta("prefixcache_worker_prompt_tokens_total") == 80
    assert delta("prefixcache_worker_cached_tokens_total") == 32  # the second request reused 2 blocks
    assert delta("prefixcache_worker_ttft_seconds_count") == 2
    assert delta("prefixcache_worker_ttft_seconds_sum") > 0
    assert delta("prefixcache_worker_ttft_seconds_bucket", le="+Inf") == 2


def test_retention_hints_travel_to_the_service_which_bounds_them(stack):
    client, prompt = stack.cached.client, list(range(7000, 7000 + 40))
    with CacheClient(stack.service.address, timeout_s=10) as service:
        base = next(n.namespace_id for n in service.namespaces() if not n.salted)
        block = service.stats().layout.block_size

        def clamped() -> int:
            return service.stats().snapshot.retention_clamped

        def stored(salt: str) -> int:
            return service.inspect(prompt, cache_salt=salt, namespace_id=base).hit_tokens

        before = clamped()
        options = {"max_tokens": 2, "prompt_cache_retention": "24h", "prompt_cache_max_tokens": block + 3}
        assert client.complete(prompt, cache_salt="retention-24h", **options).status == 200
        # The session's service allows no retention past its TTLs (--max-retention 0s): cut, counted.
        assert poll(lambda: clamped() == before + 1, 30)
        assert stored("retention-24h") == block  # prompt_cache_max_tokens: the one whole block within it
        options = {"max_tokens": 2, "prompt_cache_retention": "in_memory"}  # OpenAI's default: no hint
        assert client.complete(prompt, cache_salt="retention-default", **options).status == 200
        assert poll(lambda: stored("retention-default") == len(prompt) // block * block, 30)
        assert clamped() == before + 1
