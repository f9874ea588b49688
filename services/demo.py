"""`prefixcache demo`: the main job on one machine — cache on vs. off, with an output check.

Starts the cache service, a worker that uses it and a worker that does not (the built-in
tiny model, CPU, no Redis, no GPU) as local subprocesses on free loopback ports, replays a
ShareGPT sample in the shape of the use case against both, prints the savings table, the
paired headline and the output check, and stops the processes on every path (Ctrl-C and
SIGTERM too).

The workload: multi-turn ShareGPT conversations behind a shared system prompt of ~1k tokens
(services/replay/system_prompt.py), as a chat product sends; one conversation in four has none
(a direct API user), so first turns without a shared prefix are in the sample too. Each turn
goes to both workers back to back, the first alternating (runner.run_interleaved), so load from
elsewhere on the machine hits a request and its no-cache twin alike; the headline compares each
request with its twin.

Exit status: 0 when the replay succeeded and the greedy outputs with and without the cache
are identical; 1 when they differ or nothing succeeded; 2 when the processes cannot start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from .replay.command import add_system_prompt, positive_int
from .replay.local_stack import LocalStack, StackError
from .replay.report_table import print_report
from .replay.runner import RunOptions, Target
from .replay.schedule import ScheduleConfig
from .replay.session import ReplayOptions, exit_code, plan, run_chat, write_outputs
from .replay.system_prompt import BUILTIN
from .replay.system_prompt import resolve as resolve_system_prompt
from .replay.workload import WorkloadSpec

MODEL = "prefixcache-tiny-llama"  # the worker's built-in model
EXAMPLES = """examples:
  prefixcache demo                              # 20 ShareGPT conversations, ~1-2 minutes on 2 CPU cores
  prefixcache demo --conversations 20 --json demo.json --plots demo-plots/
  prefixcache demo --system-prompt none --sequential   # no shared prefix; the cache run, then the other
"""
SYSTEM_PROMPT_SHARE = 0.75  # of the conversations, the rest as direct API use (no system prompt)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="start a cache service and two workers locally, replay ShareGPT with and without the cache",
        description="The main job on one machine: cache service + a cached worker + a cache-less worker "
        "(built-in tiny model, CPU), ShareGPT conversations behind a shared system prompt sent to both "
        "(each turn to one, then the other), the paired savings and the "
        "output check (greedy outputs must be identical).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--conversations", type=positive_int, default=20, help="ShareGPT conversations to replay (default %(default)s)")
    add("--max-turns", type=positive_int, default=4, help="turns per conversation (default %(default)s)")
    add("--max-prompt-tokens", type=positive_int, default=2560, help="prompt token cap (default %(default)s)")
    add("--max-tokens", type=positive_int, default=16, help="tokens generated per turn (default %(default)s)")
    add_system_prompt(parser, default=BUILTIN, share_default=SYSTEM_PROMPT_SHARE)
    add(
        "--sequential",
        action="store_true",
        help="replay the whole sample against the cached worker, then against the other (default: each "
        "turn to both, back to back)",
    )
    add(
        "--concurrency",
        type=positive_int,
        default=1,
        help="requests in flight (default %(default)s: the worker generates one request at a time, so more only "
        "adds queueing to TTFT)",
    )
    add("--seed", type=int, default=0, help="schedule seed (default %(default)s)")
    add(
        "--worker-threads",
        type=positive_int,
        default=None,
        help="torch threads per worker (default: all available cores; the A and B runs never overlap)",
    )
    add("--json", type=Path, default=None, help="write the report JSON here")
    add("--plots", type=Path, default=None, help="write the PNG plots into this directory")
    add(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the processes' logs here (default: a temporary directory, removed at exit)",
    )
    add("--startup-timeout", type=float, default=180.0, help="seconds to wait for the processes (default %(default)s)")
    add("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def _options(args: argparse.Namespace) -> ReplayOptions:
    workload = WorkloadSpec(
        conversations=args.conversations,
        max_turns=args.max_turns,
        max_prompt_tokens=args.max_prompt_tokens,
        system_prompt=resolve_system_prompt(args.system_prompt),
        system_prompt_share=args.system_prompt_share,
    )
    # A bounded run: the sample takes ~1 minute; the duration cap only guards against a hang.
    schedule = ScheduleConfig(concurrency=args.concurrency, duration_s=600.0, seed=args.seed)
    return ReplayOptions(
        workload,
        schedule,
        RunOptions(max_tokens=args.max_tokens, request_timeout_s=120.0, drain_s=60.0),
        interleave=not args.sequential,
    )


def _raise_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalStack.__exit__, which stops the children


def _start(stack: LocalStack, console: Console, threads: int | None) -> tuple[str, str, str]:
    """Service, cached worker, cache-less worker; returns (service address, cached URL, baseline URL)."""
    t0 = time.monotonic()
    deadline = stack.deadline()
    service = stack.start_service()
    address = stack.service_address(service, deadline)
    # Both workers load the model at the same time: start-up is mostly imports and model init.
    extra = ("--threads", str(threads)) if threads else ()
    cached, cached_url = stack.start_worker("worker-cache", address, extra)
    plain, plain_url = stack.start_worker("worker-no-cache", None, extra)
    stack.wait_healthy(cached, cached_url, deadline)
    stack.wait_healthy(plain, plain_url, deadline)
    console.print(
        f"started in {time.monotonic() - t0:.1f}s: cache service {address}, "
        f"worker with cache {cached_url}, worker without cache {plain_url}",
        highlight=False,
    )
    return address, cached_url, plain_url


def run(args: argparse.Namespace) -> int:
    console = Console()
    progress = None if args.no_progress else Console(stderr=True)
    try:
        options = _options(args)
    except ValueError as error:
        print(f"prefixcache demo: error: {error}", file=sys.stderr)
        return 2
    prepared = plan(options)  # the workload is loaded and planned before anything starts
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        with LocalStack(args.log_dir, startup_timeout_s=args.startup_timeout) as stack:
            address, cached_url, plain_url = _start(stack, console, args.worker_threads)
            report = run_chat(
                options,
                Target("cache", cached_url, MODEL),
                Target("no-cache", plain_url, MODEL),
                stats_address=address,
                console=progress,
                prepared=prepared,
            )
    except StackError as error:
        print(f"prefixcache demo: error: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report, console)
    write_outputs(report, args.json, args.plots, console)
    return exit_code(report)
