"""Shared fixtures: real redis-server processes (tests/redis_server.py)."""

pytest_plugins = ["tests.redis_server"]
