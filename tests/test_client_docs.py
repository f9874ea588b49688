"""docs/client.md's example runs as written against a real service, over shared memory and
over the gRPC stream."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worker_procs import CacheService

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "client.md").read_text(), re.DOTALL)
    assert len(blocks) == 1, "docs/client.md should hold exactly one runnable example"
    return blocks[0]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = CacheService(tmp_path_factory.mktemp("client-docs"), host_capacity="16MiB").start()
    try:
        yield service
    finally:
        service.stop()


@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "stream"])
def test_the_client_docs_example_runs(service, same_host):
    with service.client() as admin:
        admin.flush()  # each run starts from an empty cache, as the example expects
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), PREFIXCACHE_CACHE=service.address, EXAMPLE_SAME_HOST="1" if same_host else "0"
    )
    env.pop("PREFIXCACHE_AUTH_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-c", example()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"shared memory: {same_host}" in done.stdout and "blocks reused: 0 4" in done.stdout, done.stdout
