"""Imports flow one way: the core library never pulls in grpc, redis, transformers or services.

Checked in a fresh interpreter (this test process may already have loaded anything), by
importing every core module and looking at `sys.modules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

CORE = [
    "prefixcache.native",
    "prefixcache.hashing",
    "prefixcache.kinds",
    "prefixcache.index",
    "prefixcache.blockmap",
    "prefixcache.touchlog",
    "prefixcache.codec",
    "prefixcache.tiers.base",
    "prefixcache.tiers.pool",
    "prefixcache.tiers.host",
    "prefixcache.tiers.device",
    "prefixcache.cache",
    "prefixcache.placement",
    "prefixcache.results",
    "prefixcache.config",
    "prefixcache.stats",
    "prefixcache.leases",
    "prefixcache.errors",
    "prefixcache.breaker",
    "prefixcache.remote_link",
    "prefixcache.namespaces",
    "prefixcache.quota",
    "prefixcache.tenants",
    "prefixcache.transfer",
]
FORBIDDEN = ["grpc", "redis", "transformers", "prefixcache_services", "google.protobuf"]

_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after_importing(modules: list[str]) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return set(json.loads(done.stdout))


def offenders(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_core_modules_import_no_service_or_client_libraries() -> None:
    loaded = loaded_after_importing(CORE)
    assert set(CORE) <= loaded
    assert offenders(loaded) == []


def test_the_closed_sets_load_neither_the_compiled_core_nor_torch() -> None:
    """A client or a view names a tier or a reason without the index's or the tiers' imports."""
    loaded = loaded_after_importing(["prefixcache.kinds"])
    assert "prefixcache.kinds" in loaded
    assert not {"prefixcache._core", "prefixcache.native", "torch", "numpy"} & loaded


def test_the_probe_would_notice_a_forbidden_import() -> None:
    """The check itself can fail: importing a forbidden package is reported."""
    found = offenders(loaded_after_importing(["prefixcache.errors", "redis", "prefixcache_services"]))
    assert "redis" in found and "prefixcache_services" in found
