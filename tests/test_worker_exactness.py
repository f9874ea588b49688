"""Exactness: a cached worker's greedy output equals a `--no-cache` worker's, token for token.

Real processes (the session's `worker_stack`, tests/support/worker_procs.py): one cache service over
a real Redis, a worker using it, and a `--no-cache` reference worker, all with the tiny
bfloat16 model (cached KV is bitwise the recomputed KV). Every request goes to both workers; text, finish reason and
completion token count must be equal, and `usage.prompt_tokens_details.cached_tokens` must
equal what `ExpectedCache` says the service holds for that prompt: the cached worker commits
each prompt's full blocks, so turn k+1 of a conversation reuses at least all full blocks of
turn k's prompt, and never the whole prompt (one token is always computed).

Covered: misses, partial hits (a turn extending the last, a prompt diverging mid-block), a
full hit on a prompt of exactly k blocks, hits from the host tier, and, after the service is
SIGKILLed and restarted over the same Redis, hits from Redis.
Each test salts its requests (`cache_salt`) and models only its own blocks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from prefixcache_services.replay.transcripts import Conversation, Role, load_sharegpt
from prefixcache_services.worker.chat import ChatMessage, ChatMLTemplate
from prefixcache_services.worker.chat import Role as ChatRole
from prefixcache_services.worker.tokenizer import TiktokenTokenizer
from tests.support.poll import poll
from tests.support.worker_procs import Reply, Stack

pytestmark = [pytest.mark.slow, pytest.mark.process]


BLOCK = 16
MAX_PROMPT_TOKENS = 1536
MAX_TOKENS = 8
CONVERSATIONS = 5
TURNS = 4


@dataclass
class ExpectedCache:
    """What the service must hand back, modelled from the prompts the cached worker was sent: it
    commits each prompt's full blocks (kept as chained keys; no eviction at the test's sizes).
    A hit is the longest committed chain, one block short when it would cover the whole prompt
    (the worker always computes at least one token)."""

    block_size: int = 16
    _keys: set = field(default_factory=set)

    def _chain(self, tokens: Sequence[int], salt: str | None) -> Iterator[object]:
        key: object = ("salt", salt)
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            key = hash((key, tuple(tokens[start : start + self.block_size])))
            yield key

    def hit_tokens(self, tokens: Sequence[int], salt: str | None = None) -> int:
        blocks = 0
        for key in self._chain(tokens, salt):
            if key not in self._keys:
                break
            blocks += 1
        return min(blocks, (len(tokens) - 1) // self.block_size) * self.block_size

    def commit(self, tokens: Sequence[int], salt: str | None = None) -> None:
        self._keys.update(self._chain(tokens, salt))

    @property
    def blocks(self) -> int:
        return len(self._keys)


@pytest.fixture
def stack(worker_stack) -> Stack:
    return worker_stack


@pytest.fixture(scope="module")
def template() -> ChatMLTemplate:
    return ChatMLTemplate(TiktokenTokenizer())


@pytest.fixture
def expected() -> ExpectedCache:
    """The blocks this test committed (its salt keeps them apart from other tests')."""
    return ExpectedCache(BLOCK)


@pytest.fixture
def salt(request) -> str:
    return f"{request.node.name}-{random.getrandbits(32):08x}"


def _turns(conversation: Conversation) -> list[list[dict]]:
    """The prompt of each user turn: the transcript's history up to and including it."""
    turns, history = [], []
    for role, content in conversation.messages:
        history.append({"role": str(role), "content": content})
        if role is Role.USER:
            turns.append(list(history))
    return turns


def _tokens(template: ChatMLTemplate, messages: list[dict]) -> list[int]:
    return template.render([ChatMessage(ChatRole(m["role"]), m["content"]) for m in messages])


def _sharegpt_turns(template: ChatMLTemplate) -> list[list[list[dict]]]:
    """Multi-turn ShareGPT conversations, each cut to its turns under MAX_PROMPT_TOKENS."""
    picked = []
    for conversation in load_sharegpt(limit=60).conversations:
        turns = [t for t in _turns(conversation)[:TURNS] if len(_tokens(template, t)) <= MAX_PROMPT_TOKENS]
        if len(turns) >= 2:
            picked.append(turns)
        if len(picked) == CONVERSATIONS:
            return picked
    raise AssertionError(f"fewer than {CONVERSATIONS} multi-turn ShareGPT conversations found")


def _same(stack: Stack, path: str, payload: dict) -> Reply:
    """Send to both workers; the cached worker's reply after checking it equals the reference."""
    payload = {"temperature": 0, "max_tokens": MAX_TOKENS, **payload}
    cached = stack.cached.client.post(path, payload)
    reference = stack.reference.client.post(path, payload)
    assert cached.status == reference.status == 200, (cached.body, reference.body)
    got = (cached.text, cached.body["choices"][0]["finish_reason"], cached.body["usage"]["completion_tokens"])
    want = (reference.text, reference.body["choices"][0]["finish_reason"], reference.body["usage"]["completion_tokens"])
    assert got == want, f"cached worker diverged (cached_tokens={cached.cached_tokens})"
    assert reference.cached_tokens == 0
    return cached


def _check_hit(stack: Stack, expected: ExpectedCache, path: str, payload: dict, tokens: list[int]) -> Reply:
    """One request to both workers; cached_tokens must be the modelled hit; then model its commit."""
    salt = payload.get("cache_salt")
    want = expected.hit_tokens(tokens, salt)
    reply = _same(stack, path, payload)
    assert reply.prompt_tokens == len(tokens)
    if reply.cached_tokens != want:  # say what the worker's hit policy decided (a decline loads less)
        decisions = {
            labels: value
            for (name, labels), value in stack.cached.client.metrics().items()
            if name == "prefixcache_worker_hit_decisions_total"
        }
        raise AssertionError(
            f"prompt of {len(tokens)} tokens: cached {reply.cached_tokens}, want {want}; "
            f"hit decisions so far: {decisions}"
        )
    assert reply.cached_tokens % BLOCK == 0 and reply.cached_tokens < reply.prompt_tokens
    expected.commit(tokens, salt)
    return reply


def test_sharegpt_conversations_turn_by_turn(stack, template, expected, salt):
    replies: list[tuple[int, int]] = []
    for turns in _sharegpt_turns(template):
        previous: list[int] | None = None
        for messages in turns:
            tokens = _tokens(template, messages)
            reply = _check_hit(
                stack, expected, "/v1/chat/completions", {"messages": messages, "cache_salt": salt}, tokens
            )
            if previous is not None:  # turn k+1 reuses at least every full block of turn k's prompt
                assert tokens[: len(previous)] == previous, "the chat template is not prefix-stable"
                assert reply.cached_tokens >= len(previous) // BLOCK * BLOCK
            previous = tokens
            replies.append((reply.cached_tokens, reply.prompt_tokens))
    assert any(cached == 0 for cached, _ in replies), "no miss exercised"
    assert any(0 < cached < prompt - BLOCK for cached, prompt in replies), "no partial hit exercised"


def test_token_id_prompts_miss_partial_and_full_block_multiple(stack, expected, salt):
    rng = random.Random(5)
    base = [rng.randrange(100, 100_000) for _ in range(5 * BLOCK)]  # exactly 5 blocks
    other = [rng.randrange(100, 100_000) for _ in range(30)]
    cases = [
        (base, 0),  # miss
        (base, 4 * BLOCK),  # full hit on a block multiple: the last block is recomputed
        (base[:40] + other, 2 * BLOCK),  # diverges inside block 3: two blocks reused
        (base + other, 5 * BLOCK),  # extends the prompt: all five blocks reused
        (base[:BLOCK], 0),  # one block: nothing may be reused
    ]
    for tokens, want in cases:
        assert expected.hit_tokens(tokens, salt) == want  # the model agrees with the intent
        _check_hit(stack, expected, "/v1/completions", {"prompt": tokens, "cache_salt": salt}, tokens)


def test_text_completion_prompt_hits(stack, expected, salt):
    prompt = "The history of the printing press begins " + "with movable type and ink, " * 30
    tokens = TiktokenTokenizer().encode(prompt)
    first = _check_hit(stack, expected, "/v1/completions", {"prompt": prompt, "cache_salt": salt}, tokens)
    second = _check_hit(stack, expected, "/v1/completions", {"prompt": prompt, "cache_salt": salt}, tokens)
    assert first.cached_tokens == 0 and second.cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK > 0


def test_host_tier_serves_repeat_hits(stack, expected, salt):
    tokens = random.Random(7).choices(range(100, 100_000), k=6 * BLOCK + 5)
    with stack.service.client() as client:
        before = client.stats().snapshot
        for want in (0, 6 * BLOCK):
            reply = _check_hit(stack, expected, "/v1/completions", {"prompt": tokens, "cache_salt": salt}, tokens)
            assert reply.cached_tokens == want
        after = client.stats().snapshot
    assert after.block_hits - before.block_hits == 6
    assert after.promotions == before.promotions  # nothing came up from Redis: the host tier served it
    host = next(t for t in after.tiers if t.kind.name == "HOST")
    assert host.blocks >= expected.blocks


def test_warm_restart_serves_hits_from_redis(stack, template, expected, salt):
    conversation = _sharegpt_turns(template)[0]
    for messages in conversation[:2]:
        _check_hit(
            stack,
            expected,
            "/v1/chat/completions",
            {"messages": messages, "cache_salt": salt},
            _tokens(template, messages),
        )
    with stack.service.client() as client:
        poll(lambda: client.stats().snapshot.remote["queue_bytes"] == 0, 30, "Redis write-through queue drained")
        remote = client.stats().snapshot.remote
    assert remote["spills_dropped"] == remote["writes_failed"] == 0

    stack.service.restart()  # SIGKILL, then a fresh process on the same port: an empty host tier
    with stack.service.client() as client:
        assert not client.stats().ready  # no namespace until the worker attaches again

    messages = (
        conversation[2]
        if len(conversation) > 2
        else conversation[1] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    )
    tokens = _tokens(template, messages)
    want = expected.hit_tokens(tokens, salt)
    assert want > 0
    payload = {"messages": messages, "cache_salt": salt}
    # The worker's first Lookup finds its namespace gone, attaches again at once and retries:
    # the very first request after the restart reuses the whole modelled prefix, from Redis.
    reply = _same(stack, "/v1/chat/completions", payload)
    assert reply.cached_tokens == want
    with stack.service.client() as client:
        snapshot = client.stats().snapshot
    assert snapshot.promotions.get("host", 0) >= want // BLOCK  # the hit blocks came up from Redis
