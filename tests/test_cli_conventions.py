"""CLI conventions: --version, global options after the command, PREFIXCACHE_<FLAG> defaults,
Kubernetes-style sizes, --log-format json, and light imports (serve, admin and the client run
with transformers, tiktoken and aiohttp absent)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from prefixcache.config import parse_size
from prefixcache.errors import ConfigError
from prefixcache.version import version
from prefixcache_services.cli import build_parser, configure_logging, env_name, main

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"prefixcache {version()}" == "prefixcache 0.1.0"


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["serve"], "INFO", "text"),
        (["--log-level", "DEBUG", "serve"], "DEBUG", "text"),
        (["serve", "--log-level", "DEBUG", "--log-format", "json"], "DEBUG", "json"),
        (["--log-level", "ERROR", "serve", "--log-level", "WARNING"], "WARNING", "text"),
        (["stats", "--log-format", "json"], "INFO", "json"),
    ],
)
def test_global_options_go_before_or_after_the_command(argv, level, fmt):
    args = build_parser(argv, environ={}).parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


def test_a_bad_global_option_after_the_command_names_it(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve"], environ={}).parse_args(["serve", "--log-level", "LOUD"])
    assert "--log-level" in capsys.readouterr().err


def test_environment_defaults_with_flag_over_env_over_default():
    env = {
        "PREFIXCACHE_HOST_CAPACITY": "2Gi",
        "PREFIXCACHE_BLOCK_SIZE": "32",
        "PREFIXCACHE_HASH": "sha256",
        "PREFIXCACHE_LOG_LEVEL": "DEBUG",
        "PREFIXCACHE_LOG_FORMAT": "json",
    }

    def parse(argv):
        return build_parser(argv, environ=env).parse_args(argv)

    args = parse(["serve"])
    assert (args.host_capacity, args.block_size, args.hash) == ("2Gi", 32, "sha256")
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    flagged = parse(["serve", "--block-size", "8", "--host-capacity", "1GiB", "--log-level", "ERROR"])
    assert (flagged.block_size, flagged.host_capacity, flagged.log_level) == (8, "1GiB", "ERROR")
    plain = build_parser(["serve"], environ={}).parse_args(["serve"])
    assert (plain.block_size, plain.host_capacity, plain.log_level) == (16, "1GiB", "INFO")


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False), ("", False)]
)
def test_switches_read_from_the_environment(value, expected):
    argv = ["worker"]
    args = build_parser(argv, environ={"PREFIXCACHE_NO_CACHE": value}).parse_args(argv)
    assert args.no_cache is expected


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"PREFIXCACHE_HASH": "md5"}, "PREFIXCACHE_HASH='md5': must be one of"),
        ({"PREFIXCACHE_NO_CACHE": "maybe"}, "PREFIXCACHE_NO_CACHE='maybe'"),
        ({"PREFIXCACHE_BLOCK_SIZE": "big"}, "--block-size"),
    ],
)
def test_a_bad_environment_value_is_one_error_naming_it(env, words, capsys):
    argv = ["serve" if "HASH" in str(env) or "BLOCK" in str(env) else "worker"]
    with pytest.raises(SystemExit) as failed:
        build_parser(argv, environ=env).parse_args(argv)
    assert failed.value.code == 2 and words in capsys.readouterr().err


def test_the_k8s_configmap_names_flags_of_serve_or_worker():
    """The configmap's keys are PREFIXCACHE_<FLAG> of the containers that read them (envFrom)."""
    configmap = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy/k8s/app/configmap.yaml").read_text())
        if d and d.get("kind") == "ConfigMap"
    )
    parser = build_parser(None, environ={})
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    names = {env_name(a) for cmd in ("serve", "worker") for a in subs[cmd]._actions} - {None}
    assert set(configmap["data"]) <= names, set(configmap["data"]) - names
    args = build_parser(["serve"], environ=configmap["data"]).parse_args(["serve"])
    assert parse_size(args.host_capacity) == parse_size(configmap["data"]["PREFIXCACHE_HOST_CAPACITY"])


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2Gi", 2 << 30),
        ("512Mi", 512 << 20),
        ("4Ki", 4096),
        ("1Ti", 1 << 40),
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
    ],
)
def test_sizes_take_kubernetes_and_iec_units(text, size):
    assert parse_size(text) == size


def test_a_bad_size_names_the_field():
    with pytest.raises(ConfigError, match="host_capacity.*2Gi"):
        parse_size("2 gallons", "host_capacity")


def test_json_log_format_writes_one_object_per_line(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json")
        logging.getLogger("prefixcache.test").warning("hello %s", "world")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("prefixcache.test").exception("failed")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["message"] == "hello world" and lines[0]["level"] == "WARNING"
    assert lines[0]["logger"] == "prefixcache.test" and lines[0]["ts"].endswith("+00:00")
    assert "ValueError: boom" in lines[1]["exception"]


BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = ("transformers", "tiktoken", "tiktoken_ext", "aiohttp")

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Absent())
    import prefixcache.client  # noqa: F401
    from prefixcache_services.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as done:
        code = done.code
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("LOADED", loaded, "CODE", code, file=sys.stderr)
""")


@pytest.mark.parametrize(
    "argv", [["serve", "--help"], ["--help"], ["stats", "--help"], ["inspect", "--help"], ["--version"], ["replay"]]
)
def test_light_commands_run_without_transformers_tiktoken_or_aiohttp(argv):
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert "LOADED [] CODE" in done.stderr, done.stderr[-3000:]
    if argv == ["replay"]:  # listed, and names what to install
        assert "CODE 2" in done.stderr and "pip install 'prefixcache[replay]'" in done.stderr
    else:
        assert "CODE 0" in done.stderr, done.stderr[-3000:]
    if argv == ["--help"]:
        assert "serve" in done.stdout and "replay" in done.stdout and "prefixcache[replay]" in done.stdout


SERVE_AND_USE = textwrap.dedent("""
    import sys, torch
    from prefixcache.config import KVLayout
    from prefixcache.client import CacheClient
    from prefixcache_services.cli import build_parser, main
    from prefixcache_services.cache_server.command import options_from
    from prefixcache_services.cache_server.server import build_server

    argv = ["serve", "--listen", "127.0.0.1:0", "--host-capacity", "8Mi", "--metrics-port", "0", "--block-size", "4"]
    server = build_server(options_from(build_parser(argv).parse_args(argv)))
    try:
        layout = KVLayout(2, 2, 8, 4, "float32")
        with CacheClient(server.address) as client:
            client.attach("light", layout)
            tokens = list(range(100, 112))
            client.store(tokens, torch.ones(3, *layout.block_shape))
            hit = client.lookup(tokens)
            assert hit.blocks == 3 and float(client.read(hit).sum()) == 3 * 2 * 2 * 2 * 4 * 8
            client.release(hit)
        code = main(["stats", "--cache", server.address, "--json"])
    finally:
        server.shutdown(0.5)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("LOADED", loaded, "CODE", code, file=sys.stderr)
""")


def test_a_running_service_its_client_and_stats_need_none_of_them():
    script = BLOCKER.split("import prefixcache.client")[0] + SERVE_AND_USE
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert "LOADED [] CODE 0" in done.stderr, done.stderr[-3000:]
    assert json.loads(done.stdout)["blocks"]["committed"] == 3
