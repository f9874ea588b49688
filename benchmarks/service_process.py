"""Start `prefixcache serve` as a child process for a benchmark, on a free loopback port."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = "prefixcache serve: listening on "


def start_service(
    *flags: str, grace: str = "2s", timeout_s: float = 120.0, cpus: set[int] | None = None, root: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    """The running process and its `HOST:PORT`, once it printed its ready line; `cpus`: the cores
    it runs on (None: any); `root`: the checkout it runs from (another one's: a "before")."""
    command = [
        sys.executable,
        "-m",
        "prefixcache_services",
        "--log-level",
        "WARNING",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--shm-name",
        f"pfx-bench-{secrets.token_hex(4)}",
        "--grace",
        grace,
        *flags,
    ]
    process = subprocess.Popen(
        command,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith(READY):
            return process, line[len(READY) :].strip()
    process.kill()
    raise SystemExit("the cache service did not start")
