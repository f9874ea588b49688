"""`prefixcache demo` as a user runs it: real subprocesses, ShareGPT, the output check, clean exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from prefixcache_services.replay.report import load_schema

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent


def test_demo_replays_sharegpt_and_passes_the_output_check(tmp_path):
    out = tmp_path / "demo.json"
    logs = tmp_path / "logs"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixcache_services",
            "demo",
            "--conversations",
            "2",
            "--no-progress",
            "--json",
            str(out),
            "--log-dir",
            str(logs),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "output check: 0 mismatches" in done.stdout and "[PASS]" in done.stdout
    assert "prefill saved:" in done.stdout and "TTFT p50:" in done.stdout
    report = json.loads(out.read_text())
    jsonschema.validate(report, load_schema())
    assert report["workload"]["conversations"] == 2 and report["comparison"]["mismatches"] == 0
    assert report["cache_run"]["prefill_tokens_saved"] > 0  # the first ShareGPT chat has 4 turns
    # The use case's shape: a shared system prompt of ~1k tokens before both conversations (the
    # second one's first turn hits it), each turn sent to both workers back to back.
    workload = report["workload"]
    assert 500 <= workload["system_prompt_tokens"] <= 1500 and workload["system_prompt_share"] == 0.75
    assert report["interleaved"] is True
    first_turns = [t for t in report["turns"] if t["turn_index"] == 0]
    assert [t["cached_tokens"] >= workload["system_prompt_tokens"] // 16 * 16 for t in first_turns] == [False, True]
    # The headline states the paired figures: TTFT by class, after the first token, throughput.
    paired = report["paired"]
    hits, misses = paired["hits"]["requests"], paired["misses"]["requests"]
    assert hits == report["workload"]["requests"] - 1 and misses == 1  # only the very first turn misses
    headline = " ".join(done.stdout.split())  # rich wraps long lines
    expected = (
        f"TTFT {paired['hits']['ttft_ratio_p50']:.2f}x on {hits} hits, "
        f"{paired['misses']['ttft_ratio_p50']:.2f}x on {misses} misses"
    )
    assert expected in headline, headline
    assert f"throughput {paired['throughput_ratio']:.2f}x of no-cache's" in headline
    assert paired["hits"]["after_first_token_ratio_p50"] is not None
    # Every process it started is gone once it has exited.
    pids = [int(pid) for pid in re.findall(r"started [\w-]+ \(pid (\d+)\)", done.stderr)]
    assert len(pids) == 3, done.stderr
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert {p.name for p in logs.iterdir()} == {"cache-service.log", "worker-cache.log", "worker-no-cache.log"}
    assert "stopped" in (logs / "cache-service.log").read_text()  # drained on SIGTERM, not killed
