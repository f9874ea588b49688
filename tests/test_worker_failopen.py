"""Fail-open, concurrency, client disconnects and streaming of the worker, over real processes.

- The cache service SIGKILLed while requests run: every request still succeeds with the
  `--no-cache` worker's output, with cached_tokens 0 while the service is down; the outage is
  logged once; restarted on the same port, the worker attaches again and hits.
- Simultaneous requests (threads, streaming and not) all succeed with exact outputs.
- A streaming client that disconnects stops its generation (the inference thread is free for
  the next request long before the generation could have finished) and its lease is released
  (the service's active_leases returns to 0, well before the 30 s lease TTL could expire it).
- Server-sent events parse; the usage chunk comes last when stream_options.include_usage is set.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.poll import poll
from tests.support.worker_procs import Reply, Stack, WorkerClient

pytestmark = pytest.mark.process


MAX_TOKENS = 8
SYSTEM = (
    "You are a meticulous assistant for a travel agency. Answer with the itinerary, the costs and "
    "the risks, in that order, and keep every answer short. "
) * 4


@pytest.fixture
def stack(worker_stack) -> Stack:
    return worker_stack


@pytest.fixture
def salt(request) -> str:
    return f"{request.node.name}-{random.getrandbits(32):08x}"


def _chat(question: str, salt: str, **options) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "cache_salt": salt, **options}


def _outcome(reply: Reply) -> tuple[str, str, int]:
    return reply.text, reply.body["choices"][0]["finish_reason"], reply.body["usage"]["completion_tokens"]


def _reference(stack: Stack, payloads: list[dict]) -> list[tuple[str, str, int]]:
    return [_outcome(stack.reference.client.post("/v1/chat/completions", p)) for p in payloads]


class RequestLoop(threading.Thread):
    """Sends requests one after another until stopped; records (sent, done, payload, reply)."""

    def __init__(self, client: WorkerClient, salt: str) -> None:
        super().__init__(daemon=True)
        self.client, self.salt = client, salt
        self.records: list[tuple[float, float, dict, Reply]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                payload = _chat(f"Plan a trip number {i % 5} to a city by the sea.", self.salt)
                sent = time.monotonic()
                reply = self.client.post("/v1/chat/completions", payload)
                self.records.append((sent, time.monotonic(), payload, reply))
                i += 1
        except BaseException as error:  # noqa: BLE001 - re-raised by the test thread
            self.error = error

    def replies_after(self, moment: float) -> int:
        return sum(1 for sent, _, _, _ in self.records if sent > moment)


def test_service_killed_mid_run_then_restarted(stack, salt):
    log_before = stack.cached.log()
    loop = RequestLoop(stack.cached.client, salt)
    loop.start()
    try:
        poll(lambda: len(loop.records) >= 3 or loop.error, 60, "requests before the kill")
        killed = time.monotonic()
        stack.service.kill()
        poll(lambda: loop.replies_after(killed) >= 3 or loop.error, 60, "requests while the service is down")
        assert stack.cached.client.health()["cache"] == "down"
        restarted = time.monotonic()
        stack.service.start()
        poll(
            lambda: (
                any(sent > restarted and r.status == 200 and r.cached_tokens for sent, _, _, r in loop.records)
                or loop.error
            ),
            60,
            "a hit after the restart",
        )
    finally:
        loop.stop.set()
        loop.join(60)
    assert loop.error is None, loop.error
    records = loop.records
    assert all(reply.status == 200 for *_, reply in records), [r.body for *_, r in records if r.status != 200]
    assert any(r.cached_tokens for sent, done, _, r in records if done < killed), "no hit before the kill"
    down = [r for sent, done, _, r in records if sent > killed and done < restarted]
    assert down and all(r.cached_tokens == 0 for r in down)
    reference = _reference(stack, [payload for _, _, payload, _ in records])
    assert [_outcome(r) for *_, r in records] == reference
    log = stack.cached.log()[len(log_before) :]
    assert log.count("cache link down") == 1 and log.count("cache link up") == 1, log
    fallbacks = sum(
        value
        for (name, _), value in stack.cached.client.metrics().items()
        if name == "prefixcache_worker_cache_fallbacks_total"
    )
    assert fallbacks >= len(down)  # every request while down fell back (lookup, or attach when retried)
    assert stack.cached.client.health()["cache"] == "up"


def test_simultaneous_requests_all_exact(stack, salt):
    payloads = [
        _chat(
            f"Question {i}: which museum should we see first, and why?", salt, max_tokens=6 + i % 3, stream=i % 3 == 0
        )
        for i in range(8)
    ]
    stack.cached.client.post("/v1/chat/completions", {**payloads[1], "stream": False})  # a shared prefix to hit
    start = threading.Barrier(len(payloads))

    def send(payload: dict) -> tuple[str, str, int]:
        start.wait()
        if not payload["stream"]:
            return _outcome(stack.cached.client.post("/v1/chat/completions", payload))
        events = list(stack.cached.client.stream("/v1/chat/completions", payload))
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        finish = next(e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"])
        return text, finish, -1

    with ThreadPoolExecutor(len(payloads)) as pool:
        results = list(pool.map(send, payloads))
    reference = _reference(stack, [{**p, "stream": False} for p in payloads])
    for payload, got, want in zip(payloads, results, reference):
        assert got[:2] == want[:2] and (payload["stream"] or got[2] == want[2])


def _generating(stack: Stack, payload: dict, stream: bool):
    """Start a request and return once its generation runs: (connection-closing callable)."""
    if stream:
        events = stack.cached.client.stream("/v1/chat/completions", payload)
        first = next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
        assert first["choices"][0]["finish_reason"] is None
        return events.close  # closes the generator, and with it the connection
    prompts = stack.cached.client.metric("prefixcache_worker_prompt_tokens_total")
    connection = stack.cached.client.connection()
    connection.request(
        "POST", "/v1/chat/completions", body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    poll(
        lambda: stack.cached.client.metric("prefixcache_worker_prompt_tokens_total") > prompts,
        30,
        "the request's prefill done",
    )  # counted once prefilled, before decoding starts
    return connection.close


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_disconnected_client_stops_generating_and_releases_its_lease(stack, salt, stream):
    payload = _chat("Describe every day of a two-month journey.", salt, max_tokens=4000, stream=stream)
    stack.cached.client.post("/v1/chat/completions", {**payload, "max_tokens": 1, "stream": False})  # cache it
    # the worker stores in the background once the response is written: the next request hits only after it
    poll(lambda: stack.cached.client.metric("prefixcache_worker_stores_pending") == 0, 30, "the store landed")
    cancelled = stack.cached.client.metric("prefixcache_worker_requests_total", outcome="cancelled")
    with stack.service.client() as service:
        disconnect = _generating(stack, payload, stream)
        assert service.stats().snapshot.active_leases == 1  # the hit's lease is held while it generates
        disconnect()
        poll(lambda: service.stats().snapshot.active_leases == 0, 10, "the lease released")
    poll(
        lambda: stack.cached.client.metric("prefixcache_worker_requests_total", outcome="cancelled") > cancelled,
        20,
        "the generation cancelled",
    )
    # 4000 tokens take far longer than this; the next request runs once the inference thread
    # is free, so it completing at all within the HTTP timeout needs the generation stopped.
    after = stack.cached.client.post("/v1/chat/completions", _chat("And a short one?", salt))
    assert after.status == 200 and _outcome(after) == _reference(stack, [_chat("And a short one?", salt)])[0]
    assert stack.cached.client.metric("prefixcache_worker_requests_total", outcome="cancelled") == cancelled + 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_chunks_and_final_usage(stack, salt, path):
    body = (
        _chat("Name three harbours.", salt)
        if path.endswith("chat/completions")
        else {"prompt": SYSTEM, "temperature": 0, "max_tokens": MAX_TOKENS, "cache_salt": salt}
    )
    full = stack.reference.client.post(path, body)
    for attempt in range(2):  # a miss, then a hit: both stream the same text
        held = sum(stack.service.resident_blocks().values())
        events = list(stack.cached.client.stream(path, {**body, "stream_options": {"include_usage": True}}))
        if attempt == 0:  # the store lands after [DONE], off the inference thread
            assert poll(lambda held=held: sum(stack.service.resident_blocks().values()) > held, 30)
        assert events[-1] == "[DONE]"
        *chunks, usage_chunk, _ = events
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == full.prompt_tokens
        assert usage_chunk["usage"]["completion_tokens"] == full.body["usage"]["completion_tokens"]
        assert (usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) == (attempt == 1)
        assert len({c["id"] for c in chunks + [usage_chunk]}) == 1
        if path.endswith("chat/completions"):
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == full.text
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == full.body["choices"][0]["finish_reason"]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    plain = list(stack.cached.client.stream(path, body))  # without include_usage: no usage chunk
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])
