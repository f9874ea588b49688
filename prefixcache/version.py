"""The package's version: `--version` of the CLI and the worker's `/version`.

A source checkout (pyproject.toml beside the package) reports pyproject's version, so a tree
run with PYTHONPATH never reports a different installed copy's; an installed package reports
its metadata.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path


@cache
def version() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        with pyproject.open("rb") as handle:
            project = tomllib.load(handle).get("project", {})
        if project.get("name") == "prefixcache" and "version" in project:
            return str(project["version"])
    try:
        return metadata.version("prefixcache")
    except metadata.PackageNotFoundError:
        return "0+unknown"
