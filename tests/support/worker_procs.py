"""Real `prefixcache serve` and `prefixcache worker` processes for tests, on free loopback ports.

- `CacheService`: `python -m prefixcache_services serve` with its own shared-memory name; readiness is its
  `prefixcache serve: listening on HOST:PORT` line. It can be SIGKILLed (as a crash would) and
  restarted on the same port, optionally over a Redis tier (`--redis-url`), whose key prefix is
  unique per service object so stacks sharing one redis-server never see each other's blocks.
- `WorkerProcess`: `python -m prefixcache_services worker` (the tiny bfloat16 model) pointed at a service
  or `--no-cache`; readiness is polled on `GET /health` with a deadline.
- `cache_service` (fixture): one service process of a test's own, without a worker.
- `running_stack`: a service, a cached worker and (optionally) a `--no-cache` reference worker.
- `RouterProcess`: `python -m prefixcache_services route` in front of given workers (and their services);
  readiness is its `prefixcache route: listening on HOST:PORT` line.
- `WorkerClient`: a small stdlib HTTP client (one connection per call, so threads may share
  it) for the OpenAI endpoints, including server-sent-event streams.

Readiness is always polled with a bounded deadline, never a blind sleep. Every process is
killed when its owner is torn down, at interpreter exit should a test die first, and by the
kernel should the test process be SIGKILLed (tests/support/lifetime.py); a SIGKILLed service's
shared-memory segment is unlinked by `kill`.

Model processes take seconds to start (and seconds to exit: interpreter teardown of torch),
so one stack serves the whole test session: the `worker_stack` fixture, which modules get with
tests/conftest.py (pytest_plugins). Tests sharing it salt their requests
(`cache_salt`) so their cached blocks never meet, and a test that kills or restarts the service
leaves the worker attached to it again before it ends. Workers start and stop
in parallel (`start_all`, `stop_all`).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixcache.tiers.shm import SHM_DIR, control_socket_path, presence_path
from tests.support import lifetime
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "prefixcache serve: listening on "
SERVICE_READY_S = 60.0
WORKER_READY_S = 180.0  # model load on a busy 2-core CI runner
HTTP_TIMEOUT_S = 120.0
_POLL_S = 0.05


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def _await_ready(process: subprocess.Popen, ready_line: str, timeout_s: float) -> str | None:
    """The address a process prints after `ready_line` on stdout; None (the process killed) when
    it exits or stays silent for `timeout_s`."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(process.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith(ready_line):
            return line[len(ready_line) :].strip()
    lifetime.kill(process)
    return None


class CacheService:
    """One cache service process; `restart` keeps its port (and its Redis, if any)."""

    def __init__(
        self,
        workdir: Path,
        host_capacity: str = "256MiB",
        redis_url: str | None = None,
        extra_args: Sequence[str] = (),
        fixed_shm_name: str | None = None,
    ) -> None:
        """`fixed_shm_name`: the same `--shm-name` on every (re)start, as a deployment pins it."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host_capacity = host_capacity
        self.redis_url = redis_url
        self.redis_key_prefix = f"pfxt{secrets.token_hex(4)}"
        self.extra_args = tuple(extra_args)
        self.fixed_shm_name = fixed_shm_name
        self.port = 0  # fixed by the first start
        self.shm_name = ""
        self.process: subprocess.Popen | None = None
        self._starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "service.log"

    def _command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "prefixcache_services",
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--host-capacity",
            self.host_capacity,
            "--shm-name",
            self.shm_name,
            "--grace",
            "2s",
            "--workers",
            "8",
            *self.extra_args,
        ]
        if self.redis_url:
            command += [
                "--redis-url",
                self.redis_url,
                "--redis-key-prefix",
                self.redis_key_prefix,
                "--redis-timeout-ms",
                "2000",
            ]
        return command

    def start(self, timeout_s: float = SERVICE_READY_S) -> CacheService:
        self._starts += 1
        self.shm_name = self.fixed_shm_name or f"pfx-test-{secrets.token_hex(4)}-{self._starts}"
        with self.log_path.open("a") as log:
            self.process = lifetime.popen(
                self._command(), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=log, text=True
            )
        weakref.finalize(self, lifetime.kill, self.process)
        address = _await_ready(self.process, READY_LINE, timeout_s)
        if address is None:
            raise RuntimeError(
                f"cache service did not report readiness within {timeout_s}s "
                f"(exit {self.process.poll()}): {_tail(self.log_path)}"
            )
        self.port = int(address.rpartition(":")[2])
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash): the segment, control socket and presence table it would have unlinked are removed here."""
        if self.process is not None:
            lifetime.kill(self.process)
        segment = SHM_DIR / self.shm_name
        control_socket_path(segment).unlink(missing_ok=True)
        presence_path(segment).unlink(missing_ok=True)
        segment.unlink(missing_ok=True)

    def restart(self, timeout_s: float = SERVICE_READY_S) -> None:
        self.kill()
        self.start(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            lifetime.stop(self.process, 15)
        self.kill()  # and the segment, whatever the exit

    def client(self, timeout_s: float = 10.0):
        """A plain `CacheClient` for assertions (stats, inspect); not attached."""
        from prefixcache.client import CacheClient

        return CacheClient(self.address, timeout_s=timeout_s)

    def resident_blocks(self) -> dict[str, int]:
        """Blocks resident per model, summed over its namespaces and tiers (ListNamespaces)."""
        client = self.client()
        try:
            resident: dict[str, int] = {}
            for entry in client.namespaces():
                resident[entry.model] = resident.get(entry.model, 0) + sum(entry.blocks.values())
            return resident
        finally:
            client.close()


class WorkerProcess:
    """One `prefixcache worker` (tiny model) on a free port; `cache=None` means `--no-cache`."""

    def __init__(self, workdir: Path, cache: CacheService | None, extra_args: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache = cache
        self.extra_args = tuple(extra_args)
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.client = WorkerClient("127.0.0.1", self.port)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"worker-{self.port}.log"

    def launch(self) -> WorkerProcess:
        cache = ["--no-cache"] if self.cache is None else ["--cache", self.cache.address]
        command = [
            sys.executable,
            "-m",
            "prefixcache_services",
            "worker",
            "--listen",
            f"127.0.0.1:{self.port}",
            *cache,
            *self.extra_args,
        ]
        with self.log_path.open("a") as log:
            self.process = lifetime.popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        weakref.finalize(self, lifetime.kill, self.process)
        return self

    def wait_ready(self, timeout_s: float = WORKER_READY_S) -> WorkerProcess:
        deadline = time.monotonic() + timeout_s
        while not self.client.healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}: {_tail(self.log_path)}")
            if time.monotonic() > deadline:
                lifetime.kill(self.process)
                raise TimeoutError(f"worker on port {self.port} not healthy after {timeout_s}s: {_tail(self.log_path)}")
            time.sleep(_POLL_S)
        return self

    def log(self) -> str:
        return _tail(self.log_path, 200_000)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 15 s); the exit code, None if never launched."""
        return None if self.process is None else lifetime.stop(self.process, 15)


def start_all(workers: Sequence[WorkerProcess]) -> None:
    """Launch every worker first, then wait: model loads overlap."""
    for worker in workers:
        worker.launch()
    try:
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        stop_all(workers)
        raise


def stop_all(workers: Sequence[WorkerProcess]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop()


ROUTER_READY_LINE = "prefixcache route: listening on "


class RouterProcess:
    """`prefixcache route` on a free port in front of `engines` ((worker, its service or None) pairs)."""

    def __init__(
        self,
        workdir: Path,
        engines: Sequence[tuple[WorkerProcess, CacheService | None]],
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.engines = list(engines)
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.client = WorkerClient("127.0.0.1", 0)

    @property
    def log_path(self) -> Path:
        return self.workdir / "router.log"

    def start(self, timeout_s: float = SERVICE_READY_S) -> RouterProcess:
        command = [sys.executable, "-m", "prefixcache_services", "route", "--listen", "127.0.0.1:0"]
        for worker, service in self.engines:
            url = f"http://127.0.0.1:{worker.port}"
            command += ["--engine", url if service is None else f"{url}={service.address}"]
        command += list(self.extra_args)
        with self.log_path.open("a") as log:
            self.process = lifetime.popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        weakref.finalize(self, lifetime.kill, self.process)
        address = _await_ready(self.process, ROUTER_READY_LINE, timeout_s)
        if address is None:
            raise RuntimeError(f"router did not report readiness within {timeout_s}s: {_tail(self.log_path)}")
        self.port = int(address.rpartition(":")[2])
        self.client = WorkerClient("127.0.0.1", self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        return None if self.process is None else lifetime.stop(self.process, 15)


@dataclass(frozen=True)
class Stack:
    service: CacheService
    cached: WorkerProcess
    reference: WorkerProcess | None  # --no-cache: the A/B baseline


@contextmanager
def running_stack(
    workdir: Path,
    redis_url: str | None = None,
    reference: bool = True,
    worker_args: Sequence[str] = ("--cache-deadline-ms", "5000", "--hit-policy", "always"),
) -> Iterator[Stack]:
    """Service first (the worker attaches at start-up), then the workers' model loads in parallel."""
    service = CacheService(workdir / "service", redis_url=redis_url).start()
    workers = [WorkerProcess(workdir / "cached", service, worker_args)]
    if reference:
        workers.append(WorkerProcess(workdir / "reference", None))
    try:
        start_all(workers)
        yield Stack(service, workers[0], workers[1] if reference else None)
    finally:
        if service.alive():
            service.process.terminate()  # drains while the workers exit (seconds of torch teardown)
        stop_all(workers)
        service.stop()


@pytest.fixture
def cache_service(tmp_path) -> Iterator[CacheService]:
    """One service process of this test's own (no Redis, no worker), stopped at teardown."""
    service = CacheService(tmp_path / "cache-service", host_capacity="16MiB").start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def worker_stack(redis_server, tmp_path_factory) -> Iterator[Stack]:
    """The session's stack: service over the session Redis, cached worker, no-cache reference."""
    with running_stack(tmp_path_factory.mktemp("worker-stack"), redis_url=redis_server.url) as stack:
        yield stack


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict

    @property
    def text(self) -> str:
        choice = self.body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    @property
    def cached_tokens(self) -> int:
        return self.body["usage"]["prompt_tokens_details"]["cached_tokens"]

    @property
    def prompt_tokens(self) -> int:
        return self.body["usage"]["prompt_tokens"]


class WorkerClient:
    """Minimal OpenAI-style client over http.client: one connection per call (thread-safe)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def connection(self, timeout_s: float = HTTP_TIMEOUT_S) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str]:
        connection = self.connection()
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read(), response.getheader("Content-Type", "")
        finally:
            connection.close()

    def healthy(self) -> bool:
        try:
            status, _, _ = self.request("GET", "/health")
        except OSError:
            return False
        return status == 200

    def health(self) -> dict:
        status, data, _ = self.request("GET", "/health")
        assert status == 200, data
        return json.loads(data)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """GET /metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        status, data, content_type = self.request("GET", "/metrics")
        assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(data.decode())
            for sample in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics (0 when the labelled series does not exist yet)."""
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def post(self, path: str, payload: dict | bytes) -> Reply:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, data, _ = self.request("POST", path, raw)
        return Reply(status, json.loads(data))

    def chat(self, messages: Sequence[dict], **options) -> Reply:
        options.setdefault("temperature", 0)
        return self._ok(self.post("/v1/chat/completions", {"messages": list(messages), **options}))

    def complete(self, prompt: str | Sequence[int], **options) -> Reply:
        options.setdefault("temperature", 0)
        body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), **options}
        return self._ok(self.post("/v1/completions", body))

    @staticmethod
    def _ok(reply: Reply) -> Reply:
        if reply.status != 200:
            raise AssertionError(f"HTTP {reply.status}: {reply.body}")
        return reply

    def stream(self, path: str, payload: dict) -> Iterator[dict | str]:
        """Yields each SSE `data:` payload parsed as JSON, and the final "[DONE]" as a string."""
        connection = self.connection()
        try:
            connection.request(
                "POST",
                path,
                body=json.dumps({**payload, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            response = connection.getresponse()
            if response.status != 200:
                raise AssertionError(f"HTTP {response.status}: {response.read()!r}")
            assert response.getheader("Content-Type", "").startswith("text/event-stream")
            yield from _server_sent_events(response)
        finally:
            connection.close()


def _server_sent_events(response: http.client.HTTPResponse) -> Iterator[dict | str]:
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if not line:
            continue
        if not line.startswith("data: "):
            raise AssertionError(f"not an SSE data line: {line!r}")
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)
