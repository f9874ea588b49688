"""The connector type-checks strictly against vLLM's own types (the main suite's mypy run has no
vLLM, so there vLLM's classes are `Any`): mypy from the main environment, pointed at this one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_connector_is_strict_clean_against_vllm() -> None:
    # The main environment's mypy (scripts/test.sh runs this suite with .venv deactivated).
    local = ROOT / ".venv" / "bin" / "mypy"
    mypy = str(local) if local.exists() else shutil.which("mypy")
    assert mypy is not None, "no mypy in .venv/bin or on PATH: run bash scripts/setup.sh (it installs '.[test]')"
    done = subprocess.run(
        [
            mypy,
            "--python-executable",
            sys.executable,
            "--cache-dir",
            str(ROOT / ".mypy_cache" / "vllm"),  # apart from the plain run's cache, which has no vLLM
            "--no-error-summary",
            "prefixcache/integrations",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"mypy against vLLM's types:\n{done.stdout}{done.stderr}"
