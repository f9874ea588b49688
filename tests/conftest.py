"""Shared fixtures: real redis-server processes (tests/redis_server.py) and the
service + worker processes (tests/worker_procs.py)."""

import os

import pytest

# Before torch is imported here or in any subprocess: OpenMP threads that
# busy-wait collapse when tests, services and workers share two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest.register_assert_rewrite("tests.redis_server", "tests.worker_procs")

pytest_plugins = ["tests.redis_server", "tests.worker_procs"]
