"""The `prefixcache` command: the composition root.

Each subcommand lives beside the service it drives and exposes
`register(subparsers)`, which adds its parser and sets `handler`. This module
only assembles them, configures logging, and turns the library's typed errors
into one-line messages with a non-zero exit code (never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# torch's OpenMP threads busy-wait by default, which collapses when the service,
# workers and clients share a few cores; it must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from prefixcache.errors import PrefixCacheError

# (module, what it provides) in the order `--help` lists them.
COMMAND_MODULES = (
    "services.cache_server.command",   # serve
    "services.cache_server.shm_command",  # shm list, shm clean
    "services.worker.command",         # worker
    "services.admin.commands",         # stats, top, inspect, evict, flush
    "services.replay.command",         # replay
    "services.demo",                   # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixcache",
        description="Cross-request prompt/prefix KV cache for LLM inference.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `prefixcache COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name and name.startswith(error.name):
                continue  # that part is not built into this checkout
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (PrefixCacheError, OSError) as error:
        print(f"prefixcache {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
