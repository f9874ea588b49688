"""The operator CLI (`stats`, `top`, `inspect`, `evict`, `flush`) as subprocesses against a real stack.

One module-wide stack: a real redis-server (the Redis tier), `prefixcache serve` with a bearer
token and the Prometheus exporter, and a real `prefixcache worker` (tiny model). The cache is
populated through `CacheClient` with the tiny model's KV layout, so the worker and the test
share one cache. Assertions are on `--json` documents, exit codes and stderr; `top` runs in a
pseudo-terminal; the metrics endpoint is parsed with the Prometheus text parser and the Grafana
dashboard is checked against the names it really exports.

Independent CLI runs are started together (`run_many`): each one imports torch, which is most
of its cost.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import queue
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache_services.admin.document import stats_document
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "cli-test-token-0123456789abcdef"
SALT = "salt-SECRET-4242"
LAYOUT = KVLayout(4, 2, 32, 16, "bfloat16")  # the tiny worker's layout: the first Attach fixes it
BLOCK = LAYOUT.block_size
PROMPT_A = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 full blocks + 5 trailing tokens
PROMPT_B = list(range(3000, 3000 + 6 * BLOCK))
UNCACHED = list(range(7000, 7000 + 4 * BLOCK))
CHAT_MESSAGE = "Summarise the plot of a long novel about a prefix cache that remembers every prompt it saw."
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Stack:
    address: str
    metrics_port: int
    worker_port: int
    worker: subprocess.Popen


@dataclass(frozen=True)
class Populated:
    client: CacheClient
    namespace_id: str
    lease: object


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120", PREFIXCACHE_AUTH_TOKEN=TOKEN)
    env.update(extra)
    return env


def run_many(*commands: list[str], env: dict | None = None, stdin: str | None = None) -> list[Result]:
    """Run `python -m prefixcache_services ARGS...` for each command at once; results in order."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "prefixcache_services", *args],
            cwd=ROOT,
            env=env or _env(),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    for process in processes:
        out, err = process.communicate(stdin, timeout=DEADLINE_S)
        results.append(Result(process.returncode, out, err))
    return results


def run(*args: str, env: dict | None = None) -> Result:
    return run_many(list(args), env=env)[0]


@pytest.fixture
def cli(capsys, monkeypatch):
    """The CLI in this process, for variants where a process boundary adds nothing: (code, out, err)."""
    from prefixcache_services.cli import main

    monkeypatch.setenv("PREFIXCACHE_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("COLUMNS", "120")

    def invoke(*argv: str) -> Result:
        try:
            code = main(list(argv))
        except SystemExit as done:  # argparse: --help and usage errors
            code = done.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return invoke


def _read_until(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def _start_service(redis_url: str) -> tuple[subprocess.Popen, str, int]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache_services",
            "--log-level",
            "WARNING",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--host-capacity",
            "2MiB",
            "--metrics-port",
            "0",
            "--auth-token",
            TOKEN,
            "--redis-url",
            redis_url,
            "--redis-key-prefix",
            f"clitest{os.getpid()}",
            "--workers",
            "8",
            "--grace",
            "2s",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_until, args=(process.stdout, lines), daemon=True).start()
    address = metrics = None
    deadline = time.monotonic() + DEADLINE_S
    while (address is None or metrics is None) and time.monotonic() < deadline:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if line is None:
            break
        if line.startswith("prefixcache serve: listening on "):
            address = line.rsplit(" ", 1)[1].strip()
        elif line.startswith("prefixcache serve: metrics on port "):
            metrics = int(line.rsplit(" ", 1)[1])
    if address is None or metrics is None:
        process.kill()
        pytest.fail("the cache service did not report readiness")
    return process, address, metrics


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture(scope="module")
def stack(redis_server):
    service, address, metrics_port = _start_service(redis_server.url)
    worker_port = free_port()
    # Started now, waited for later: it loads the model while the first tests run.
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixcache_services",
            "--log-level",
            "WARNING",
            "worker",
            "--cache",
            address,
            "--listen",
            f"127.0.0.1:{worker_port}",
            "--threads",
            "1",
            "--cache-deadline-ms",
            "5000",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield Stack(address, metrics_port, worker_port, worker)
    worker.kill()  # its shutdown is not under test here; the service's is (it unlinks shared memory)
    worker.wait(10)
    _stop(service)


def _kv(blocks: int) -> torch.Tensor:
    return torch.randn((blocks, *LAYOUT.block_shape)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def populated(stack):
    """Two stored prompts and a known set of lookups; one lease held (on PROMPT_B)."""
    client = CacheClient(stack.address, auth_token=TOKEN, timeout_s=10)
    attachment = client.attach("cli-test-model", LAYOUT, revision="r1", same_host=False)
    assert client.store(PROMPT_A, _kv(8)).stored == 8
    assert client.store(PROMPT_B, _kv(6)).stored == 6
    assert client.lookup(PROMPT_A, take_lease=False).hit_tokens == 8 * BLOCK
    changed = PROMPT_A[: 3 * BLOCK + 2] + [5] + PROMPT_A[3 * BLOCK + 3 :]
    assert client.lookup(changed, take_lease=False).hit_tokens == 3 * BLOCK
    assert client.lookup(UNCACHED, take_lease=False).hit_tokens == 0
    assert client.lookup(PROMPT_A, cache_salt=SALT, take_lease=False).hit_tokens == 0
    lease = client.lookup(PROMPT_B, take_lease=True)
    assert lease.hit_tokens == 6 * BLOCK
    yield Populated(client, attachment.namespace_id, lease)
    client.close()


def _stats(populated: Populated) -> dict:
    """The stats document, read in-process (the CLI's own output is checked in the stats test)."""
    return stats_document(populated.client.stats(), populated.client.address)


def _one_line_error(result: Result, *needles: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("prefixcache ") and ": error: " in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- stats -----------------------------------------------------------------------------------------
def test_stats_json_reports_exactly_what_was_done(stack, populated, cli):
    result = run("stats", "--cache", stack.address, "--json")
    assert result.returncode == 0, result.stderr
    doc = result.json()
    assert doc["schema_version"] == 1 and doc["ready"] and doc["address"] == stack.address
    assert doc["layout"] == {
        "layers": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "block_size": 16,
        "dtype": "bfloat16",
        "block_bytes": LAYOUT.block_bytes,
        "bytes_per_token": LAYOUT.bytes_per_token,
    }
    assert doc["requests"] == {"lookups": 5, "hits": 3, "misses": 2, "hit_rate": 3 / 5}
    hit_blocks = 8 + 3 + 6
    assert doc["blocks"]["hits"] == hit_blocks and doc["blocks"]["committed"] == 14
    assert doc["tokens"]["saved"] == doc["tokens"]["hits"] == hit_blocks * BLOCK
    assert doc["tokens"]["looked_up"] == 3 * len(PROMPT_A) + len(UNCACHED) + len(PROMPT_B)
    assert doc["tiers"]["host"] == {
        "blocks": 14,
        "bytes_used": 14 * LAYOUT.block_bytes,
        "capacity_bytes": 2 << 20,
        "utilization": 14 * LAYOUT.block_bytes / (2 << 20),
    }
    assert set(doc["tiers"]) == {"host"}  # no device tier on this machine; Redis is reported apart
    assert doc["miss_reasons"] == {"shorter_than_block": 0, "not_cached": 3, "expired": 0, "verification_failed": 0}
    assert doc["evictions"] == {
        "total": 0,
        "by_reason": {"lru": 0, "ttl": 0, "capacity": 0, "manual": 0},
        "by_tier": {},
    }
    assert doc["redis"]["configured"] and doc["redis"]["state"] == "up" and doc["redis"]["up"] is True
    assert doc["active_leases"] == 1 and doc["uptime_seconds"] > 0
    table = cli("stats", "--cache", stack.address)
    assert table.returncode == 0, table.stderr
    for needle in ("hit rate: tokens", "60.0%  (3 hit / 2 miss)", "host", "not cached", "redis tier", "up"):
        assert needle in table.stdout, table.stdout


# -- namespaces -------------------------------------------------------------------------------------
def test_namespaces_lists_ids_models_and_resident_blocks(stack, populated, cli):
    result = run("namespaces", "--cache", stack.address, "--json")
    assert result.returncode == 0, result.stderr
    doc = result.json()
    assert doc["schema_version"] == 1 and doc["block_bytes"] == LAYOUT.block_bytes
    listed = {entry["namespace_id"]: entry for entry in doc["namespaces"]}
    mine = listed[populated.namespace_id]
    assert mine == {
        "namespace_id": populated.namespace_id,
        "model": "cli-test-model",
        "revision": "r1",
        "salted": False,
        "tenant": None,
        "kv_scale": "",
        "engine_block_sizes": [BLOCK],
        "blocks": {"host": 14},
        "bytes": 14 * LAYOUT.block_bytes,
    }
    salted = [entry for entry in doc["namespaces"] if entry["salted"]]
    assert len(salted) == 1 and salted[0]["model"] == "cli-test-model" and salted[0]["blocks"] == {}
    assert SALT not in result.stdout
    table = cli("namespaces", "--cache", stack.address)
    assert table.returncode == 0, table.stderr
    for needle in (populated.namespace_id, "cli-test-model", "r1", "14", "yes"):
        assert needle in table.stdout, table.stdout


# -- inspect ----------------------------------------------------------------------------------------
def test_inspect_shows_each_cached_block_and_why_the_next_one_missed(stack, populated, tmp_path, cli):
    as_json = tmp_path / "a.json"
    as_json.write_text(json.dumps(PROMPT_A[: 6 * BLOCK] + [9, 9] + PROMPT_A[6 * BLOCK + 2 :]))
    ns = ["--namespace", populated.namespace_id, "--cache", stack.address]
    result = run("inspect", *ns, "--tokens-file", str(as_json), "--json")
    assert result.returncode == 0, result.stderr
    doc = result.json()
    assert doc["namespace_id"] == populated.namespace_id
    assert (doc["prompt_tokens"], doc["full_blocks"], doc["trailing_tokens"]) == (len(PROMPT_A), 8, 5)
    assert doc["hit_blocks"] == 6 and doc["hit_tokens"] == 6 * BLOCK and doc["disk_blocks"] == 0
    assert [b["block"] for b in doc["blocks"]] == list(range(6))
    for block in doc["blocks"]:
        assert block["tier"] == "host" and not block["leased"]
        assert 0 < block["ttl_left_seconds"] <= 300 and 0 <= block["last_access_age_seconds"] < 120
    assert doc["first_miss"]["block"] == 6 and doc["first_miss"]["reason"] == "not_cached"
    assert (doc["first_miss"]["first_token"], doc["first_miss"]["end_token"]) == (96, 112)
    table = cli("inspect", *ns, "--tokens-file", str(as_json))
    assert "first miss: block 6 (tokens 96-111): not_cached" in table.stdout, table.stdout
    for row in range(6):
        assert re.search(rf"\b{row}[\s│]+{row * BLOCK}-{row * BLOCK + BLOCK - 1}[\s│]+host\b", table.stdout), (
            table.stdout
        )
    as_text = tmp_path / "a.txt"
    as_text.write_text(" ".join(map(str, PROMPT_A)))
    full = json.loads(cli("inspect", *ns, "--tokens-file", str(as_text), "--json").stdout)
    assert full["hit_blocks"] == 8 and full["first_miss"] is None
    salted = json.loads(cli("inspect", *ns, "--tokens-file", str(as_text), "--cache-salt", SALT, "--json").stdout)
    assert salted["hit_blocks"] == 0 and salted["first_miss"]["reason"] == "not_cached"


def test_match_reports_blocks_per_tier_and_changes_nothing(stack, populated, tmp_path, cli):
    as_json = tmp_path / "m.json"
    as_json.write_text(json.dumps(PROMPT_A[: 6 * BLOCK] + [9, 9] + PROMPT_A[6 * BLOCK + 2 :]))
    ns = ["--namespace", populated.namespace_id, "--cache", stack.address]
    before = populated.client.stats().snapshot
    answer = cli("match", *ns, "--tokens-file", str(as_json), "--json")
    assert answer.returncode == 0, answer
    doc = json.loads(answer.stdout)
    assert (doc["hit_blocks"], doc["hit_tokens"], doc["prompt_tokens"]) == (6, 6 * BLOCK, len(PROMPT_A))
    assert doc["tiers"] == {"device": 0, "host": 6} and doc["miss_reason"] == "not_cached"
    assert doc["redis_blocks"] == 6 and doc["disk_blocks"] == 0  # written through, within the Redis TTL
    after = populated.client.stats().snapshot
    assert (after.lookups, after.active_leases) == (before.lookups, before.active_leases)  # no count, no lease
    table = cli("match", *ns, "--tokens-file", str(as_json))
    assert re.search(r"0[\s│]+6[\s│]+6[\s│]+0[\s│]+96[\s│]+133[\s│]+not_cached", table.stdout), table.stdout
    salted = json.loads(cli("match", *ns, "--tokens-file", str(as_json), "--cache-salt", SALT, "--json").stdout)
    assert salted["hit_blocks"] == 0 and salted["tiers"] == {"device": 0, "host": 0}


# -- errors and help ----------------------------------------------------------------------------------
def test_connection_errors_are_one_line_with_exit_code_2(stack):
    dead = f"127.0.0.1:{free_port()}"
    bad_address, unreachable, wrong_token = run_many(
        ["stats", "--cache", "no-port-here"],
        ["stats", "--cache", dead, "--timeout", "3s"],
        ["evict", "--cache", stack.address, "--older-than", "1m", "--auth-token", "wrong-token-0123456789"],
    )
    _one_line_error(bad_address, "--cache: expected HOST:PORT", "'no-port-here'")
    _one_line_error(unreachable, f"cannot reach the cache service at {dead}")
    _one_line_error(wrong_token, "refused the call", "the token given was not accepted")
    assert "wrong-token" not in wrong_token.stderr  # the token is never echoed


@pytest.mark.parametrize("name", ["stats", "top", "inspect", "namespaces", "evict", "flush"])
def test_every_command_has_help_with_examples(cli, name):
    result = cli(name, "--help")
    assert result.returncode == 0
    assert f"prefixcache {name}" in result.stdout and "examples:" in result.stdout
    assert "--auth-token" in result.stdout and "--cache" in result.stdout


def test_bad_arguments_name_the_problem(stack, populated, cli, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 three")
    cases = [
        (["stats", "--cache", stack.address, "--auth-token", ""], "missing bearer token"),
        (["flush", "--cache", stack.address], "refusing to flush without confirmation: stdin is not a terminal"),
        (["evict", "--cache", stack.address], "give --namespace ID, --older-than DURATION"),
        (["evict", "--cache", stack.address, "--older-than", "5m", "--prefix-text", "x"], "cannot be combined"),
        (["evict", "--cache", stack.address, "--older-than", "soon"], "cannot parse duration 'soon'"),
        (["top", "--cache", stack.address, "--interval", "0"], "--interval: must be > 0"),
        (
            ["inspect", "--cache", stack.address, "--namespace", "feedfacefeedface", "--text", "hi"],
            "unknown namespace id; call Attach first",  # never the id itself (issue 33)
        ),
        (
            ["inspect", "--cache", stack.address, "--namespace", populated.namespace_id, "--tokens-file", str(bad)],
            "item 2 is 'three'",
        ),
        (["inspect", "--cache", stack.address, "--tokens-file", str(tmp_path / "absent.json")], "cannot read it"),
        (["stats", "--cache", stack.address, "--tls-ca", str(tmp_path / "absent.pem")], "--tls-ca: no such file"),
    ]
    for argv, needle in cases:
        result = cli(*argv)
        assert result.returncode == 2 and result.stdout == "", (argv, result)
        _one_line_error(result, needle)


# -- top ------------------------------------------------------------------------------------------------
def _pty_spawn(args: list[str], rows: int = 40, cols: int = 120) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.environ.update(_env(TERM="xterm-256color"))
        os.execv(sys.executable, [sys.executable, "-m", "prefixcache_services", *args])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return pid, fd


def _pty_read(fd: int, buffer: bytearray, until: bytes | re.Pattern, deadline_s: float = DEADLINE_S) -> bool:
    """Append the child's output to `buffer` until `until` appears (True) or EOF/deadline (False)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if until.search(buffer) if isinstance(until, re.Pattern) else until in buffer:
            return True
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                return False
            if not chunk:
                return False
            buffer.extend(chunk)
    return False


def _wait_exit(pid: int, fd: int, buffer: bytearray, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            os.close(fd)
            return os.waitstatus_to_exitcode(status)
        _pty_read(fd, buffer, b"\x00never\x00", 0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(fd)
    pytest.fail(f"the process did not exit: {bytes(buffer[-2000:])!r}")


def test_top_refreshes_in_a_terminal_shows_evictions_and_quits_on_q(stack, populated):
    pid, fd = _pty_spawn(["top", "--cache", stack.address, "--interval", "0.3", "--auth-token", TOKEN])
    plain = subprocess.Popen(
        [sys.executable, "-m", "prefixcache_services", "top", "--cache", stack.address, "--interval", "0.2"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    screen = bytearray()
    assert _pty_read(fd, screen, re.compile(rb"refresh #[2-9]")), bytes(screen[-2000:])
    for needle in (b"tier occupancy", b"lookups/s", b"hit rates", b"host", b"recent evictions"):
        assert needle in screen
    # A prefix evicts its last full block and everything cached below it: PROMPT_A's blocks 6 and 7.
    assert populated.client.evict(prefix_tokens=PROMPT_A[: 7 * BLOCK]) == 2
    assert _pty_read(fd, screen, re.compile(rb"host\s+manual\s+\+2")), bytes(screen[-3000:])
    os.write(fd, b"q")
    assert _wait_exit(pid, fd, screen) == 0
    assert b"\x1b[?1049l" in screen  # left the alternate screen: the terminal is restored
    out, err = plain.communicate(timeout=DEADLINE_S)
    assert plain.returncode == 0, err
    assert "stdout is not a terminal" in err and out.count("prefixcache top") == 1 and "tier occupancy" in out


def test_top_quits_cleanly_on_ctrl_c(stack, populated):
    pid, fd = _pty_spawn(["top", "--cache", stack.address, "--interval", "0.2"])
    screen = bytearray()
    assert _pty_read(fd, screen, b"refresh #2"), bytes(screen[-2000:])
    os.write(fd, b"\x03")  # the terminal turns it into SIGINT
    assert _wait_exit(pid, fd, screen) == 0
    assert b"Traceback" not in screen


# -- the worker's namespace ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker_request(stack):
    """One chat completion served by the real worker (which stores the prompt's blocks)."""
    url = f"http://127.0.0.1:{stack.worker_port}"
    deadline = time.monotonic() + 120
    while True:
        assert stack.worker.poll() is None, "the worker exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("the worker did not become ready")
            time.sleep(0.1)  # polling readiness with a bounded deadline
    body = json.dumps(
        {"messages": [{"role": "user", "content": CHAT_MESSAGE}], "max_tokens": 1, "temperature": 0}
    ).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_inspect_derives_the_worker_namespace_from_its_settings(stack, populated, worker_request):
    derived = run("inspect", "--cache", stack.address, "--text", CHAT_MESSAGE, "--chat", "--json")
    assert derived.returncode == 0, derived.stderr
    doc = derived.json()
    prompt_tokens = worker_request["usage"]["prompt_tokens"]
    assert doc["prompt_tokens"] == prompt_tokens  # same tokenizer and chat template as the worker
    assert doc["identity"]["model"] == "prefixcache-tiny-llama" and len(doc["identity"]["revision"]) == 64
    assert doc["namespace_id"] != populated.namespace_id
    assert doc["hit_blocks"] == prompt_tokens // BLOCK > 0  # the worker stored every full block
    assert doc["first_miss"] is None


# -- evict and flush -------------------------------------------------------------------------------------
def test_evict_by_prefix_age_and_namespace_shows_in_stats(stack, populated, tmp_path, cli):
    populated.client.release(populated.lease)
    before = _stats(populated)
    prefix = tmp_path / "prefix.json"
    prefix.write_text(json.dumps(PROMPT_B[: 3 * BLOCK]))
    ns = ["--cache", stack.address, "--namespace", populated.namespace_id]
    by_prefix = run("evict", *ns, "--prefix-tokens-file", str(prefix), "--json")
    assert by_prefix.returncode == 0, by_prefix.stderr
    assert by_prefix.json()["evicted"] == 4  # PROMPT_B's blocks 2..5: the prefix's last block and all below it
    by_age = cli("evict", "--cache", stack.address, "--older-than", "1h", "--json")
    assert by_age.returncode == 0 and json.loads(by_age.stdout)["evicted"] == 0  # all touched within the hour
    remaining_in_namespace = 14 - 2 - 4  # top's test evicted 2 of PROMPT_A
    by_namespace = cli("evict", *ns)
    assert by_namespace.stdout == f"evicted {remaining_in_namespace} block(s) from {stack.address}\n"
    after = _stats(populated)
    evicted = 4 + remaining_in_namespace
    assert after["evictions"]["by_reason"]["manual"] - before["evictions"]["by_reason"]["manual"] == evicted
    assert after["tiers"]["host"]["blocks"] == before["tiers"]["host"]["blocks"] - evicted
    assert after["active_leases"] == 0


def test_flush_asks_on_a_terminal_and_empties_the_cache_with_yes(stack, populated):
    pid, fd = _pty_spawn(["flush", "--cache", stack.address])
    screen = bytearray()
    assert _pty_read(fd, screen, b"[y/N]"), bytes(screen)
    os.write(fd, b"n\n")
    assert _wait_exit(pid, fd, screen) == 1  # declined: nothing flushed
    before = _stats(populated)
    resident = before["tiers"]["host"]["blocks"]
    assert resident > 0  # the worker's blocks are still there
    flushed = run("flush", "--cache", stack.address, "--yes", "--json")
    assert flushed.returncode == 0, flushed.stderr
    assert flushed.json()["evicted"] >= resident  # host blocks, plus any copies in Redis
    after = _stats(populated)
    assert after["tiers"]["host"]["blocks"] == 0
    assert after["evictions"]["by_reason"]["manual"] - before["evictions"]["by_reason"]["manual"] >= resident


def test_pin_keeps_a_prefix_through_flush_until_unpin(stack, populated, tmp_path, cli):
    assert populated.client.store(PROMPT_B, _kv(6)).stored == 6  # the flush above emptied the cache
    prefix = tmp_path / "system.json"
    prefix.write_text(json.dumps(PROMPT_B[: 4 * BLOCK + 3]))
    address = ["--cache", stack.address]
    pin_args = ["--namespace", populated.namespace_id, "--tokens-file", str(prefix)]
    bad = cli("pin", *address, *pin_args, "--priority", "101")
    assert bad.returncode != 0 and "--priority" in bad.stderr and populated.client.pins() == []
    made = cli("pin", *address, *pin_args, "--ttl", "1h", "--priority", "70")
    assert made.returncode == 0, made.stderr
    pin_id = int(made.stdout.split()[1].rstrip(":"))
    assert f"pin {pin_id}: {4 * BLOCK:,} of {4 * BLOCK + 3:,} token(s) pinned (priority 70," in made.stdout
    assert run("flush", *address, "--yes").returncode == 0
    listed = cli("pins", *address, "--json")
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)["pins"]
    assert (entry["pin_id"], entry["namespace_id"], entry["pinned_tokens"], entry["priority"]) == (
        pin_id,
        populated.namespace_id,
        4 * BLOCK,
        70,
    )
    assert 3500 < entry["expires_in_s"] <= 3600
    assert populated.client.lookup(PROMPT_B, take_lease=False).hit_tokens == 4 * BLOCK  # the flush kept it
    bad = cli("pin", *address, "--namespace", populated.namespace_id, "--tokens-file", str(prefix), "--ttl", "soon")
    assert bad.returncode != 0 and "--ttl" in bad.stderr
    assert cli("unpin", *address, str(pin_id)).stdout == f"unpinned {pin_id} at {stack.address}\n"
    again = cli("unpin", *address, str(pin_id))
    assert again.returncode != 0 and "pin_id" in again.stderr
    assert cli("pins", *address).stdout == f"no pins at {stack.address}\n"
    warmed = cli("warm", *address, "--namespace", populated.namespace_id, "--tokens-file", str(prefix), "--json")
    assert warmed.returncode == 0, warmed.stderr
    assert {k: json.loads(warmed.stdout)[k] for k in ("cached_tokens", "host_tokens", "prompt_tokens")} == {
        "cached_tokens": 4 * BLOCK,
        "host_tokens": 4 * BLOCK,
        "prompt_tokens": 4 * BLOCK + 3,
    }
    prefix.write_text(json.dumps(UNCACHED))
    cold = cli("warm", *address, "--namespace", populated.namespace_id, "--tokens-file", str(prefix))
    assert cold.returncode == 1 and cold.stderr == f"nothing holds this prefix at {stack.address}\n"


# -- metrics and the dashboard -------------------------------------------------------------------------
BOUNDED_LABELS = {
    "tier": {"device", "host", "redis"},
    "reason": {
        "lru",
        "ttl",
        "capacity",
        "manual",
        "shorter_than_block",
        "not_cached",
        "expired",
        "verification_failed",
    },
    "method": {
        "Attach",
        "Lookup",
        "Fetch",
        "Reserve",
        "Commit",
        "Store",
        "Release",
        "GetStats",
        "Inspect",
        "Evict",
        "ListNamespaces",
        "Flush",
        "Match",
        "Pin",
        "Unpin",
        "ListPins",
    },
}
EXPOSED_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
    "summary": ("", "_count", "_sum", "_created"),
}


def _scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


def _exposed(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """(every series name the text exposes or declares, label name -> values seen)."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in EXPOSED_SUFFIXES.get(family.type, ("",)))
        for sample in family.samples:
            names.add(sample.name)
            for key, value in sample.labels.items():
                labels.setdefault(key, set()).add(value)
    return names, labels


def test_metrics_are_parsable_bounded_and_match_stats(stack, populated):
    text = _scrape(stack.metrics_port)
    doc = _stats(populated)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    value = {
        name: families[name].samples[0].value
        for name in (
            "prefixcache_lookups",
            "prefixcache_tokens_saved",
            "prefixcache_tokens_looked_up",
            "prefixcache_ready",
        )
    }
    assert value["prefixcache_ready"] == 1
    assert value["prefixcache_tokens_saved"] == doc["tokens"]["saved"]
    assert value["prefixcache_tokens_looked_up"] == doc["tokens"]["looked_up"]
    assert value["prefixcache_lookups"] == doc["requests"]["lookups"]
    assert families["prefixcache_rpc_duration_seconds"].type == "histogram"
    lookups = [
        s
        for s in families["prefixcache_rpc_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels["method"] == "Lookup"
    ]
    assert lookups and lookups[0].value >= 5
    _, labels = _exposed(text)
    for name, allowed in BOUNDED_LABELS.items():
        assert labels.get(name, set()) <= allowed, (name, labels.get(name))
    for values in labels.values():
        for label_value in values:
            assert not re.search(r"\d+\s*[, ]\s*\d+", label_value), label_value  # no token lists
            assert len(label_value) <= 40, label_value
    for secret in (SALT, populated.namespace_id, TOKEN, ", ".join(map(str, PROMPT_A[:4]))):
        assert secret not in text


def _dashboard_queries(dashboard: dict) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def test_grafana_dashboard_uses_only_metrics_the_exporters_emit(stack, populated, worker_request):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "prefixcache.json").read_text())
    service_names, service_labels = _exposed(_scrape(stack.metrics_port))
    worker_names, worker_labels = _exposed(_scrape(stack.worker_port))
    emitted = service_names | worker_names
    queries = _dashboard_queries(dashboard)
    assert len(queries) >= 20
    used = set()
    for query in queries:
        for name in re.findall(r"\bprefixcache_[a-z0-9_]+", query):
            assert name in emitted, f"{name} (in {query}) is not exported"
            used.add(name)
        for label, alternatives in re.findall(r'\b(event|method)=~?"([^"]+)"', query):
            for value in alternatives.split("|"):
                assert value in service_labels.get(label, set()), f"{label}={value} (in {query}) is never exported"
    for required in (
        "prefixcache_tokens_saved_total",
        "prefixcache_tier_bytes",
        "prefixcache_evictions_total",
        "prefixcache_spills_total",
        "prefixcache_remote_up",
        "prefixcache_rpc_duration_seconds_bucket",
        "prefixcache_worker_ttft_seconds_bucket",
    ):
        assert required in used, required
    assert worker_labels  # the worker served a request, so its series carry samples
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def test_dashboard_rates_apply_only_to_counters(stack, populated, worker_request):
    """rate()/increase() of a gauge is meaningless; every one the dashboard takes is of a counter
    (`_total`) or a histogram's `_bucket`/`_count`/`_sum`, as the live exporters type them."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "prefixcache.json").read_text())
    types = {**_types(_scrape(stack.worker_port)), **_types(_scrape(stack.metrics_port))}
    taken = [
        name
        for query in _dashboard_queries(dashboard)
        for name in re.findall(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", query)
    ]
    assert len(taken) >= 20 and any(n.startswith("process_") for n in taken)
    for name in taken:
        if name.endswith("_total"):
            assert types.get(name[: -len("_total")]) == "counter", (name, types.get(name[: -len("_total")]))
        else:
            family, _, suffix = name.rpartition("_")
            assert suffix in ("bucket", "count", "sum") and types.get(family) == "histogram", name


def test_one_type_per_name_and_the_redis_tier_exported(stack, populated):
    text = _scrape(stack.metrics_port)
    types = _types(text)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name, kind in types.items():  # counters (and only counters) are exposed as *_total
        samples = {s.name for s in families[name].samples}
        if kind == "counter":
            assert samples <= {name + "_total", name + "_created"}, (name, samples)
        assert not (kind == "gauge" and name.endswith("_total")), name
    assert "prefixcache_remote_stat" not in types
    assert types["prefixcache_remote_events"] == types["prefixcache_remote_bytes"] == "counter"
    assert types["prefixcache_remote_op_duration_seconds"] == "histogram"
    ops = {s.labels["op"] for s in families["prefixcache_remote_op_duration_seconds"].samples}
    assert ops == {"read", "write"}
    state = {
        (s.labels["side"], s.labels["state"]): s.value for s in families["prefixcache_remote_breaker_state"].samples
    }
    assert state == {("read", "up"): 1.0, ("read", "down"): 0.0, ("write", "up"): 1.0, ("write", "down"): 0.0}
    events = {
        s.labels["event"]: s.value for s in families["prefixcache_remote_events"].samples if s.name.endswith("_total")
    }
    assert set(events) >= {"hits", "misses", "read_errors", "spills_queued"} and events["spills_queued"] > 0
    for process in ("process_resident_memory_bytes", "process_cpu_seconds", "python_info"):
        assert process in types, process
