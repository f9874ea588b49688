"""Shared fixtures: real redis-server processes (tests/redis_server.py)."""

import os

# Before torch is imported here or in any subprocess: OpenMP threads that
# busy-wait collapse when tests, services and workers share two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["tests.redis_server"]
