"""Unit tests of services/replay: loaders, turns, schedule, client, runner, report, plots.

The client and runner run against a small real aiohttp server on 127.0.0.1 that speaks the
OpenAI streaming protocol and echoes deterministically (defined below); nothing else is mocked.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from prefixcache_services.cli import main as cli_main
from prefixcache_services.replay import plots
from prefixcache_services.replay.json_stream import ArrayReadState, JsonArrayError, iter_json_array
from prefixcache_services.replay.openai_client import ChatClient, Completion, chat_completions_url, iter_sse_data
from prefixcache_services.replay.prompt_tokens import ChatTokens
from prefixcache_services.replay.report import Report, build_report, load_schema, percentile, summarize_run
from prefixcache_services.replay.report_table import paired_headline, print_report
from prefixcache_services.replay.runner import (
    ABResult,
    RequestRecord,
    RunOptions,
    RunResult,
    Target,
    busy_time,
    compare_runs,
    run_ab,
    run_schedule,
)
from prefixcache_services.replay.schedule import ScheduleConfig, ScheduleError, ThinkTime, build_schedule
from prefixcache_services.replay.system_prompt import SYSTEM_PROMPT, system_prompt_for
from prefixcache_services.replay.system_prompt import resolve as resolve_system_prompt
from prefixcache_services.replay.transcripts import Conversation, Role, TranscriptError, load_jsonl, load_sharegpt
from prefixcache_services.replay.turns import approx_token_count, conversation_turns
from prefixcache_services.replay.worker_metrics import stores_pending
from prefixcache_services.replay.workload import WorkloadSpec, load_workload

pytestmark = pytest.mark.unit

U, A, S = Role.USER, Role.ASSISTANT, Role.SYSTEM


# --- ShareGPT loading ------------------------------------------------------------------------


def test_sharegpt_reads_first_n_from_packaged_file_without_reading_it_all() -> None:
    first = load_sharegpt(limit=50)
    assert len(first.conversations) == 50
    assert first.conversations[0].id == "QWJhYvA_0"
    assert first.records_read < 200  # streamed from the start, stopped early
    assert not first.truncated  # never reached the cut-off tail
    assert first == load_sharegpt(limit=50)  # deterministic
    for conv in first.conversations:
        assert next(r for r, _ in conv.messages if r is not S) is U
        assert all(c.strip() for _, c in conv.messages)


def test_sharegpt_whole_packaged_file_survives_truncated_tail() -> None:
    full = load_sharegpt()
    assert full.truncated and full.truncated_at_char is not None
    assert full.records_read == 17671
    assert len(full.conversations) + full.skipped_total == full.records_read
    assert full.skipped["does not start with a user message"] > 0
    assert full.conversations[:50] == load_sharegpt(limit=50).conversations


def _sharegpt_record(cid: str, turns: list[tuple[str, str]]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_small_truncated_file(tmp_path: Path) -> None:
    records = [
        _sharegpt_record("a", [("human", "hi"), ("gpt", "hello"), ("human", "bye")]),
        _sharegpt_record("b", [("gpt", "I speak first"), ("human", "x")]),
        _sharegpt_record("c", [("system", "be brief"), ("human", "q"), ("chatgpt", "")]),
        _sharegpt_record("d", [("system", "be brief"), ("human", "q"), ("bing", "a")]),
        _sharegpt_record("e", [("human", "cut off"), ("gpt", "this record is cut")]),
    ]
    text = json.dumps(records, indent=2)
    cut = text.index("this record is cut") + 5
    path = tmp_path / "truncated.json"
    path.write_text(text[:cut], encoding="utf-8")
    result = load_sharegpt(path=path)
    assert [c.id for c in result.conversations] == ["a", "d"]
    assert result.conversations[0].messages == ((U, "hi"), (A, "hello"), (U, "bye"))
    assert result.conversations[1].messages == ((S, "be brief"), (U, "q"), (A, "a"))
    assert result.records_read == 4
    assert result.skipped == {"does not start with a user message": 1, "empty content": 1}
    assert result.truncated
    path.write_text(text, encoding="utf-8")
    whole = load_sharegpt(path=path)
    assert not whole.truncated and [c.id for c in whole.conversations] == ["a", "d", "e"]


@pytest.mark.parametrize("text", ["", "   ", "[", "[\n  ", '[{"a": 1},', '[{"a": 1}, {"b": "x'])
def test_json_array_truncation_points(text: str) -> None:
    state = ArrayReadState()
    items = list(iter_json_array(io.StringIO(text), state, chunk_chars=3))
    assert items == ([{"a": 1}] if "a" in text else [])
    assert state.truncated and not state.complete


def test_json_array_malformed_raises() -> None:
    with pytest.raises(JsonArrayError, match="expected '\\['"):
        list(iter_json_array(io.StringIO('{"a": 1}'), ArrayReadState()))
    with pytest.raises(JsonArrayError, match="expected ',' or ']'"):
        list(iter_json_array(io.StringIO('[{"a": 1} {"b": 2}]'), ArrayReadState()))
    garbage = '[{"a": 1}, {"b": nope}, ' + " " * 100 + "]"
    with pytest.raises(JsonArrayError, match="malformed or larger than 32"):
        list(iter_json_array(io.StringIO(garbage), ArrayReadState(), chunk_chars=8, max_element_chars=32))


@settings(max_examples=60, deadline=None)
@given(
    elements=st.lists(
        st.dictionaries(
            st.text(max_size=4),
            st.one_of(st.integers(), st.text(max_size=6), st.lists(st.integers(), max_size=3)),
            max_size=3,
        ),
        max_size=6,
    ),
    cut_fraction=st.floats(0, 1),
    chunk=st.integers(1, 17),
)
def test_json_array_yields_exactly_the_complete_elements(elements, cut_fraction, chunk) -> None:
    parts = [json.dumps(e) for e in elements]
    text = "[" + ",\n ".join(parts) + "]"
    cut = int(len(text) * cut_fraction)
    ends, pos = [], 1
    for i, part in enumerate(parts):
        pos += (3 if i else 0) + len(part)
        ends.append(pos)
    state = ArrayReadState()
    got = list(iter_json_array(io.StringIO(text[:cut]), state, chunk_chars=chunk))
    assert got == [e for e, end in zip(elements, ends) if end <= cut]
    assert state.complete == (cut == len(text))


# --- JSONL loading ---------------------------------------------------------------------------


def _jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _line(cid: str, *msgs: tuple[str, str]) -> str:
    return json.dumps({"id": cid, "messages": [{"role": r, "content": c} for r, c in msgs]})


def test_jsonl_loads_and_respects_limit(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path, [_line("x", ("system", "s"), ("user", "u1"), ("assistant", "a1")), "", _line("y", ("user", "u"))]
    )
    result = load_jsonl(path)
    assert [c.id for c in result.conversations] == ["x", "y"]
    assert result.conversations[0].messages == ((S, "s"), (U, "u1"), (A, "a1"))
    assert [c.id for c in load_jsonl(path, limit=1).conversations] == ["x"]


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "invalid JSON"),
        ('["a"]', "expected a JSON object"),
        (json.dumps({"messages": [{"role": "user", "content": "u"}]}), "'id' must be"),
        (json.dumps({"id": "z", "messages": []}), "'messages' must be a non-empty list"),
        (_line("z", ("robot", "u")), "messages\\[0\\].role 'robot' is not one of"),
        (
            json.dumps({"id": "z", "messages": [{"role": "user", "content": 3}]}),
            "messages\\[0\\].content must be a string",
        ),
        (_line("z", ("user", "  ")), "empty content"),
        (_line("z", ("assistant", "a"), ("user", "u")), "does not start with a user message"),
        (_line("ok", ("user", "dup")), "duplicate id 'ok'"),
    ],
)
def test_jsonl_errors_name_line_and_problem(tmp_path: Path, bad: str, problem: str) -> None:
    path = _jsonl(tmp_path, [_line("ok", ("user", "u")), "", bad])
    with pytest.raises(TranscriptError, match=f"convs.jsonl:3: .*{problem}"):
        load_jsonl(path)
    lenient = load_jsonl(path, lenient=True)
    assert [c.id for c in lenient.conversations] == ["ok"]
    assert lenient.skipped_total == 1 and lenient.records_read == 2


# --- turns -----------------------------------------------------------------------------------

CONV = Conversation(
    "c1", ((S, "sys"), (U, "hello"), (A, "hi there"), (U, "more"), (A, "sure"), (U, "last"), (A, "done"))
)


def _chars(messages) -> int:
    return sum(len(c) for _, c in messages)


def test_turns_extend_previous_turn_with_transcript_history() -> None:
    turns = conversation_turns(CONV, _chars)
    assert [t.index for t in turns] == [0, 1, 2]
    assert turns[0].messages == CONV.messages[:2]
    assert turns[2].messages == CONV.messages[:6]
    for prev, cur in zip(turns, turns[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages
        assert len(cur.messages) > len(prev.messages)
    assert all(t.messages[-1][0] is U for t in turns)
    assert [t.prompt_tokens for t in turns] == [8, 8 + 8 + 4, 20 + 4 + 4]
    assert turns[1].openai_messages()[2] == {"role": "assistant", "content": "hi there"}


def test_turn_caps() -> None:
    assert len(conversation_turns(CONV, _chars, max_turns=2)) == 2
    assert [t.prompt_tokens for t in conversation_turns(CONV, _chars, max_prompt_tokens=20)] == [8, 20]
    assert conversation_turns(CONV, _chars, max_prompt_tokens=7) == []
    with pytest.raises(ValueError, match="max_turns"):
        conversation_turns(CONV, _chars, max_turns=0)


# --- schedule --------------------------------------------------------------------------------


def _conv_turns(n_convs: int, n_turns: int) -> list[list]:
    out = []
    for i in range(n_convs):
        msgs = []
        for k in range(n_turns):
            msgs += [(U, f"c{i} question {k}"), (A, f"c{i} answer {k}")]
        out.append(conversation_turns(Conversation(f"c{i}", tuple(msgs))))
    return out


def test_schedule_is_deterministic_and_seeded() -> None:
    convs = _conv_turns(20, 3)
    cfg = ScheduleConfig(rate=5.0, think_time_s=1.0, think_time=ThinkTime.EXPONENTIAL, seed=7)
    one, two = build_schedule(convs, cfg), build_schedule(convs, cfg)
    assert one == two
    other = build_schedule(convs, replace(cfg, seed=8))
    assert [c.start_s for c in other.conversations] != [c.start_s for c in one.conversations]
    starts = [c.start_s for c in one.conversations]
    assert starts == sorted(starts) and starts[0] > 0
    assert all(len(c.think_times_s) == len(c.turns) - 1 for c in one.conversations)


def test_schedule_all_at_once_and_poisson_rate() -> None:
    at_once = build_schedule(_conv_turns(5, 2), ScheduleConfig(think_time_s=0.5))
    assert [c.start_s for c in at_once.conversations] == [0.0] * 5
    assert all(c.think_times_s == (0.5,) for c in at_once.conversations)
    many = build_schedule(_conv_turns(4000, 1), ScheduleConfig(rate=10.0, seed=1))
    mean_gap = many.conversations[-1].start_s / len(many.conversations)
    assert mean_gap == pytest.approx(0.1, rel=0.06)


def test_schedule_caps() -> None:
    convs = _conv_turns(10, 4)
    capped = build_schedule(convs, ScheduleConfig(max_requests=10))
    assert capped.request_count == 10
    assert [len(c.turns) for c in capped.conversations] == [4, 4, 2]
    assert [len(c.think_times_s) for c in capped.conversations] == [3, 3, 1]
    timed = build_schedule(convs, ScheduleConfig(rate=2.0, duration_s=2.0, seed=3))
    assert all(c.start_s < 2.0 for c in timed.conversations)
    uncapped = build_schedule(convs, ScheduleConfig(rate=2.0, seed=3))
    assert len(timed.conversations) < len(uncapped.conversations)
    with pytest.raises(ScheduleError, match="concurrency"):
        ScheduleConfig(concurrency=0)
    with pytest.raises(ScheduleError, match="rate"):
        ScheduleConfig(rate=0.0)


# --- echo server (a real OpenAI-compatible SSE server for the client protocol) ---------------


class EchoServer:
    """Streams the last user message's words reversed, one word per chunk.

    Usage reports prompt_tokens = words of all messages; with `report_cache`, cached_tokens =
    longest word prefix shared with an earlier prompt, rounded down to blocks of 4.
    Markers in the last user message trigger failures: #http500 #nodone #badjson #streamerror
    #slow; #corrupt changes the output when `corrupt` is set.
    """

    def __init__(
        self,
        *,
        report_cache: bool = True,
        corrupt: bool = False,
        first_token_delay: float = 0.0,
        request_delay: float = 0.0,
    ) -> None:
        self.report_cache, self.corrupt = report_cache, corrupt
        self.first_token_delay, self.request_delay = first_token_delay, request_delay
        self.seen: list[list[str]] = []
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def _cached(self, words: list[str]) -> int:
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(words) - 1) and old[n] == words[n]:
                n += 1
            best = max(best, n // 4 * 4)
        return best

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        last = body["messages"][-1]["content"]
        if "#http500" in last:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, last)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, last: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        words = " ".join(f"{m['role']}: {m['content']}" for m in body["messages"]).split()
        cached = self._cached(words)
        self.seen.append(words)
        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(self.first_token_delay + self.request_delay)
        if "#slow" in last:
            await asyncio.sleep(5)
        out = list(reversed(last.split()))[: body["max_tokens"]]
        if self.corrupt and "#corrupt" in last:
            out = ["CORRUPTED"]
        for i, word in enumerate(out):
            await send({"choices": [{"index": 0, "delta": {"content": (" " if i else "") + word}}]})
        if "#badjson" in last:
            await send("{not json")
        if "#streamerror" in last:
            await send({"error": {"message": "engine died"}})
        await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"prompt_tokens": len(words), "completion_tokens": len(out), "total_tokens": len(words) + len(out)}
        if self.report_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        await send({"choices": [], "usage": usage})
        if "#nodone" not in last:
            await send("[DONE]")
        return resp


@asynccontextmanager
async def serving(server: EchoServer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    # handler_cancellation: a handler stops when its client hangs up (the timeout test).
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def _msgs(*contents: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


# --- client ----------------------------------------------------------------------------------


def test_chat_completions_url() -> None:
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="http://"):
        chat_completions_url("h:1")


def test_sse_parsing_across_arbitrary_chunk_boundaries() -> None:
    stream = (
        'data: {"a": "é"}\r\n\n: keep-alive\n\nevent: x\ndata: line1\ndata: line2\n\n'
        "data: " + "z" * 200_000 + "\n\ndata:[DONE]"
    ).encode()

    async def collect(size: int) -> list[str]:
        async def chunks():
            for i in range(0, len(stream), size):
                yield stream[i : i + size]

        return [d async for d in iter_sse_data(chunks())]

    for size in (1, 2, 7, len(stream)):
        got = asyncio.run(collect(size))
        assert got == ['{"a": "é"}', "line1\nline2", "z" * 200_000, "[DONE]"]


def test_client_streams_measures_ttft_and_parses_usage() -> None:
    async def main():
        server = EchoServer(first_token_delay=0.05)
        async with serving(server) as url, ChatClient(url, "m") as client:
            first = await client.complete(_msgs("one two three four five six seven"), 4)
            second = await client.complete(_msgs("one two three four five six seven", "x", "eight"), 4)
        return server, first, second

    server, first, second = asyncio.run(main())
    assert first.ok and first.text == "seven six five four"
    assert first.ttft_s >= 0.05 and first.latency_s >= first.ttft_s
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (8, 4, 0)
    assert second.cached_tokens == 8 and second.prompt_tokens == 12
    assert first.finish_reason == "length" and first.http_status == 200
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 4 and body["model"] == "m"


def test_client_without_cached_tokens_reports_none() -> None:
    async def main():
        async with serving(EchoServer(report_cache=False)) as url, ChatClient(url, "m") as c:
            return await c.complete(_msgs("a b"), 8)

    result = asyncio.run(main())
    assert result.ok and result.cached_tokens is None and result.prompt_tokens == 3


def _free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_captures_every_failure_as_error() -> None:
    async def main():
        async with serving(EchoServer()) as url:
            async with ChatClient(url, "m", timeout_s=0.5) as client:
                results = {
                    m: await client.complete(_msgs(f"hi {m}"), 8)
                    for m in ("#http500", "#nodone", "#badjson", "#streamerror", "#slow")
                }
        async with ChatClient(f"http://127.0.0.1:{_free_closed_port()}", "m") as client:
            results["refused"] = await client.complete(_msgs("hi"), 8)
        return results

    r = asyncio.run(main())
    assert r["#http500"].error.startswith("HTTP 500") and "boom" in r["#http500"].error
    assert r["#nodone"].error == "stream ended before data: [DONE]"
    assert r["#badjson"].error.startswith("malformed SSE data")
    assert "engine died" in r["#streamerror"].error
    assert r["#slow"].error == "timeout" and r["#slow"].latency_s < 2
    assert r["refused"].error.startswith("ClientConnector")
    assert all(not c.ok for c in r.values())


# --- runner ----------------------------------------------------------------------------------


def _schedule(n_convs: int, n_turns: int, **cfg):
    return build_schedule(_conv_turns(n_convs, n_turns), ScheduleConfig(**cfg))


def test_runner_respects_concurrency_and_turn_order() -> None:
    sched = _schedule(6, 3, concurrency=2, think_time_s=0.02)
    server = EchoServer(request_delay=0.03)

    async def main():
        async with serving(server) as url:
            console = Console(file=io.StringIO(), force_terminal=False)
            run = await run_schedule(sched, Target("echo", url, "m"), RunOptions(max_tokens=3), console)
            return run, console.file.getvalue()

    run, shown = asyncio.run(main())
    assert server.max_in_flight == 2
    assert len(run.records) == 18 and all(r.completion.ok for r in run.records)
    assert "replay -> echo" in shown
    by_conv: dict[str, list[RequestRecord]] = {}
    for rec in run.records:
        by_conv.setdefault(rec.conversation_id, []).append(rec)
    for recs in by_conv.values():
        recs.sort(key=lambda r: r.turn_index)
        for prev, cur in zip(recs, recs[1:]):
            assert cur.start_s >= prev.start_s + prev.completion.latency_s + 0.02 - 1e-3


def test_runner_duration_cap_bounds_the_run() -> None:
    sched = _schedule(3, 10, think_time_s=0.1, duration_s=0.35)

    async def main():
        async with serving(EchoServer()) as url:
            t0 = time.perf_counter()
            run = await run_schedule(sched, Target("echo", url, "m"), RunOptions(drain_s=0.5))
            return run, time.perf_counter() - t0

    run, elapsed = asyncio.run(main())
    assert 0 < len(run.records) < 30 and run.not_sent == 30 - len(run.records)
    assert all(r.start_s < 0.35 for r in run.records)
    assert elapsed < 0.35 + 0.5 + 0.5


def _ab_conversations() -> list[list]:
    convs = _conv_turns(3, 3)
    marked = Conversation("marked", ((U, "please #corrupt me"), (A, "ok"), (U, "again")))
    return convs + [conversation_turns(marked)]


def test_ab_detects_output_mismatch_and_builds_valid_report(tmp_path: Path) -> None:
    cfg = ScheduleConfig(concurrency=4, seed=5)
    sched = build_schedule(_ab_conversations(), cfg)

    async def main():
        async with serving(EchoServer()) as a, serving(EchoServer(report_cache=False, corrupt=True)) as b:
            return await run_ab(sched, Target("cache", a, "m"), Target("nocache", b, "m"), RunOptions(max_tokens=8))

    ab = asyncio.run(main())
    assert ab.comparison.compared == 11 and ab.comparison.mismatches == 1
    assert ab.comparison.mismatched == (("marked", 0),)
    report = build_report(ab, cfg, block_size=4, service_stats={"evictions": {"host": 0}})
    jsonschema.validate(json.loads(report.to_json()), load_schema())
    assert report.cache_run.token_hit_rate > 0 and report.baseline_run.token_hit_rate is None
    assert report.comparison.mismatches == 1
    assert sum(t.output_match is False for t in report.turns) == 1
    assert report.cache_run.ttft_s.count == report.baseline_run.ttft_s.count == 11
    console = Console(file=io.StringIO(), width=140)
    print_report(report, console)
    assert "output mismatches / compared" in console.file.getvalue()
    paths = plots.write_plots(report, tmp_path / "plots")
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_interleaved_ab_sends_each_turn_to_both_back_to_back_the_first_alternating() -> None:
    cfg = ScheduleConfig(concurrency=1, seed=1)
    sched = build_schedule(_conv_turns(3, 3), cfg)
    cached, plain = EchoServer(request_delay=0.01), EchoServer(report_cache=False, request_delay=0.01)
    settled: list[int] = []  # baseline requests already received each time `settle` ran

    async def settle() -> None:
        settled.append(len(plain.bodies))

    async def main():
        async with serving(cached) as a, serving(plain) as b:
            t0 = time.perf_counter()
            ab = await run_ab(
                sched,
                Target("cache", a, "m"),
                Target("nocache", b, "m"),
                RunOptions(max_tokens=4),
                interleave=True,
                settle=settle,
            )
            return ab, time.perf_counter() - t0

    ab, elapsed = asyncio.run(main())
    assert ab.comparison.compared == 9 and ab.comparison.mismatches == 0
    assert cached.max_in_flight == plain.max_in_flight == 1  # concurrency 1 covers the pair
    assert settled == list(range(9))  # awaited before each baseline request, never before a cached one
    cache = {r.key: r for r in ab.cache.records}
    base = {r.key: r for r in ab.baseline.records}
    for position, conv in enumerate(sched.conversations):
        for k, turn in enumerate(conv.turns):
            key = (conv.conversation_id, turn.index)
            first, second = (cache[key], base[key]) if (position + k) % 2 == 0 else (base[key], cache[key])
            assert second.start_s >= first.start_s + first.completion.latency_s - 1e-3  # back to back
    # Each side's wall time is its own serving time: about its requests' latencies, not the run's.
    for run in (ab.cache, ab.baseline):
        latencies = sum(r.completion.latency_s for r in run.records)
        assert latencies - 1e-3 <= run.wall_s <= latencies + 9 * 0.01
        assert run.wall_s < 0.8 * elapsed
    report = build_report(ab, cfg, block_size=4, interleaved=True)
    assert report.interleaved is True and report.paired is not None and report.paired.all.requests == 9
    jsonschema.validate(json.loads(report.to_json()), load_schema())


def test_busy_time_is_the_union_of_intervals() -> None:
    assert busy_time([]) == 0.0
    assert busy_time([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == pytest.approx(3.0)
    assert busy_time([(0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)


def test_interleave_needs_a_no_cache_target(capsys) -> None:
    code = cli_main(["replay", "--target", "http://127.0.0.1:9", "--interleave", "--no-progress"])
    assert code == 2
    assert "--interleave needs --compare-no-cache" in capsys.readouterr().err


def test_stores_pending_is_read_off_the_worker_metrics_text() -> None:
    text = "# HELP x\nprefixcache_worker_stores_pending 2.0\nprefixcache_worker_stores_dropped_total 0.0\n"
    assert stores_pending(text) == 2.0
    assert stores_pending("prefixcache_worker_requests_total 3.0\n") is None


# --- the shared system prompt ------------------------------------------------------------------


def test_the_builtin_system_prompt_is_a_realistic_length() -> None:
    tokens = ChatTokens().message_count((S, SYSTEM_PROMPT))
    assert 500 <= tokens <= 1500, tokens
    assert resolve_system_prompt("builtin") == SYSTEM_PROMPT and resolve_system_prompt("none") is None


def test_a_system_prompt_file_is_read_and_a_bad_one_is_named(tmp_path: Path) -> None:
    good = tmp_path / "prompt.txt"
    good.write_text("You are terse.\n", encoding="utf-8")
    assert resolve_system_prompt(str(good)) == "You are terse.\n"
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    for bad, problem in ((tmp_path / "missing.txt", "cannot read it"), (tmp_path / "empty.txt", "the file is empty")):
        with pytest.raises(ValueError, match="--system-prompt") as caught:
            resolve_system_prompt(str(bad))
        assert problem in str(caught.value)


@pytest.mark.parametrize(("share", "without"), [(1.0, []), (0.75, [3, 7, 11]), (0.5, [1, 3, 5, 7, 9, 11]), (0.0, None)])
def test_system_prompt_share_spreads_the_conversations_without_it(share, without) -> None:
    picked = [i for i in range(12) if not system_prompt_for(i, share)]
    assert picked == (list(range(12)) if without is None else without)
    with pytest.raises(ValueError, match="share"):
        system_prompt_for(0, 1.5)


def test_workload_puts_the_system_prompt_before_the_chosen_conversations(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    rows = [
        {
            "id": f"c{i}",
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}],
        }
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prompt = "You are a careful assistant. " * 20
    plain = load_workload(WorkloadSpec(source=str(path), conversations=8), approx_token_count)
    spec = WorkloadSpec(source=str(path), conversations=8, system_prompt=prompt, system_prompt_share=0.75)
    shared = load_workload(spec, approx_token_count)
    has = [turns[0].messages[0] == (S, prompt) for turns in shared.turns]
    assert has == [True, True, True, False, True, True, True, False]
    extra = approx_token_count([(S, prompt)])
    for with_it, a, b in zip(has, shared.turns, plain.turns, strict=True):
        assert a[0].prompt_tokens == b[0].prompt_tokens + (extra if with_it else 0)  # the caps count it
    capped = load_workload(replace(spec, max_prompt_tokens=extra), approx_token_count)
    # Over the cap with the prompt: a skipped conversation leaves its place (and the prompt) to the next.
    assert capped.turns == () and capped.exhausted
    with pytest.raises(ValueError, match="system_prompt_share"):
        WorkloadSpec(system_prompt=prompt, system_prompt_share=-0.1)


# --- report math on hand-computed data -------------------------------------------------------


def test_percentile_linear_interpolation() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None


def _hand_run() -> RunResult:
    def rec(i, **kw):
        return RequestRecord("c", i, float(i), Completion(**kw))

    return RunResult(
        Target("t", "http://x", "m"),
        (
            rec(0, text="a", ttft_s=0.1, latency_s=1.0, prompt_tokens=100, cached_tokens=64, completion_tokens=10),
            rec(1, text="b", ttft_s=0.3, latency_s=2.0, prompt_tokens=50, cached_tokens=0, completion_tokens=6),
            rec(2, text="c", ttft_s=0.2, latency_s=3.0, prompt_tokens=30, cached_tokens=None, completion_tokens=4),
            rec(3, error="HTTP 503: overloaded", latency_s=0.01),
        ),
        wall_s=2.0,
        scheduled=5,
        not_sent=1,
    )


def test_run_summary_hit_rates_and_throughput() -> None:
    s = summarize_run(_hand_run(), block_size=16)
    assert (s.requests, s.ok, s.errors, s.not_sent) == (4, 3, 1, 1)
    assert s.error_kinds == {"HTTP 503": 1}
    assert s.token_hit_rate == pytest.approx(64 / 150)
    assert s.block_hit_rate == pytest.approx(4 / 9)
    assert s.request_hit_rate == pytest.approx(1 / 2)
    assert (s.prefill_tokens_saved, s.prefill_tokens_computed, s.prompt_tokens) == (64, 116, 180)
    assert s.cached_tokens_reported == 2
    assert s.ttft_s.p50 == pytest.approx(0.2) and s.ttft_s.count == 3
    assert s.ttft_hit_s.p50 == pytest.approx(0.1) and s.ttft_miss_s.p50 == pytest.approx(0.3)
    assert s.latency_s.p99 == pytest.approx(2.98)
    assert s.throughput.requests_per_s == pytest.approx(1.5)
    assert s.throughput.prompt_tokens_per_s == pytest.approx(90.0)
    assert s.throughput.completion_tokens_per_s == pytest.approx(10.0)
    assert summarize_run(_hand_run()).block_hit_rate is None


def _hand_report() -> Report:
    run = _hand_run()
    return build_report(ABResult(run, None, None), ScheduleConfig(), block_size=16)


def test_report_schema_rejects_drift() -> None:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = json.loads(_hand_report().to_json())
    jsonschema.validate(good, schema)
    assert good["baseline_run"] is None and good["turns"][3]["error"].startswith("HTTP 503")
    bad_rate = json.loads(json.dumps(good))
    bad_rate["cache_run"]["token_hit_rate"] = 1.5
    extra = json.loads(json.dumps(good))
    extra["turns"][0]["surprise"] = 1
    for bad in (bad_rate, extra):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_paired_summary_divides_each_request_by_its_no_cache_twin() -> None:
    run = _hand_run()

    def twin(i, **kw):
        return RequestRecord("c", i, float(i), Completion(**kw))

    baseline = replace(
        run,
        records=(
            twin(0, text="a", ttft_s=0.4, latency_s=1.3, prompt_tokens=100, cached_tokens=0, completion_tokens=10),
            twin(1, text="b", ttft_s=0.25, latency_s=1.25, prompt_tokens=50, cached_tokens=0, completion_tokens=6),
            twin(2, text="c", ttft_s=0.2, latency_s=1.4, prompt_tokens=30, cached_tokens=0, completion_tokens=4),
            twin(3, text="d", ttft_s=0.1, latency_s=0.5, prompt_tokens=10, cached_tokens=0, completion_tokens=4),
        ),
        wall_s=4.0,
    )
    report = build_report(ABResult(run, baseline, compare_runs(run, baseline)), ScheduleConfig(), block_size=16)
    paired = report.paired
    assert paired is not None
    # Turn 0 is the hit (0.1 vs 0.4 s), turn 1 the miss (0.3 vs 0.25 s); turn 2 reported no
    # cached_tokens (in "all" only), turn 3 failed in the cache run (in no class).
    assert (paired.hits.requests, paired.misses.requests, paired.all.requests) == (1, 1, 3)
    assert paired.hits.ttft_ratio_p50 == pytest.approx(0.25)
    assert paired.misses.ttft_ratio_p50 == pytest.approx(1.2)
    assert paired.all.ttft_ratio_p50 == pytest.approx(1.0)
    assert paired.hits.after_first_token_ratio_p50 == pytest.approx(0.9 / 0.9)
    assert paired.misses.after_first_token_ratio_p50 == pytest.approx(1.7 / 1.0)
    assert paired.throughput_ratio == pytest.approx(1.5 / 1.0)
    jsonschema.validate(json.loads(report.to_json()), load_schema())
    assert "TTFT 0.25x on 1 hits, 1.20x on 1 misses" in paired_headline(paired)
    assert _hand_report().paired is None  # no baseline, nothing to pair


def test_compare_runs_only_counts_requests_ok_in_both() -> None:
    run = _hand_run()
    other = replace(
        run,
        records=run.records[:1]
        + (RequestRecord("c", 1, 1.0, Completion(text="different")), RequestRecord("c", 3, 3.0, Completion(text="d"))),
    )
    cmp = compare_runs(run, other)
    assert (cmp.compared, cmp.mismatches, cmp.mismatched) == (2, 1, (("c", 1),))
    assert (cmp.only_in_cache_run, cmp.only_in_baseline_run) == (1, 1)


def test_plots_of_report_without_baseline(tmp_path: Path) -> None:
    report = _hand_report()
    assert plots.ttft_series(report)["cache misses only"] == [pytest.approx(300.0)]
    points = plots.hit_rate_points(report.turns)
    assert [p[1] for p in points] == [pytest.approx(64 / 100), pytest.approx(64 / 150)]
    empty = replace(report, turns=())
    for r, name in ((report, "a"), (empty, "b")):
        for path in plots.write_plots(r, tmp_path / name):
            assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 2000
