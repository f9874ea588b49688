"""Shared fixtures: real redis-server processes (tests/support/redis_server.py) and the
service + worker processes (tests/support/worker_procs.py), tied to this pytest process
(tests/support/lifetime.py): if it dies, even by SIGKILL, they die with it, and the
session janitor removes the shared-memory segments they and this process owned.
The terminal summary counts prefixcache segments in /dev/shm before and after."""

import os

import pytest

# Before torch is imported here or in any subprocess: OpenMP threads that
# busy-wait collapse when tests, services and workers share two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.support import lifetime  # after the environment is set

pytest.register_assert_rewrite("tests.support.redis_server", "tests.support.worker_procs")

pytest_plugins = ["tests.support.redis_server", "tests.support.worker_procs"]

_session: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    _session["janitor"] = lifetime.start_janitor()
    _session["before"] = len(lifetime.list_segments())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if "before" not in _session:
        return
    left = lifetime.session_segments(os.getpid())
    terminalreporter.write_line(
        f"shared memory: {_session['before']} prefixcache segment(s) in /dev/shm before the session, "
        f"{len(lifetime.list_segments())} after; {len(left)} of them left by this session's processes"
        + (f" ({', '.join(info.name for info in left)}; the janitor removes them)" if left else "")
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    janitor = _session.pop("janitor", None)
    if janitor is not None:
        janitor.stdin.close()  # the janitor runs now, as it would had this process been killed
