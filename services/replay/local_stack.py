"""A cache service and workers as local subprocesses, for the demo and end-to-end tests.

Owns: starting `prefixcache serve` and `prefixcache worker` processes on free loopback ports,
waiting until each is ready (polling with a deadline, never a fixed sleep), and stopping them.

Invariants:
- every process started is stopped when the `LocalStack` context exits, on every path
  (error, Ctrl-C, SIGTERM turned into SystemExit by the caller): SIGTERM, then SIGKILL after
  `stop_grace_s`;
- processes listen on 127.0.0.1 only; each writes its stdout/stderr to a log file under
  `log_dir`, and a failure names the process and ends with the tail of its log;
- readiness: the service is ready once it has printed its `listening on HOST:PORT` line; a
  worker once `GET /health` answers 200. A process that exits while being waited for fails
  the wait at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SERVICE_READY = "prefixcache serve: listening on "
POLL_S = 0.1
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class StackError(RuntimeError):
    """A local process failed to start or to become ready; the message ends with its log tail."""


@dataclass(frozen=True)
class Started:
    name: str
    process: subprocess.Popen
    log_path: Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS had free a moment ago (the worker binds it right after; a lost race fails
    the readiness wait with the worker's 'address in use' log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _child_env() -> dict[str, str]:
    # Children run `python -m prefixcache_services` from this checkout even when it is not installed.
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=f"{PROJECT_ROOT}{os.pathsep}{path}" if path else str(PROJECT_ROOT))
    # Two workers and a service share the machine: OpenMP threads that busy-wait after each
    # parallel region would take the cores from whichever process runs next (unless set).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class LocalStack:
    """Context manager owning the processes it starts (see module invariants)."""

    def __init__(
        self,
        log_dir: Path | None = None,
        startup_timeout_s: float = 180.0,
        stop_grace_s: float = 10.0,
        log_level: str = "INFO",
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="prefixcache-demo-")
            log_dir = Path(self._tmp.name)
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_level = log_level
        self._started: list[Started] = []

    def __enter__(self) -> LocalStack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _spawn(self, name: str, args: list[str]) -> Started:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as sink:
            # A new session: a terminal's Ctrl-C reaches only us, and we stop the children in order.
            process = subprocess.Popen(
                [sys.executable, "-m", "prefixcache_services", "--log-level", self.log_level, *args],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                cwd=PROJECT_ROOT,
                start_new_session=True,
            )
        started = Started(name, process, log_path)
        self._started.append(started)
        log.info("started %s (pid %d), log %s", name, process.pid, log_path)
        return started

    def _failed(self, started: Started, problem: str) -> StackError:
        return StackError(f"{started.name} {problem}; last lines of {started.log_path}:\n{log_tail(started.log_path)}")

    def start_service(self, host_capacity: str = "256MiB", extra: tuple[str, ...] = ()) -> Started:
        return self._spawn(
            "cache-service", ["serve", "--listen", "127.0.0.1:0", "--host-capacity", host_capacity, *extra]
        )

    def service_address(self, started: Started, deadline: float) -> str:
        """HOST:PORT from the service's readiness line (waits for it until `deadline`)."""
        while True:
            for line in started.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith(SERVICE_READY):
                    return line[len(SERVICE_READY) :].strip()
            self._check_alive(started, deadline)
            time.sleep(POLL_S)

    def start_worker(self, name: str, cache_address: str | None, extra: tuple[str, ...] = ()) -> tuple[Started, str]:
        """A worker on a free port, with the cache (`cache_address`) or `--no-cache`; returns its URL."""
        port = free_port()
        cache = ["--cache", cache_address] if cache_address else ["--no-cache"]
        started = self._spawn(name, ["worker", "--listen", f"127.0.0.1:{port}", *cache, *extra])
        return started, f"http://127.0.0.1:{port}"

    def wait_healthy(self, started: Started, url: str, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        log.info("%s ready at %s", started.name, url)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            self._check_alive(started, deadline)
            time.sleep(POLL_S)

    def _check_alive(self, started: Started, deadline: float) -> None:
        code = started.process.poll()
        if code is not None:
            raise self._failed(started, f"exited with status {code} before it was ready")
        if time.monotonic() >= deadline:
            raise self._failed(started, f"was not ready within {self.startup_timeout_s:.0f}s")

    def deadline(self) -> float:
        return time.monotonic() + self.startup_timeout_s

    def stop(self) -> None:
        """SIGTERM every live process (workers before the service), then SIGKILL stragglers."""
        for started in reversed(self._started):
            if started.process.poll() is None:
                started.process.send_signal(signal.SIGTERM)
        for started in reversed(self._started):
            try:
                started.process.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", started.name, self.stop_grace_s)
                started.process.kill()
                started.process.wait()
        self._started.clear()
