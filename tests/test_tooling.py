"""Lint and type checks as part of the test command: a new violation fails CI.

`ruff check .` must be clean and `ruff format --check .` must pass. `mypy` (configured in pyproject.toml: strict on prefixcache/,
defaults on services/) must report nothing in prefixcache/; services/ may keep the errors
recorded in tests/mypy_baseline.txt (counted per file and error code) but gain none.
When you fix some, tighten the baseline: `python tests/test_tooling.py --write-baseline`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "mypy_baseline.txt"
ERROR = re.compile(r"^(?P<path>[\w/.]+\.pyi?):\d+: error: .*\[(?P<code>[\w-]+)\]$")

pytestmark = pytest.mark.slow


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return found


def mypy_errors() -> Counter[tuple[str, str]]:
    done = subprocess.run([_tool("mypy"), "--no-error-summary"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode not in (0, 1) or done.stderr.strip():
        raise AssertionError(f"mypy did not run: {done.stderr or done.stdout}")
    found: Counter[tuple[str, str]] = Counter()
    for line in done.stdout.splitlines():
        match = ERROR.match(line)
        if match:
            found[(match["path"], match["code"])] += 1
    return found


def read_baseline() -> Counter[tuple[str, str]]:
    baseline: Counter[tuple[str, str]] = Counter()
    for line in BASELINE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            count, path, code = line.split()
            baseline[(path, code)] = int(count)
    return baseline


def test_ruff_format_is_applied() -> None:
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_check_is_clean() -> None:
    done = subprocess.run(
        [_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_strict_clean_on_the_core_and_adds_nothing_elsewhere() -> None:
    found = mypy_errors()
    core = sorted(key for key in found if key[0].startswith("prefixcache/"))
    assert not core, f"mypy errors in prefixcache/ (strict): {core}"
    baseline = read_baseline()
    new = {key: count - baseline[key] for key, count in found.items() if count > baseline[key]}
    assert not new, f"new mypy errors (file, code): +count {new}; run mypy to see them"


def test_the_baseline_parser_sees_errors() -> None:
    """The probe can fail: an error line in mypy's format is counted, other lines are not."""
    assert ERROR.match("services/x.py:3: error: Bad thing  [arg-type]")["code"] == "arg-type"
    assert ERROR.match("services/x.py:3: note: See docs") is None


if __name__ == "__main__" and sys.argv[1:] == ["--write-baseline"]:
    errors = mypy_errors()
    lines = [
        f"{count} {path} {code}"
        for (path, code), count in sorted(errors.items())
        if not path.startswith("prefixcache/")
    ]
    BASELINE.write_text(
        "# mypy errors services/ may keep (count path code); may only shrink. "
        "Regenerate: python tests/test_tooling.py --write-baseline\n" + "\n".join(lines) + "\n"
    )
    print(f"{len(lines)} entries written to {BASELINE}")
