"""This tree's wheel, built with the running interpreter (tests/test_packaging.py, and
tests/vllm_e2e/test_vllm_install.py in .venv-vllm)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(out_dir: Path) -> Path:
    """`pip wheel --no-deps --no-build-isolation` of the tree into `out_dir`; the wheel's path."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out_dir.glob("prefixcache-*.whl")
    return wheel
