"""Two reference workers under multi-turn load: round-robin, round-robin + prefixcache, `prefixcache route`.

    PYTHONPATH=$PWD python benchmarks/fleet_bench.py [--conversations 8] [--turns 6] [--users 4]
        [--system-words 100] [--user-words 200] [--max-tokens 4] [--think-ms 300] [--json-out FILE]

One schedule, three configurations in one run (issue 36):

  rr-nocache   two `prefixcache worker --no-cache`, round-robin per request (one global counter)
  rr-cache     two workers, each with its OWN cache service (host tier, no Redis: nothing is shared
               between the engines), round-robin per request
  router       the same two workers and services behind `prefixcache route`

Each configuration sends its name as `cache_salt`: the same prompts, but none of rr-cache's blocks
serves the router's run (both start cold).

The schedule: `--conversations` synthetic chats behind one shared system prompt; each turn resends
the whole history plus a new user message, the assistant turns are fixed text (the prompts do not
depend on what the model says; with the defaults the history outgrows the system prompt from the
second turn, prompts reach ~2.3k tokens by the sixth); `--users` concurrent users each take the
next conversation and play its turns in order, `--think-ms` apart on average (drawn 0.2-1.8x,
seeded: the worker's store of a turn lands in the background, a user reading the answer gives it
that time; without the spread four users in step would make a global round-robin counter send
each conversation to the same engine every turn, which is stickiness, not round-robin). Greedy,
streaming, the tiny model, `--max-tokens` 4 by default: the reference worker serves one request
at a time, so a long decode queued ahead of a request adds the same wait under any routing and
hides what routing changes (vLLM's batching does not queue decodes that way).

Reported per configuration: TTFT p50/p99 (request sent to first streamed text, at the client), ITL
p50/p99 (gaps between streamed chunks with text), requests/s and prompt tokens/s over the
configuration's wall time, the token hit share (`usage.prompt_tokens_details.cached_tokens` over
prompt tokens), requests per engine; for the router also its predicted TTFT (the
`X-Prefixcache-Predicted-Ttft-Ms` header) against the observed one: medians and the median of the
per-request ratio. Targets: router TTFT p50 <= 0.7x rr-cache's; predicted median within 25% of the
observed median. Exit status 1 when a target is missed. The machine is shared and noisy: compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks.stream_result import StreamResult  # noqa: E402

SEED = 20261203
CONFIGS = ("rr-nocache", "rr-cache", "router")
TITLES = {
    "rr-nocache": "round-robin, no cache",
    "rr-cache": "round-robin + prefixcache (a service per engine)",
    "router": "prefixcache route + prefixcache",
}
TARGET_P50_RATIO = 0.7
TARGET_PREDICTION_ERROR = 0.25
WORDS = (
    "cache prefix token engine router block tier memory request answer model shard replica queue latency "
    "context prompt history session turn batch stream decode prefill kernel vector index tensor layer "
    "handbook policy section clause customer order invoice refund shipment warehouse ticket status"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def schedule(args: argparse.Namespace) -> list[list[list[dict]]]:
    """Per conversation, the message list of each turn (seeded: the same for every configuration)."""
    rng = random.Random(SEED)
    system = {"role": "system", "content": "You are the support assistant. " + text(rng, args.system_words)}
    chats = []
    for number in range(args.conversations):
        history: list[dict] = [system]
        turns = []
        for turn in range(args.turns):
            words = max(4, int(args.user_words * rng.uniform(0.6, 1.4)))
            history.append({"role": "user", "content": f"Customer {number}, turn {turn}: " + text(rng, words)})
            turns.append(list(history))
            history.append({"role": "assistant", "content": text(rng, max(4, args.user_words // 2))})
        chats.append(turns)
    return chats


@dataclass
class Result(StreamResult):
    engine: str | None = None
    predicted_s: float | None = None
    predicted_hit_tokens: int | None = None


def stream(port: int, messages: list[dict], max_tokens: int, salt: str | None = None) -> Result:
    body = {
        "messages": messages,
        **({"cache_salt": salt} if salt else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    result = Result()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        result.started = time.perf_counter()
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        result.engine = response.getheader("X-Prefixcache-Engine") or f"127.0.0.1:{port}"
        predicted = response.getheader("X-Prefixcache-Predicted-Ttft-Ms")
        result.predicted_s = None if predicted is None else float(predicted) / 1000.0
        hit = response.getheader("X-Prefixcache-Hit-Tokens")
        result.predicted_hit_tokens = None if hit is None else int(hit)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return result
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            result.observe(json.loads(line[len("data: ") :]))
    except (OSError, http.client.HTTPException) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    result.finish()
    return result


def drive(
    ports: list[int], chats: list[list[list[dict]]], args: argparse.Namespace, salt: str
) -> tuple[list[Result], float]:
    """`--users` threads, each playing whole conversations; one round-robin counter over `ports`.

    `salt` (the configuration's name, as `cache_salt`) keeps each configuration's cache cold to
    the others' on the same services, with the prompts unchanged."""
    pending = list(range(len(chats)))
    rng = random.Random(SEED + 1)
    thinks = [[args.think_ms / 1000.0 * rng.uniform(0.2, 1.8) for _ in chat] for chat in chats]
    lock = threading.Lock()
    counter = 0
    results: list[Result] = []

    def user() -> None:
        nonlocal counter
        while True:
            with lock:
                if not pending:
                    return
                number = pending.pop(0)
            for position, messages in enumerate(chats[number]):
                if position:
                    time.sleep(thinks[number][position])
                with lock:
                    port, counter = ports[counter % len(ports)], counter + 1
                result = stream(port, messages, args.max_tokens, salt)
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=user) for _ in range(args.users)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarise(name: str, results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    gaps = [g * 1000 for r in ok for g in r.gaps_s]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    engines: dict[str, int] = {}
    for r in ok:
        engines[r.engine or "?"] = engines.get(r.engine or "?", 0) + 1
    row = {
        "config": name,
        "title": TITLES[name],
        "requests": len(results),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": {
            "p50": pct(ttft, 50),
            "p99": pct(ttft, 99),
            "mean": statistics.fmean(ttft) if ttft else float("nan"),
        },
        "itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s,
        "prompt_tokens_per_s": prompt / wall_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_share": cached / prompt if prompt else 0.0,
        "requests_per_engine": dict(sorted(engines.items())),
    }
    pairs = [(r.predicted_s * 1000, r.ttft_s * 1000) for r in ok if r.predicted_s is not None and r.ttft_s]
    if pairs:
        predicted_median = statistics.median(p for p, _ in pairs)
        observed_median = statistics.median(o for _, o in pairs)
        row["prediction"] = {
            "predicted_median_ms": predicted_median,
            "observed_median_ms": observed_median,
            "median_error": abs(predicted_median - observed_median) / observed_median,
            "median_ratio": statistics.median(p / o for p, o in pairs),
            "matched_tokens": sum(r.predicted_hit_tokens or 0 for r in ok),
        }
    return row


def warm(ports: list[int]) -> None:
    """First-request costs (kernels, connections) paid outside the measurement, on a prompt shared with nothing."""
    for port in ports:
        stream(port, [{"role": "user", "content": "warm up " * 30}], 2)


def run_all(args: argparse.Namespace, work: Path) -> list[dict]:
    from tests.support.worker_procs import CacheService, RouterProcess, WorkerProcess, start_all, stop_all

    chats = schedule(args)
    rows: list[dict] = []
    chosen = args.configs.split(",")
    cached = bool({"rr-cache", "router"} & set(chosen))
    services = [
        CacheService(work / f"service-{i}", host_capacity=args.host_capacity) for i in range(2 if cached else 0)
    ]
    plain = [WorkerProcess(work / f"plain-{i}", None) for i in range(2 if "rr-nocache" in chosen else 0)]
    router = None
    workers: list = []
    try:
        for service in services:
            service.start()
        workers = [WorkerProcess(work / f"cached-{i}", service) for i, service in enumerate(services)]
        start_all(plain + workers)  # the four model loads overlap
        warm([w.port for w in plain + workers])
        if plain:
            results, wall_s = drive([w.port for w in plain], chats, args, "rr-nocache")
            rows.append(summarise("rr-nocache", results, wall_s))
            report_progress(rows[-1])
            stop_all(plain)  # idle from here on, but out of the way
        if "rr-cache" in chosen:
            results, wall_s = drive([w.port for w in workers], chats, args, "rr-cache")
            rows.append(summarise("rr-cache", results, wall_s))
            report_progress(rows[-1])
        if "router" in chosen:
            router = RouterProcess(work / "router", list(zip(workers, services, strict=True)), args.router_args)
            router.start()
            deadline = time.monotonic() + 60
            while not _engines_ready(router):
                if time.monotonic() > deadline:
                    raise SystemExit("the router never saw both engines healthy")
                time.sleep(0.2)
            results, wall_s = drive([router.port], chats, args, "router")
            rows.append(summarise("router", results, wall_s))
            rows[-1]["router_metrics"] = router_metrics(router)
            report_progress(rows[-1])
    finally:
        if router is not None:
            router.stop()
        stop_all(plain + workers)
        for service in services:
            service.stop()
    return rows


def router_metrics(router) -> dict:
    """What the router learned and decided: its /metrics, the families a reader of the run needs."""
    wanted = {
        "prefixcache_router_decisions_total": "decisions",
        "prefixcache_router_prefill_tokens_per_second": "prefill_tokens_per_s",
        "prefixcache_router_ttft_overhead_seconds": "ttft_overhead_s",
        "prefixcache_router_failovers_total": "failovers",
    }
    out: dict = {name: {} for name in wanted.values()}
    for (sample, labels), value in router.client.metrics().items():
        if sample in wanted:
            out[wanted[sample]]["/".join(v for _, v in labels)] = value
    return out


def _engines_ready(router) -> bool:
    try:
        status, data, _ = router.client.request("GET", "/health")
    except OSError:
        return False
    return status == 200 and all(e["healthy"] for e in json.loads(data)["engines"])


def report_progress(row: dict) -> None:
    print(
        f"{row['config']}: {row['requests']} requests, TTFT p50 {row['ttft_ms']['p50']:.0f} ms, "
        f"hit share {row['hit_share']:.1%}, errors {row['errors'] or 'none'}",
        flush=True,
    )


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["config"] == "rr-cache"), None)
    lines = [
        "| config | TTFT p50 / p99 ms | ITL p50 / p99 ms | req/s | prompt tok/s | hit share | requests per engine "
        "| vs rr-cache p50 | predicted / observed TTFT median ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        versus = "—" if ref is None or r is ref else f"{t['p50'] / ref['ttft_ms']['p50']:.2f}x"
        prediction = r.get("prediction")
        predicted = (
            "—"
            if prediction is None
            else f"{prediction['predicted_median_ms']:.0f} / {prediction['observed_median_ms']:.0f} "
            f"({prediction['median_error']:.0%} off)"
        )
        split = " / ".join(str(n) for n in r["requests_per_engine"].values())
        lines.append(
            f"| {r['config']}: {r['title']} | {t['p50']:.0f} / {t['p99']:.0f} | {i['p50']:.1f} / {i['p99']:.1f} "
            f"| {r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | {r['hit_share']:.1%} | {split} "
            f"| {versus} | {predicted} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict]) -> dict:
    by = {r["config"]: r for r in rows}
    out: dict = {}
    if "router" in by and "rr-cache" in by:
        out["router_p50_vs_rr_cache"] = by["router"]["ttft_ms"]["p50"] / by["rr-cache"]["ttft_ms"]["p50"]
        out["p50_target_met"] = out["router_p50_vs_rr_cache"] <= TARGET_P50_RATIO
    if "router" in by and "prediction" in by["router"]:
        out["prediction_error"] = by["router"]["prediction"]["median_error"]
        out["prediction_target_met"] = out["prediction_error"] <= TARGET_PREDICTION_ERROR
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ",".join(CONFIGS))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=100)
    parser.add_argument("--user-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=300.0)
    parser.add_argument("--host-capacity", default="512MiB")
    parser.add_argument("--router-arg", dest="router_args", action="append", default=[], help="passed to route")
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    for name in ("conversations", "turns", "users", "max_tokens", "system_words", "user_words"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.think_ms < 0:
        parser.error("--think-ms must be >= 0")
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        rows = run_all(args, Path(tmp))
    report = {"args": vars(args), "rows": rows, "verdict": verdict(rows)}
    print(table(rows))
    print(json.dumps(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    missed = [k for k, v in report["verdict"].items() if k.endswith("_met") and not v]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
