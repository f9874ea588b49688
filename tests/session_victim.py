"""The inner session of tests/test_shm.py (not collected by itself: no `test_` prefix).

It starts what a test session starts (a redis-server and a service through the fixtures, a host
tier in this very process), reports their pids and segments to $PFX_VICTIM_REPORT, and waits to
be SIGKILLed; the outer test then checks that nothing it started outlives it.
"""

import json
import os
import time
from pathlib import Path

from prefixcache.config import DType, KVLayout
from prefixcache.tiers.host import HostTier
from tests import conftest


def test_hold_processes_and_segments_until_killed(redis_server, cache_service, request) -> None:
    host = HostTier(KVLayout(2, 2, 8, 4, DType.FLOAT32), 1 << 20)  # owned by the pytest process itself
    request.addfinalizer(host.close)
    janitor = conftest._session["janitor"]
    report = {
        "pids": {"redis-server": redis_server.process.pid, "service": cache_service.process.pid},
        "janitor": janitor.pid,
        "segments": [cache_service.shm_name, host.segment_name],
    }
    path = Path(os.environ["PFX_VICTIM_REPORT"])
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").rename(path)
    time.sleep(300)
