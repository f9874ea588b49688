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
    mypy = shutil.which("mypy")  # scripts/test.sh activates .venv, which has it
    assert mypy is not None, "mypy is not on PATH: activate the main .venv (pip install -e '.[test]')"
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
