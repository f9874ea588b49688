"""Every CPU-runnable script in benchmarks/ runs end to end, at its smallest settings, in CI.

Nothing else runs them, so they rotted silently: service_bench.py kept slicing a `TensorPool`
long after pools stopped supporting it. Each test runs one script as a subprocess, the way its
docstring says to (its own flags, PYTHONPATH at the repo root), and asserts that it exits 0 and
that the report it writes or prints has the expected keys and rows, with positive figures. The
figures themselves are not judged: at these sizes they are noise. `LEFT_OUT` names the scripts
that do not run here and why; a new script must be added to one list or the other.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import lifetime

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPT_TIMEOUT_S = 240  # each script takes 1-20 s here; a loaded CI box may be several times slower

COVERED = {
    "disk_bench.py",
    "fleet_bench.py",
    "arena_bench.py",
    "gpu_check.py",
    "index_bench.py",
    "kv_dtype_bench.py",
    "prefill_memory_bench.py",
    "redis_bench.py",
    "redis_frame_bench.py",
    "redis_slow_link.py",
    "rpc_per_request.py",
    "service_bench.py",
    "ttft_bench.py",
}
LEFT_OUT = {
    "chaos_checks.py": "a library of the soak's checks, tested in tests/test_chaos_short.py",
    "chaos_soak.py": "run (75 s of load) by tests/test_chaos_short.py",
    "service_process.py": "a helper, not a script: every service-starting benchmark here uses it",
    "stream_result.py": "a helper, not a script: the fleet benchmarks' stream timing (run by test_fleet_bench)",
    "peer_adapter.py": "needs ../shared/peers and its venvs, which a clean clone lacks",
    "redis_peer_bench.py": "needs ../shared/peers and its venvs, which a clean clone lacks",
    "vllm_ttft_bench.py": "needs vLLM (the .venv-vllm environment), not installed by the test extras",
    "vllm_scheduler_cost.py": "needs vLLM (the .venv-vllm environment), not installed by the test extras",
    "vllm_fleet_bench.py": "needs vLLM (the .venv-vllm environment), not installed by the test extras",
    "vllm_copy_cost.py": "needs vLLM's package to import the connector; run by tests/vllm_e2e/test_vllm_units.py",
}


def run_script(
    name: str, *args: str, env: dict[str, str] | None = None, exit_codes: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/`name` with `args` from the repo root, and assert it exited with one of `exit_codes`.

    The script runs in a session of its own, so a timeout kills the services and redis-servers
    it started too, not just the script."""
    process = lifetime.popen(
        [sys.executable, str(BENCHMARKS / name), *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{name} ran past {SCRIPT_TIMEOUT_S}s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert process.returncode in exit_codes, f"{name} exited {process.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_json(name: str, tmp_path: Path, *args: str) -> Any:
    """Run a script that takes `--json-out FILE`; the report it wrote."""
    report = tmp_path / f"{Path(name).stem}.json"
    run_script(name, *args, "--json-out", str(report))
    return json.loads(report.read_text())


def assert_positive(figures: dict[str, Any], *keys: str) -> None:
    """Each of `keys` is in `figures` and a finite number above zero."""
    missing = [key for key in keys if key not in figures]
    assert not missing, f"missing {missing} in {figures}"
    bad = {
        key: figures[key]
        for key in keys
        if isinstance(figures[key], bool)
        or not isinstance(figures[key], int | float)
        or not (math.isfinite(figures[key]) and figures[key] > 0)
    }
    assert not bad, f"not positive: {bad}"


def test_every_script_is_run_or_left_out_for_a_reason() -> None:
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    assert not COVERED & LEFT_OUT.keys()
    assert scripts == COVERED | LEFT_OUT.keys(), "add the script to COVERED (with a test) or to LEFT_OUT"


def test_arena_bench() -> None:
    # This tree only: no --baseline-tree.
    stdout = run_script("arena_bench.py", "--repeats", "20", "--rounds", "1").stdout
    report = json.loads(stdout.strip().splitlines()[-1])
    figures = [
        "lookup_8k_us",
        "commit_64_blocks_us",
        "commit_64_blocks_other_layout_us",
        "commit_64_blocks_other_layout_max_us",
        "chunk_bytes",
    ]
    assert set(report) == {"machine", "cpus", "after"}, report
    assert_positive(report["after"], *figures)
    table = [line.split()[0] for line in stdout.splitlines()[1:-1]]
    assert table == figures, stdout


def test_gpu_check_without_cuda() -> None:
    # Its checks need CUDA (and about a minute on an H100); with CUDA hidden it still imports
    # everything it would use and takes its no-GPU exit, on every machine alike.
    stdout = run_script("gpu_check.py", env={"CUDA_VISIBLE_DEVICES": ""}).stdout
    assert "no CUDA device here; nothing to check (exit 0)" in stdout, stdout


def test_index_bench(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    stdout = run_script("index_bench.py", "--conversations", "1", "--repeats", "20", "--update-docs", str(docs)).stdout
    report = json.loads(stdout[stdout.index("\n{") + 1 :])  # the table, then the JSON
    assert report["config"]["requests"] > 0
    for variant in ("u32_array", "int64_array", "python_list", "with_lease_and_release", "miss_u32_array"):
        assert_positive(report["full_hit_8k"][variant], "p50_us", "p99_us", "min_us", "cpu_p50_us")
    for algorithm in ("xxh3_128", "sha256"):
        assert_positive(report["hashing"][algorithm], "p50_us_per_8k_prompt", "mb_per_s", "blocks_per_s")
    for run in ("chat", "chat_commit", "chat_evicting"):
        for stage in ("lookup", "insert"):
            assert_positive(report[run][stage], "n", "p50_us", "p99_us", "p50_us_per_1k_tokens")
        assert_positive(report[run], "token_hit_rate", "blocks")
    assert_positive(report["metadata"], "cached_blocks", "tracemalloc_bytes_per_cached_block")
    assert "## Index (benchmarks/index_bench.py)" in docs.read_text()


def test_kv_dtype_bench(tmp_path: Path) -> None:
    report = run_json("kv_dtype_bench.py", tmp_path, "--tokens", "64", "--repeats", "1")
    assert [(row["layout"], row["dtype"]) for row in report["capacity"]] == [
        (layout, dtype) for layout in ("Llama-3-8B", "tiny") for dtype in ("bfloat16", "float8_e4m3fn")
    ]
    for row in report["capacity"]:
        assert_positive(row, "bytes_per_token", "block_bytes", "blocks_per_GiB", "tokens_per_GiB")
    assert [row["dtype"] for row in report["moved"]] == ["bfloat16", "float8_e4m3fn"]
    for row in report["moved"]:
        assert row["tokens"] == 64
        assert_positive(row, "bytes", "store_ms", "fetch_ms", "shm_read_ms")
    assert report["moved"][0]["bytes"] == 2 * report["moved"][1]["bytes"]  # fp8 halves the bytes


def test_prefill_memory_bench(tmp_path: Path) -> None:
    report = run_json("prefill_memory_bench.py", tmp_path, "--lengths", "1")  # three model-loading children: ~17 s
    assert [(r["mode"], r["prefill_buckets"]) for r in report["results"]] == [
        ("buckets", True),
        ("unpadded", False),
        ("no_onednn", False),
    ]
    for result in report["results"]:
        assert_positive(result, "warm_rss_mib")
        for name in ("pass1", "pass2"):
            assert result[name]["lengths_run"] == 1 and result[name]["new_lengths_run"] == 1, result
            assert_positive(result[name], "prefill_seconds")
            assert isinstance(result[name]["rss_growth_mib"], float)  # may be 0 or negative: not judged


def test_redis_bench(tmp_path: Path) -> None:
    # It starts its own redis-server (tests/support/redis_server.py) and FLUSHALLs it, so no shared one.
    args = ("--total-mib", "4", "--batch", "2", "--repeats", "1", "--warmup", "0", "--chunk-mib", "2")
    report = run_json("redis_bench.py", tmp_path, *args)
    assert [row["block"] for row in report["rows"]] == ["64KiB", "2MiB"]
    for row in report["rows"]:
        assert_positive(
            row,
            *("blocks", "plain_put_seq", "plain_put_pipe", "tier_put", "tier_writer"),
            *("plain_get_seq", "plain_get_pipe", "tier_get", "encode_us_per_block"),
            *("put_ratio", "writer_ratio", "get_ratio"),
        )


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_redis_frame_bench(tmp_path: Path, keyed: bool) -> None:
    args = ["--sizes", "64KiB,2MiB", "--threads", "1,2", "--blocks", "2", "--repeats", "1"]
    report = run_json("redis_frame_bench.py", tmp_path, *args, *(["--keyed"] if keyed else []))
    rows = report["rows"]
    assert [(r["block"], r["threads"], r["keyed"]) for r in rows] == [
        (size, threads, keyed) for size in ("64KiB", "2MiB") for threads in (1, 2)
    ]
    for row in rows:
        assert_positive(row, "encode_us", "encode_gbs", "decode_us", "decode_gbs")


@pytest.mark.parametrize("tls", [False, True])
def test_redis_slow_link(tmp_path: Path, tls: bool) -> None:
    args = ("--latency-ms", "20", "--blocks", "24", "--seconds", "20") + (("--tls",) if tls else ())  # 40 ms trips
    report = run_json("redis_slow_link.py", tmp_path, *args)
    assert report["tls"] is tls
    assert report["idle"] is True and report["keys_in_redis"] == 24
    assert report["bytes_written"] == report["bytes_queued"] == 24 * 16 * 1024
    assert report["writes_failed"] == report["write_deadlines"] == report["breaker_trips"] == 0
    assert report["write_set_s"] >= 0.04  # a round trip per SET, or pipelined (TLS) 16 KiB at 400 kB/s


def test_rpc_per_request(tmp_path: Path) -> None:
    args = ("--requests", "6", "--prompt-tokens", "64", "--suffix", "32", "--redis")  # written through to Redis
    report = run_json("rpc_per_request.py", tmp_path, *args)
    assert report.pop("shared_memory") is True
    modes = ["two_calls", "one_call", "returned", "socket"]
    assert list(report.pop("service_cpu_ms_per_request")) == modes
    redis_cpu = report.pop("redis_cpu_ms_per_request")
    assert list(redis_cpu) == modes and all(ms >= 0 for ms in redis_cpu.values())
    assert list(report.pop("client_cpu_ms_per_request")) == modes
    without = report.pop("stores_without_reserve")  # the one-call client's store after the prefix's found its spare
    assert list(without) == modes and without["two_calls"] == 0 and without["one_call"] > 0
    assert list(report["two_calls"]) == ["lookup", "read", "reserve", "write", "commit", "release"]
    assert list(report["one_call"]) == ["lookup", "read", "store", "release"]
    assert list(report["returned"]) == ["lookup", "read", "store"]  # the lease went back with a Lookup
    assert list(report["socket"]) == ["lookup", "read", "store"]  # the same over the control socket
    for stages in report.values():
        for stage in stages.values():
            assert_positive(stage, "mean_ms", "p50_ms")


def test_service_bench(tmp_path: Path) -> None:
    # Its 8k-token prompt (1 GiB of KV) and the load processes' 3 s start are fixed: ~12 s at best.
    args = ("--fetch-mib", "4", "--seconds", "0.5", "--calls", "20", "--processes", "1", "--in-flight", "1")
    report = run_json("service_bench.py", tmp_path, *args)
    for latency in ("lookup_latency_2k", "lookup_latency_8k"):
        assert_positive(report[latency], "p50_ms", "p99_ms", "mean_ms")
    throughput = report["lookup_throughput_2k"]
    assert throughput["clients"] == 1 and throughput["processes"] == 1
    assert_positive(throughput, "rpc_per_s", "service_cpu_us_per_call", "service_cores_used")
    assert report["fetch"]["bytes"] == 4 << 20
    assert_positive(report["fetch"], "shm_GBps", "memcpy_GBps", "shm_vs_memcpy", "stream_GBps")
    assert_positive(report["fetch"], "shm_engine_blocks_of_2_GBps", "engine_blocks_of_2_vs_1")


def test_ttft_bench(tmp_path: Path) -> None:
    # 1024 tokens: below ~512 the hit policy (rightly) declines the hit or the saving misses its target.
    report_path = tmp_path / "ttft.json"
    args = ("--sizes", "1024", "--suffix", "64", "--repeats", "1", "--json-out", str(report_path))
    done = run_script("ttft_bench.py", *args, exit_codes=(0, 1))  # 1: the saving target missed (see below)
    assert report_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]  # written last, whatever the saving
    report = json.loads(report_path.read_text())
    (result,) = report["results"]
    assert (result["prompt_tokens"], result["cached_tokens"], result["computed_tokens"]) == (1024, 960, 64)
    for timings in (result["ttft_ms"], result["ttft_ms_median"]):
        assert_positive(timings, "no_cache", "cached", "ideal")
    assert_positive(result, "speedup")
    assert_positive(result["cached_breakdown_ms"], "lookup", "shm_read", "release", "kv_install", "suffix_prefill")
    # A missed saving target is the benchmark's verdict (noise at one repeat on a shared box), not rot;
    # but the exit status must say exactly that.
    missed = not result["saving_ratio"] >= report["target_saving_ratio"]
    assert done.returncode == int(missed), (done.returncode, result["saving_ratio"])


def test_disk_bench(tmp_path: Path) -> None:
    # 16 MiB per measurement into a directory of the test's: raw O_DIRECT, the tier at 64 KiB and 2 MiB.
    done = run_script("disk_bench.py", "--dir", str(tmp_path / "disk"), "--total", "16MiB")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"raw_odirect_8MiB", "tier_64KiB", "tier_2048KiB"}
    for figures in results.values():
        assert_positive(figures, "put_GBps", "get_GBps")


def test_fleet_bench(tmp_path: Path) -> None:
    # Three configurations, four requests each: two worker pairs start (~1 min on a 2-core box).
    report_path = tmp_path / "fleet.json"
    args = ("--conversations", "2", "--turns", "2", "--users", "2", "--system-words", "40", "--user-words", "12")
    args += ("--max-tokens", "2", "--think-ms", "100", "--json-out", str(report_path))
    done = run_script("fleet_bench.py", *args, exit_codes=(0, 1))  # 1: a target missed (noise at this size)
    report = json.loads(report_path.read_text())
    rows = {row["config"]: row for row in report["rows"]}
    assert list(rows) == ["rr-nocache", "rr-cache", "router"]
    for row in rows.values():
        assert row["requests"] == 4 and row["errors"] == [], row
        assert_positive(row["ttft_ms"], "p50", "p99")
        assert_positive(row, "requests_per_s", "prompt_tokens_per_s")
        assert sum(row["requests_per_engine"].values()) == 4
    assert rows["rr-nocache"]["hit_share"] == 0.0
    assert_positive(rows["router"]["prediction"], "predicted_median_ms", "observed_median_ms")
    verdict = report["verdict"]
    missed = not (verdict["p50_target_met"] and verdict["prediction_target_met"])
    assert done.returncode == int(missed), (done.returncode, verdict)
    assert "| router: prefixcache route + prefixcache |" in done.stdout
