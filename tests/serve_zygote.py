"""Starts many `serve` processes quickly: fork from one interpreter that imported the service once.

`python -m prefixcache_services serve` spends ~3 s importing torch and gRPC before it listens; a test that
must SIGTERM a fresh service twenty times cannot pay that each time. This process imports the
service once, creates no gRPC object (so forking is safe: gRPC's core is not yet started), and
forks one child per request, which then runs `prefixcache serve` exactly as the CLI would.

Protocol, one line each way (stdin -> stdout), one child at a time:
    start LOG ARG...   -> "pid N"      (the child's stdout and stderr go to LOG)
    wait               -> "exit N RC"  (RC as subprocess reports it: -11 for SIGSEGV)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from prefixcache_services.cli import main as cli_main

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), so that nothing outlives the test."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _child(fd: int, argv: list[str]) -> None:
    _die_with_parent()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    code = 1
    try:
        code = cli_main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_forever() -> None:
    _die_with_parent()
    child = None
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "start" and child is None:
            fd = os.open(words[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # exists once "pid" is said
            child = os.fork()
            if child == 0:
                _child(fd, words[2:])
            os.close(fd)
            print(f"pid {child}", flush=True)
        elif words == ["wait"] and child is not None:
            _, status = os.waitpid(child, 0)
            print(f"exit {child} {os.waitstatus_to_exitcode(status)}", flush=True)
            child = None
        else:
            print(f"error {line.strip()!r}", flush=True)


if __name__ == "__main__":
    serve_forever()
