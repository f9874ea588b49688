"""`prefixcache route`: the prefix-aware OpenAI router in front of N engines (CLI)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  prefixcache route --listen 0.0.0.0:8080 \\
      --engine http://10.0.0.11:8000=10.0.0.11:50051 --engine http://10.0.0.12:8000=10.0.0.12:50051
  prefixcache route --engine http://vllm-a:8000=cache-a:50051 --engine http://vllm-b:8000=cache-b:50051 \\
      --tokenizer /models/Qwen2.5-0.5B-Instruct --tier-rates host=3e6,redis=4e5
  prefixcache route --listen 0.0.0.0:8080 --discover http://prefixcache-pods:8000=50051   # Kubernetes
  curl -s localhost:8080/metrics | grep prefixcache_router_decisions
"""


def split_address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{flag} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def parse_engine(value: str) -> tuple[str, str | None]:
    """`URL[=CACHE_HOST:PORT]` -> (url, cache address or None)."""
    url, sep, cache = value.partition("=")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r}: expected URL[=CACHE_HOST:PORT] with an http:// or https:// URL")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: the URL's port is not a number in 0-65535") from None
    if sep:
        try:
            split_address(cache, "--engine")
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{value!r}: the cache service after '=' must be HOST:PORT, got {cache!r}"
            ) from None
        return url, cache
    return url, None


def parse_discover(value: str) -> tuple[str, int | None]:
    """`URL[=CACHE_PORT]` -> (url, cache port or None)."""
    url, sep, port = value.partition("=")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r}: expected URL[=CACHE_PORT] with an http:// or https:// URL")
    if not sep:
        return url, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: the cache port after '=' must be 1-65535, got {port!r}")
    return url, int(port)


def positive(flag: str, unit: str):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number of {unit}, got {value!r}") from None
        if not 0 < number < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be > 0, got {value!r}")
        return number

    return parse


def tier_rates(value: str):
    from .scoring import TierRates

    try:
        return TierRates.parse(value, flag="")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "route",
        help="route OpenAI requests to the engine where the prompt's prefix is cheapest",
        description="An OpenAI-compatible HTTP router in front of N engines (reference workers or vLLM "
        "servers), each with its cache service. Each request goes to the engine with the lowest expected "
        "TTFT: the tokens left to prefill after that engine's cached prefix (one Match per engine, "
        "concurrently, under --match-timeout-ms) at the engine's learned prefill rate, plus the hit's "
        "transfer time from its tier, plus the engine's queue. The conversation's previous engine wins "
        "ties. Engines failing /health are skipped; a request whose engine fails before the first byte "
        "goes to the next one; a started stream is never retried.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        type=lambda v: split_address(v, "--listen"),
        help="HOST:PORT for HTTP (default 127.0.0.1:8080; port 0 picks a free one)",
    )
    parser.add_argument(
        "--engine",
        action="append",
        type=parse_engine,
        metavar="URL[=CACHE]",
        help="an engine's base URL, and its cache service HOST:PORT after '=' (without one: always a miss); "
        "repeat for each engine",
    )
    parser.add_argument(
        "--discover",
        action="append",
        type=parse_discover,
        metavar="URL[=CACHE_PORT]",
        help="every address the URL's host name resolves to is an engine at the URL's port, with its cache "
        "service at CACHE_PORT on the same address; re-resolved at each health check (a Kubernetes headless "
        "Service); repeatable",
    )
    parser.add_argument(
        "--tokenizer",
        default="tiny",
        help="the engines' tokenizer: 'tiny' (the reference worker's cl100k) or a local checkpoint "
        "directory (default %(default)s)",
    )
    parser.add_argument(
        "--namespace", default=None, metavar="ID", help="the namespace to Match in (default: each cache's fullest)"
    )
    parser.add_argument(
        "--match-timeout-ms",
        type=positive("--match-timeout-ms", "milliseconds"),
        default=50.0,
        help="deadline of each Match; a late one is scored as a miss (default %(default)s)",
    )
    parser.add_argument(
        "--health-interval-ms",
        type=positive("--health-interval-ms", "milliseconds"),
        default=2000.0,
        help="period of the engines' /health checks (default %(default)s)",
    )
    parser.add_argument(
        "--tier-rates",
        type=tier_rates,
        default="device=2e7,host=2e6,disk=1e6,redis=2e5",
        help="tokens/s moved into an engine from each tier (default %(default)s)",
    )
    parser.add_argument(
        "--initial-prefill-rate",
        type=positive("--initial-prefill-rate", "tokens per second"),
        default=4000.0,
        help="prefill tokens/s assumed until an engine's rate is measured (default %(default)s)",
    )
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("PREFIXCACHE_AUTH_TOKEN"),
        help="bearer token for the cache services (or env PREFIXCACHE_AUTH_TOKEN)",
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    from prefixcache.errors import ConfigError

    from .http import RouterApp, RouterSettings, run_router
    from .prompts import PromptTokenizer

    if not args.engine and not args.discover:
        raise ConfigError("--engine", "give at least one engine: --engine URL[=CACHE_HOST:PORT] (or --discover)")
    names = [url.rstrip("/") for url, _ in args.engine or []]
    if len(set(names)) != len(names):
        raise ConfigError(
            "--engine", f"an engine URL is given twice: {sorted(n for n in names if names.count(n) > 1)[0]}"
        )
    try:
        tokenizer = PromptTokenizer(args.tokenizer)
    except ValueError as error:
        raise ConfigError("--tokenizer", str(error)) from None
    settings = RouterSettings(
        match_timeout_s=args.match_timeout_ms / 1000.0,
        health_interval_s=args.health_interval_ms / 1000.0,
        tier_rates=args.tier_rates,
        initial_prefill_rate=args.initial_prefill_rate,
    )
    app = RouterApp(
        args.engine or [],
        tokenizer,
        settings,
        namespace=args.namespace,
        cache_auth_token=args.auth_token,
        discover=args.discover,
    )
    host, port = args.listen

    async def main() -> None:
        task = asyncio.ensure_future(run_router(app, host, port))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("router stopping")

    asyncio.run(main())
    return 0
