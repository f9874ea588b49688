"""Test processes die with the test session and leave no shared memory behind, however it ends.

- `popen(...)`: `subprocess.Popen` whose child gets PR_SET_PDEATHSIG=SIGKILL, so the kernel kills
  it when the pytest process dies, even by SIGKILL (no finalizer runs then). PDEATHSIG follows the
  *thread* that forked the child, so the tie is made only from the main thread, where fixtures run;
  a child launched from another thread is untied (its owner's teardown still stops it). The tie
  survives exec (not for set-uid binaries), so redis-server and `python -m prefixcache_services`
  keep it. It is set by util-linux's `setpriv --pdeathsig`, which then execs the command (same
  pid), not by a `preexec_fn`: a preexec_fn makes Popen fork() instead of vfork(), and in a
  process with gRPC running its fork handlers restart the poller in the child, where close_fds
  then closes the epoll fd and the child aborts before exec ("epoll_wait error: Bad file
  descriptor", exit -6: seen here, and grpc/grpc#43157).
- The session janitor (`start_janitor`, this module's `__main__`): a small process in its own
  session that waits for the pytest process to end (EOF on a pipe only pytest holds), then removes
  the shared-memory segments of processes of that session (owner record pid or parent pid == the
  pytest pid: in-process host tiers and the services fixtures started) once their owners are gone.
  It never touches a live segment or another session's. It imports no torch (tiers/shm.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from prefixcache.errors import ConfigError
from prefixcache.tiers.shm import SHM_DIR, SegmentInfo, list_segments, remove_if_dead

SETPRIV = shutil.which("setpriv")  # util-linux, on every Debian/Ubuntu machine
JANITOR_WAIT_S = 30.0  # for the session's children to finish dying after the pytest process did


def popen(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen, the child killed by the kernel when this process dies (from the main thread)."""
    if SETPRIV and isinstance(args, (list, tuple)) and threading.current_thread() is threading.main_thread():
        args = [SETPRIV, "--pdeathsig", "KILL", "--", *args]
    return subprocess.Popen(args, **kwargs)


def kill(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGKILL (as a crash would) and reap, if it still runs."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=timeout_s)


def stop(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, then SIGKILL after `grace_s`; the exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill(process)
    return process.wait()


def session_segments(pid: int, directory: Path = SHM_DIR) -> list[SegmentInfo]:
    """Segments owned by `pid` or by one of its children."""
    return [info for info in list_segments(directory) if pid in (info.record.pid, info.record.ppid)]


def start_janitor(session_pid: int | None = None) -> subprocess.Popen:
    """The janitor of this session; it outlives a SIGKILL of this process (and of its group)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.lifetime", str(session_pid or os.getpid())],
        stdin=subprocess.PIPE,
        cwd=root,
        env=env,
        start_new_session=True,
    )


def _janitor(session_pid: int) -> int:
    sys.stdin.buffer.read()  # EOF: the session's process is gone (or closed the pipe at its end)
    deadline = time.monotonic() + JANITOR_WAIT_S
    while True:
        left = session_segments(session_pid)
        for info in left:
            if not info.alive:
                with contextlib.suppress(ConfigError):  # claimed by a new owner meanwhile: not ours
                    remove_if_dead(info.path)
        if not any(info.alive for info in left) or time.monotonic() > deadline:
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(_janitor(int(sys.argv[1])))
