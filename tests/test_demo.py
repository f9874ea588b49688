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
    # Every process it started is gone once it has exited.
    pids = [int(pid) for pid in re.findall(r"started [\w-]+ \(pid (\d+)\)", done.stderr)]
    assert len(pids) == 3, done.stderr
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert {p.name for p in logs.iterdir()} == {"cache-service.log", "worker-cache.log", "worker-no-cache.log"}
    assert "stopped" in (logs / "cache-service.log").read_text()  # drained on SIGTERM, not killed
