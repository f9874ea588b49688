"""`prefixcache worker`: the reference inference worker (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from prometheus_client import CollectorRegistry

from prefixcache.config import MODEL_DTYPES, parse_duration
from prefixcache.errors import ConfigError

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  prefixcache worker                                   # tiny model, cache at 127.0.0.1:50051
  prefixcache worker --no-cache --listen 127.0.0.1:8001
  prefixcache worker --model /models/Qwen2.5-0.5B-Instruct --dtype bfloat16 --cache 10.0.0.5:50051
  curl -s localhost:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"hi"}],"temperature":0}'
"""


def split_address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{flag} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="serve a model over an OpenAI-compatible HTTP API, using the cache",
        description="Reference inference worker: skips prefill on exact-prefix cache hits; outputs are "
        "identical to running without the cache.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        type=lambda v: split_address(v, "--listen"),
        help="HOST:PORT for HTTP (default 127.0.0.1:8000)",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cache", default="127.0.0.1:50051", help="cache service HOST:PORT (default %(default)s)")
    cache.add_argument("--no-cache", action="store_true", help="never use the cache (the A/B baseline)")
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (built-in, seeded random weights) or a local checkpoint directory (default %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=[d.value for d in MODEL_DTYPES],
        help="model and KV dtype (default bfloat16: cached == recomputed bit for bit on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed of the tiny model (default 0)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per cached block (default 16): a multiple of the cache service's --block-size",
    )
    parser.add_argument(
        "--cache-deadline-ms",
        type=float,
        default=500.0,
        help="deadline of each cache call; past it the request prefills in full (default 500)",
    )
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("PREFIXCACHE_AUTH_TOKEN"),
        help="bearer token for the cache service (or env PREFIXCACHE_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the HTTP API (/health and /metrics stay open; "
        "or env PREFIXCACHE_API_KEY)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs available)")
    parser.add_argument(
        "--hit-policy",
        choices=["auto", "always"],
        default="auto",
        help="auto: load a cached prefix only when that is estimated faster than recomputing it "
        "(default); always: load every usable cached block (deterministic reuse, e.g. tests)",
    )
    parser.add_argument(
        "--no-onednn",
        action="store_true",
        help="CPU: run without oneDNN (per-shape kernel cache); bfloat16 prefill is ~2-3x slower. "
        "Rarely needed: prefill buckets already bound that cache",
    )
    parser.add_argument(
        "--no-prefill-buckets",
        action="store_true",
        help="bfloat16 on CPU: do not pad prefills to a bounded set of lengths (~6%% more prefill "
        "compute, same outputs); oneDNN then keeps ~2.6 MiB of kernels per distinct length",
    )
    parser.set_defaults(handler=run)


def build_backend(args):
    from .backend import InferenceBackend
    from .cache_link import WorkerLink
    from .compat import UnsupportedModelError
    from .engine import Engine
    from .hit_policy import HitPolicy
    from .model import configure_torch_threads, load_model

    configure_torch_threads(args.threads)
    if args.no_onednn:
        import torch

        # oneDNN keeps compiled kernels per matmul shape (~2.6 MiB each); prefill buckets bound
        # the shapes, this drops oneDNN altogether (docs/deploy.md, "Worker memory on CPU").
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # torch's ContextProp: sets the flag
    try:
        loaded = load_model(args.model, dtype=args.dtype, seed=args.seed)
    except UnsupportedModelError as error:  # sliding-window, hybrid, latent KV... (compat.py)
        raise ConfigError("model", f"{args.model} cannot use the prefix cache: {error}") from None
    except ValueError as error:  # an unknown spec or a broken checkpoint: one line, not a traceback
        raise ConfigError("model", str(error)) from None
    # None: pad where it bounds memory (bfloat16 on CPU with oneDNN, engine.buckets_bound_memory).
    engine = Engine(loaded, prefill_buckets=False if args.no_prefill_buckets else None)
    log.info("prefill buckets: %s", "on" if engine.prefill_buckets else "off")
    from ..cache_server.metrics import add_process_collectors

    registry = CollectorRegistry()
    add_process_collectors(registry)  # process_*, python_info, python_gc_*
    link = None
    if not args.no_cache:
        policy = HitPolicy(registry, always_take=args.hit_policy == "always")
        policy.calibrate(engine)  # measured prefill cost before the first request's load-or-recompute decision
        link = WorkerLink(
            args.cache,
            loaded,
            args.block_size,
            parse_duration(args.cache_deadline_ms / 1000.0),
            registry,
            auth_token=args.auth_token,
            policy=policy,
        )
        link.connect()  # best effort: a service that is down now is retried on later requests
    return InferenceBackend(engine, link, registry)


def run(args) -> int:
    from .http import WorkerApp, run_app

    backend = build_backend(args)
    host, port = args.listen
    app = WorkerApp(backend, api_key=args.api_key)

    async def main() -> None:
        task = asyncio.ensure_future(run_app(app, host, port))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("worker stopping")

    asyncio.run(main())
    if backend.stores is not None:
        backend.stores.close()  # the stores already queued, bounded in time
    if backend.cache is not None:
        backend.cache.close()
    return 0
