"""The chaos soak in CI: benchmarks/chaos_soak.py for 75 s of load (its default), as a subprocess.

It starts redis-server, the cache service and two workers, replays ShareGPT at a steady rate
while Redis is paused, SIGKILLed and the service restarted, and exits 0 only when every
check passed: no failed request, no output differing from the no-cache worker, hit rate
recovering after each fault, no lease left, flat RSS, a bounded and drained Redis queue. The
checks themselves (benchmarks/chaos_checks.py) are tested first on hand-made timelines, so a
soak that passes is known to be judged by checks that can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos_checks import (
    Fault,
    Request,
    Sample,
    check_memory,
    check_outputs,
    check_queue,
    check_recovery,
    hit_rate,
)

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent
SOAK_TIMEOUT_S = 600  # 75 s of load, 60 s of drain at most, process start-up on a busy box


def _request(start: float, turn: int = 1, cached: int = 50, text: str = "x", error: str | None = None) -> Request:
    return Request(f"c{start}", turn, start, 100, cached, text, error)


def test_hit_rate_counts_only_later_turns_that_succeeded():
    requests = [
        _request(1.0, cached=80),
        _request(2.0, turn=0, cached=0),
        _request(3.0, cached=20),
        _request(4.0, cached=100, error="boom"),
        _request(9.0, cached=100),
    ]
    assert hit_rate(requests, 0.0, 5.0) == (0.5, 2)


def test_recovery_is_the_first_window_back_at_half_the_baseline():
    fault = Fault("redis_kill", 10.0, 12.0)
    before = [_request(t, cached=60) for t in (2.0, 4.0, 6.0, 8.0)]
    dip = [_request(t, cached=0) for t in (12.5, 13.0, 14.0, 15.0)]
    back = [_request(t, cached=60) for t in (18.0, 19.0, 20.0, 21.0)]
    check, baseline, times = check_recovery(before + dip + back, [fault], warm_s=0.0, load_end_s=30.0)
    assert check.ok and baseline == 0.4
    assert times == [8.0]  # the window [14, 20): 2 of its 4 requests hit 60 tokens, 30% >= half of 40%
    never = check_recovery(before + dip, [fault], warm_s=0.0, load_end_s=30.0)[0]
    assert not never.ok and "NOT recovered" in never.detail


def test_memory_check_ignores_a_restarted_service_until_it_is_warm():
    mib = 2**20
    samples = [Sample(t, 300 * mib, 500 * mib + t * mib // 10, 0.0, 0, service_age_s=t) for t in range(0, 31)]
    samples += [Sample(t, 100 * mib, 503 * mib, 0.0, 0, service_age_s=t - 31) for t in range(31, 36)]  # starting up
    samples += [Sample(t, 302 * mib, 503 * mib, 0.0, 0, service_age_s=t - 31) for t in range(36, 61)]
    service, worker = check_memory(samples, warm_s=5.0, end_s=60.0)
    assert service.ok and worker.ok
    grown = [Sample(t, 300 * mib, (500 + 2 * t) * mib, 0.0, 0, service_age_s=t) for t in range(0, 61)]
    assert not check_memory(grown, warm_s=5.0, end_s=60.0)[1].ok


def test_queue_and_output_checks_fail_when_they_should():
    assert not check_queue([Sample(1.0, None, None, 10.0, 0)], bound_bytes=5, final_bytes=0.0).ok
    assert not check_queue([Sample(1.0, None, None, 1.0, 0)], bound_bytes=5, final_bytes=3.0).ok
    assert check_queue([Sample(1.0, None, None, 1.0, 0)], bound_bytes=5, final_bytes=0.0).ok
    a, b = (
        [_request(1.0, text="same"), _request(2.0, text="one")],
        [_request(1.0, text="same"), _request(2.0, text="two")],
    )
    assert not check_outputs(a, b).ok and check_outputs(a[:1], b[:1]).ok


def test_short_chaos_soak(tmp_path: Path):
    report = tmp_path / "soak.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "chaos_soak.py"),
        "--workdir",
        str(tmp_path / "work"),
        "--json-out",
        str(report),
    ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT_S,
    )
    print(done.stdout[-4000:])
    assert report.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(report.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed and done.returncode == 0, failed
    kinds = [fault["kind"] for fault in result["figures"]["faults"]]
    assert kinds[:2] == ["redis_pause", "redis_kill"] and kinds[2].startswith("service_"), kinds
    assert result["figures"]["requests"] >= 30
