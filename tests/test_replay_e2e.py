"""`prefixcache replay` end to end, on real processes over loopback.

- A/B: a cache service, a worker using it and a worker without it (built-in tiny model), and
  the replay CLI as a subprocess with --json. Every turn k>0 of a conversation must hit ALL of
  turn k-1's full prompt blocks, and the greedy outputs with and without the cache must match.
- Cache-only at concurrency 8 against a real service: no errors, every hit checked byte for
  byte; and a planted wrong block is caught (the check can fail).
- Every report validates against services/replay/report.schema.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.client import CacheClient
from prefixcache_services import cli
from prefixcache_services.replay.local_stack import LocalStack
from prefixcache_services.replay.prompt_tokens import ChatTokens
from prefixcache_services.replay.report import load_schema
from prefixcache_services.replay.synthetic_kv import SyntheticKV, preset
from prefixcache_services.replay.transcripts import Conversation, Role

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(service address, cached worker URL, cache-less worker URL); stopped after the module."""
    with LocalStack(tmp_path_factory.mktemp("stack-logs"), startup_timeout_s=150) as local:
        deadline = local.deadline()
        service = local.start_service("64MiB")
        address = local.service_address(service, deadline)
        cached, cached_url = local.start_worker("worker-cache", address, ("--hit-policy", "always"))
        plain, plain_url = local.start_worker("worker-no-cache", None)
        local.wait_healthy(cached, cached_url, deadline)
        local.wait_healthy(plain, plain_url, deadline)
        yield local, address, cached_url, plain_url


def _replay(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "prefixcache_services", "--log-level", "WARNING", "replay", "--no-progress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _valid_report(path: Path) -> dict:
    report = json.loads(path.read_text())
    jsonschema.validate(report, load_schema())
    return report


def _assert_each_turn_hits_the_previous_turns_blocks(turns: list[dict]) -> int:
    """Returns how many turns k>0 were checked."""
    by_conv: dict[str, list[dict]] = {}
    for turn in turns:
        by_conv.setdefault(turn["conversation_id"], []).append(turn)
    checked = 0
    for conv_turns in by_conv.values():
        conv_turns.sort(key=lambda t: t["turn_index"])
        for prev, cur in zip(conv_turns, conv_turns[1:]):
            assert cur["error"] is None, cur
            full_blocks = prev["prompt_tokens"] // BLOCK * BLOCK
            assert cur["cached_tokens"] >= full_blocks, (prev, cur)
            assert cur["cached_tokens"] % BLOCK == 0 and cur["cached_tokens"] < cur["prompt_tokens"]
            checked += 1
    return checked


def _lookups_skipped(worker_url: str) -> float:
    """The worker's prompts not looked up (the service's presence table held none of them)."""
    with urllib.request.urlopen(f"{worker_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return sum(sample.value for sample in families["prefixcache_worker_lookups_skipped"].samples)


def test_ab_replay_hits_every_previous_turn_and_outputs_match(stack, tmp_path):
    _, address, cached_url, plain_url = stack
    out = tmp_path / "ab.json"
    skipped_before = _lookups_skipped(cached_url)
    done = _replay(
        "--target",
        cached_url,
        "--compare-no-cache",
        plain_url,
        "--cache-stats",
        address,
        "--conversations",
        "3",
        "--max-turns",
        "3",
        "--max-prompt-tokens",
        "800",
        "--max-tokens",
        "8",
        "--concurrency",
        "2",
        "--think-time",  # a user reads the reply first; the worker stores a turn after its response
        "0.5",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "output check: 0 mismatches" in done.stdout
    report = _valid_report(out)
    run, base = report["cache_run"], report["baseline_run"]
    assert run["errors"] == base["errors"] == 0 and run["ok"] == run["scheduled"] >= 5
    assert report["comparison"]["mismatches"] == 0 and report["comparison"]["compared"] == run["ok"]
    assert all(t["output_match"] is True for t in report["turns"])
    assert _assert_each_turn_hits_the_previous_turns_blocks(report["turns"]) >= 2
    assert run["prefill_tokens_saved"] > 0 and base["prefill_tokens_saved"] == 0
    assert base["cached_tokens_reported"] == base["ok"]  # the baseline worker reports 0, not nothing
    assert report["workload"]["max_tokens"] == 8 and report["workload"]["model"] == "prefixcache-tiny-llama"
    stats = report["service_stats"]["at_end"]
    assert stats["tokens_saved"] >= run["prefill_tokens_saved"]
    # Every request was looked up, or not because the presence table showed none of it held
    # (the first turns); every hit was looked up.
    skipped = _lookups_skipped(cached_url) - skipped_before
    lookups = report["service_stats"]["during_run"]["lookups"]
    hits = sum(1 for turn in report["turns"] if turn["cached_tokens"])
    assert skipped >= 1 and lookups + skipped == run["ok"] and lookups >= hits


def test_cache_only_at_concurrency_8_verifies_every_hit(stack, tmp_path):
    _, address, _, _ = stack
    out = tmp_path / "cache_only.json"
    # The first run commits every conversation's blocks; the repeat must hit them all.
    args = (
        "--cache",
        address,
        "--model-size",
        "tiny",
        "--concurrency",
        "8",
        "--conversations",
        "12",
        "--max-turns",
        "4",
        "--max-prompt-tokens",
        "2048",
    )
    first = _replay(*args, "--json", str(out))
    assert first.returncode == 0, first.stdout + first.stderr
    report = _valid_report(out)
    summary, run = report["cache_only"], report["cache_run"]
    assert run["errors"] == 0 and run["ok"] == run["scheduled"] >= 20
    assert summary["corrupt_blocks"] == 0 and summary["verified_blocks"] == summary["blocks_read"] > 0
    assert summary["shared_memory"] and summary["lookups"] == run["ok"]
    assert _assert_each_turn_hits_the_previous_turns_blocks(report["turns"]) >= 10
    assert report["service_stats"]["address"] == address
    again = _replay(*args, "--stream", "--json", str(out))  # KV over gRPC this time
    assert again.returncode == 0, again.stdout + again.stderr
    repeat = _valid_report(out)
    assert not repeat["cache_only"]["shared_memory"] and repeat["cache_only"]["corrupt_blocks"] == 0
    for turn in repeat["turns"]:  # every full block of every prompt is cached by now
        assert turn["cached_tokens"] == turn["prompt_tokens"] // BLOCK * BLOCK, turn
    assert repeat["service_stats"]["during_run"]["blocks_committed"] == 0


def test_cache_only_reports_a_planted_wrong_block(stack, tmp_path):
    _, address, _, _ = stack
    conversation = Conversation("planted", ((Role.USER, "The cache must never serve wrong KV. " * 12),))
    source = tmp_path / "planted.jsonl"
    source.write_text(
        json.dumps(
            {
                "id": conversation.id,
                "messages": [{"role": role.value, "content": text} for role, text in conversation.messages],
            }
        )
        + "\n"
    )
    tokens = ChatTokens().tokens(conversation.messages)
    layout = preset("tiny").layout(BLOCK)
    blocks = len(tokens) // BLOCK
    kv = SyntheticKV(layout).blocks(tokens, 0, blocks)
    kv.view(torch.uint8).reshape(blocks, -1)[blocks - 1, 100] ^= 0xFF  # one flipped byte in the last block
    with CacheClient(address, timeout_s=10) as client:
        client.attach("replay-synthetic-tiny", layout, revision="synthetic-v1")
        assert client.store(tokens, kv).stored == blocks
    out = tmp_path / "planted.json"
    done = _replay("--cache", address, "--dataset", str(source), "--conversations", "1", "--json", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "KV check: 1 corrupt" in done.stdout
    report = _valid_report(out)
    assert report["cache_only"]["corrupt_blocks"] == 1
    assert report["cache_only"]["verified_blocks"] == blocks
    assert report["turns"][0]["error"] == "corrupt KV: 1 block(s) differ"


def test_replay_rejects_bad_input_with_a_named_problem(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "robot", "content": "hi"}]}\n')
    cases = [
        (["--cache", "127.0.0.1:9", "--dataset", str(bad)], "bad.jsonl:1: messages[0].role 'robot' is not one of"),
        (["--cache", "127.0.0.1:9", "--compare-no-cache", "http://127.0.0.1:9"], "--compare-no-cache needs --target"),
        (["--target", "http://127.0.0.1:9", "--rate", "0"], "rate must be > 0"),
        (["--target", "http://127.0.0.1:9", "--dataset", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--target", "http://127.0.0.1:9", "--conversations", "1"], "cannot list the models at http://127.0.0.1:9"),
    ]
    for args, problem in cases:
        assert cli.main(["replay", "--no-progress", *args]) == 2, args
        assert problem in capsys.readouterr().err, args


# --- the invariants the end-to-end checks rest on (fast, in process) ---------------------------


def test_synthetic_kv_depends_on_the_whole_prefix_and_nothing_else():
    kv = SyntheticKV(preset("tiny").layout(BLOCK))
    a = list(range(64))
    b = a[:32] + [7] + a[33:]  # differs in block 2 only
    ka, kb = kv.blocks(a, 0, 4), kv.blocks(b, 0, 4)
    assert torch.equal(ka.view(torch.uint8), kv.blocks(a, 0, 4).view(torch.uint8))  # deterministic
    same = (ka.view(torch.uint8).reshape(4, -1) == kb.view(torch.uint8).reshape(4, -1)).all(dim=1).tolist()
    assert same == [True, True, False, False]  # blocks from the change on differ, earlier ones do not
    assert torch.equal(kv.blocks(a, 2, 2).view(torch.uint8), ka[2:].view(torch.uint8))
    tiles = ka.view(torch.uint8).reshape(4, -1)
    assert not torch.equal(tiles[0, :4096], tiles[0, 4096:8192])  # a 4 KiB shift is caught


def test_prompt_tokens_match_the_worker_template_and_extend_turn_by_turn():
    from prefixcache_services.replay.turns import conversation_turns
    from prefixcache_services.worker.chat import ChatMessage, ChatMLTemplate
    from prefixcache_services.worker.chat import Role as ChatRole
    from prefixcache_services.worker.tokenizer import TiktokenTokenizer

    conv = Conversation(
        "c",
        (
            (Role.SYSTEM, "Be brief."),
            (Role.USER, "Hello\nthere"),
            (Role.ASSISTANT, "Hi! <|im_end|> fake"),
            (Role.USER, "What is a KV cache?"),
        ),
    )
    counter = ChatTokens()
    template = ChatMLTemplate(TiktokenTokenizer())
    turns = conversation_turns(conv, counter.count)
    ids = [counter.tokens(t.messages) for t in turns]
    for turn, got in zip(turns, ids):
        assert got == template.render([ChatMessage(ChatRole(r.value), c) for r, c in turn.messages])
        assert turn.prompt_tokens == len(got)
    assert ids[1][: len(ids[0])] == ids[0] and len(ids[1]) > len(ids[0])
