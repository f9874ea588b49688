"""What the connector costs vLLM's scheduler thread per request, next to a Lookup on that thread.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_scheduler_cost.py [--requests 200] [--tokens 2048]
        [--json-out FILE]

A real `prefixcache serve` holds the first 1,536 tokens of every prompt (stored once through the
client); the scheduler half of the connector (`SchedulerSide`, no engine) is driven the way
vLLM drives it, with vLLM's own `Request` objects:
- `on_new_request` (`started`): hands the Lookup to the lookup threads;
- `get_num_new_matched_tokens` while the Lookup is in flight and vLLM is busy (`None`);
- `get_num_new_matched_tokens` once answered (validation, policy: returns the hit, async);
- then the same requests again with the grace wait (`lookup_grace_s`, as after `--step-ms`
  steps): how often the first ask is answered (else vLLM skips the request for a step).
`lookup on the scheduler thread` is one Lookup RPC with a lease plus its Release, timed on the
calling thread: what every request cost the scheduler before the Lookups moved off it (the
connector up to 00e251e called it inside get_num_new_matched_tokens). Medians and p99 in
microseconds; the ratio is the new per-request total over the old. These phases read no
presence table (`presence_table: false`), as before it existed.

Last, the requests of sticky routing: vLLM's own prefix cache holds all the service does (the
1,536 tokens), with and without the service's presence table (prefixcache/presence.py): the
scheduler-thread time from `on_new_request` to the answer 0, the asks it took (each one more is
a step the request waited) and the Lookups sent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

BLOCK = 32


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=20.0, help="the last step's length for the grace phase")
    parser.add_argument("--json-out")
    args = parser.parse_args()

    import torch
    from service_process import start_service
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout, Namespace
    from prefixcache.integrations.vllm.config import ConnectorSettings
    from prefixcache.integrations.vllm.link import ConnectorLink
    from prefixcache.integrations.vllm.scheduler import SchedulerSide
    from prefixcache.integrations.vllm.stats import StatsBox

    layout = KVLayout(layers=8, kv_heads=4, head_dim=64, block_size=BLOCK, dtype="bfloat16")
    service, address = start_service("--host-capacity", "2GiB", "--block-size", str(BLOCK))
    try:
        base = {"cache": address, "hit_policy": "always", "lookup_timeout_s": 5.0}
        settings = ConnectorSettings.parse(base | {"presence_table": False})
        namespace = Namespace("cost-bench", "r1", layout)
        prompts = [[(i * 7919 + j) % 30000 + 1 for j in range(args.tokens)] for i in range(args.requests)]
        writer = CacheClient(address)
        writer.attach(namespace.model, layout, namespace.revision)
        cached = 1536 // BLOCK
        for prompt in prompts:
            writer.store(prompt[: cached * BLOCK], torch.zeros((cached, *layout.block_shape), dtype=torch.bfloat16))
        scheduler = SchedulerSide(ConnectorLink(settings, namespace, "scheduler"), StatsBox(), BLOCK)
        scheduler._step_tokens = 8  # as while vLLM steps other requests (a decode step)
        params = SamplingParams(max_tokens=1)
        started, pending, answered, hits = [], [], [], 0
        first_ask: dict[str, list[float]] = {"without grace": [], "with grace": []}  # 1: answered at once
        for phase, step_s in (("without grace", 0.0), ("with grace", args.step_ms / 1000)):
            requests = [Request(f"{phase}-{i}", p, params, None) for i, p in enumerate(prompts)]
            for request in requests:
                scheduler._last_step_s, scheduler._grace_left = step_s, settings.lookup_grace_s  # a new step
                t = time.perf_counter()
                scheduler.started(request)
                if step_s == 0:
                    started.append(time.perf_counter() - t)
                asks = 0
                while True:
                    t = time.perf_counter()
                    tokens, _ = scheduler.match(request, 0)
                    spent = time.perf_counter() - t
                    asks += 1
                    if tokens is None:
                        if step_s == 0:
                            pending.append(spent)
                        time.sleep(0.0005)  # the next scheduler step
                        continue
                    if step_s == 0:
                        answered.append(spent)
                        hits += tokens > 0
                    first_ask[phase].append(float(asks == 1))
                    break
                scheduler.finished(request)  # releases the lease (as vLLM would after the load)
        grace = scheduler.stats.totals
        client, _ = scheduler.link.client() or (None, None)
        assert client is not None
        rpc = []
        for prompt in prompts:
            t = time.perf_counter()
            hit = client.lookup(prompt, take_lease=True)
            client.release(hit)
            rpc.append(time.perf_counter() - t)
        scheduler.close()
        sticky: dict[str, dict[str, float]] = {}
        for name, presence in (("Lookup", False), ("presence table", True)):
            sticky[name] = _held_locally(
                SchedulerSide(
                    ConnectorLink(ConnectorSettings.parse(base | {"presence_table": presence}), namespace, "scheduler"),
                    StatsBox(),
                    BLOCK,
                ),
                [Request(f"sticky-{name}-{i}", p, params, None) for i, p in enumerate(prompts)],
                cached * BLOCK,
            )
    finally:
        service.terminate()
        service.wait(30)
    polls = len(pending) / len(prompts)
    new_total = statistics.median(started) + polls * statistics.median(pending) + statistics.median(answered)
    summary = {
        "requests": len(prompts),
        "prompt_tokens": args.tokens,
        "hits": hits,
        "us": {
            "on_new_request": (1e6 * statistics.median(started), 1e6 * _p(started, 0.99)),
            "match while in flight": (1e6 * statistics.median(pending), 1e6 * _p(pending, 0.99)),
            "match once answered": (1e6 * statistics.median(answered), 1e6 * _p(answered, 0.99)),
            "lookup on the scheduler thread (before)": (1e6 * statistics.median(rpc), 1e6 * _p(rpc, 0.99)),
        },
        "polls_per_request": polls,
        "answered_at_first_ask": {phase: statistics.fmean(v) for phase, v in first_ask.items()},
        "grace_wait_us_per_request": 1e6 * grace.get("lookup_grace_seconds", 0.0) / len(prompts),
        "new_over_old_per_request": new_total / statistics.median(rpc),
        "held_by_vllm": sticky,
    }
    print("| scheduler-thread work | median us | p99 us |\n|---|---:|---:|")
    for name, (median, p99) in summary["us"].items():
        print(f"| {name} | {median:.1f} | {p99:.1f} |")
    print(
        f"\n{hits}/{len(prompts)} hits; {polls:.2f} in-flight polls a request; per request "
        f"{new_total * 1e6:.1f} us now vs {1e6 * statistics.median(rpc):.1f} us before "
        f"({summary['new_over_old_per_request']:.3f}x)"
    )
    shares = summary["answered_at_first_ask"]
    print(
        f"answered at the first ask (else the request waits a step): {shares['without grace']:.0%} without "
        f"grace, {shares['with grace']:.0%} with lookup_grace_s {settings.lookup_grace_s * 1000:g} ms "
        f"({args.step_ms:g} ms steps), waiting {summary['grace_wait_us_per_request']:.0f} us a request"
    )
    print(
        "\n| vLLM holds all the service does | scheduler-thread us per request, median / p99 "
        "| asks per request | Lookups sent |\n|---|---:|---:|---:|"
    )
    for name, row in sticky.items():
        print(f"| {name} | {row['us_p50']:.1f} / {row['us_p99']:.1f} | {row['asks']:.2f} | {row['lookups']:.0f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


def _held_locally(scheduler, requests: list, local: int) -> dict[str, float]:
    """Each request from `on_new_request` to its answer while vLLM's own prefix is `local` tokens
    and vLLM steps others (20 ms steps, 0.5 ms apart here): the scheduler-thread time per request
    (its hooks and waits, not the steps between), its asks, and the Lookups sent."""
    scheduler.link.client()  # attached, as the connector is at start
    per_request, asks = [], 0
    for request in requests:
        scheduler._step_tokens, scheduler._last_step_s = 8, 0.02
        spent, t = 0.0, time.perf_counter()
        scheduler.started(request)
        while True:
            asks += 1
            scheduler._grace_left = scheduler.settings.lookup_grace_s  # each ask in a step of its own
            tokens, _ = scheduler.match(request, local)
            spent += time.perf_counter() - t
            if tokens is not None:
                break
            time.sleep(0.0005)  # the step the request waits
            t = time.perf_counter()
        assert tokens == 0, tokens
        per_request.append(spent)
        scheduler.finished(request)
    time.sleep(0.2)  # the last Lookups answer (and count)
    lookups = scheduler.stats.totals.get("lookups", 0)
    scheduler.close()
    return {
        "us_p50": 1e6 * statistics.median(per_request),
        "us_p99": 1e6 * _p(per_request, 0.99),
        "asks": asks / len(requests),
        "lookups": float(lookups),
    }


if __name__ == "__main__":
    main()
