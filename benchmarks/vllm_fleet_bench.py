"""A fleet of vLLM OpenAI servers under multi-turn load, with and without prefixcache (issue #31).

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_fleet_bench.py [--configs 1,2,3,3s,4,5]
        [--kv-pressure] [--service-mib 2048] [--before-root DIR [--before-services]] [--rounds 1] [--conversations 8]
        [--turns 3] [--users 3] [--min-turns 0] [--spill 2] [--think-ms 0] [--layers 4 --hidden 512] [--json-out FILE]

Every configuration replays the SAME schedule: `--conversations` synthetic chats behind one
shared system prompt (each turn resends every earlier turn plus a new user message; the
assistant turns are fixed text, so the prompts do not depend on what the model says), driven by
`--users` concurrent users, each taking the next conversation and playing its turns in order
(`--by-turn`: the next turn of any conversation, all first turns before any second turn, so
every conversation stays live and a server's own cache must hold them all between turns);
greedy, streaming. Users send each request the moment they may (a closed loop), or after a
pause (`--think-ms`: exponential, its mean in ms, drawn per turn so every configuration gets the
same). `--min-turns N` gives each conversation between N and `--turns` turns, drawn at random,
as real chats vary, so a server that keeps its conversations (sticky routing) can be left with
the long ones while the other idles. Each server is first warmed with `--users`
prompts of a first turn's length that share nothing with the schedule. Configurations (fresh
servers, services and Redis for each):

  1   one server, no prefix caching          2   one server, vLLM APC
  2p  as 2 with prefixcache, the server on core 0 and its service on the other cores: the
      connector's cost when the cache does not share the engine's core (2 is its baseline)
  3   two servers, APC, round-robin per request (one global counter)
  3s  two servers, APC, sticky by conversation (what operators deploy without a cache service),
      conversations dealt to the servers in turn as they start: every server gets every other one
  3h  as 3s, the server chosen by a hash of the conversation id (a load balancer's hash or
      consistent-hash affinity): no server knows how many live conversations the other has
  3l  two servers, APC, each request to the server with the fewest requests in flight
  3a  two servers, APC, affinity with bounded load: a conversation starts on the server with the
      fewest requests in flight and stays there unless it has `--spill` more in flight than the
      other, when it moves there (and stays) -- the affinity a load balancer offers beside a cache
  4   two servers round-robin, APC + prefixcache on one service (host tier, --block-size 32)
  5   two servers round-robin, APC + prefixcache on two services sharing one redis-server
  6   (`--kv-pressure`) 3s, 4 and 4l (and 4s, 4a, 4r when chosen) again with a KV cache of
      `--pressure-mib` per server, so vLLM evicts

  4s  as 4, routed as 3s: the connector's cost with sticky routing's batches (3s its baseline)
  4l  as 4, routed as 3l: a free choice of server on every request, the cache service's point
  4a  as 4, routed as 3a: sticky while it is balanced, and a move costs a load, not a prefill
  4r  as 4, behind `prefixcache route` (Match on the service, each server's queue, the
      conversation's previous server on a tie), which every request goes through
  4b, 4sb, 5b (`--before-root DIR`) 4, 4s and 5 with the vLLM servers on PYTHONPATH=DIR: another
      checkout's connector (a "before"), in the same run; the services run from this tree, or with
      `--before-services` from DIR too (the whole "before": connector and services)
  4c, 4p  as 4 with the connector's `kv_role` kv_consumer (Lookups and loads, no saves) and
      kv_producer (saves, no Lookups): where the connector's cost per request comes from

Reported per configuration: TTFT p50/p90/p99, inter-token latency p50/p99 (gaps between
streamed chunks), requests/s and prompt tokens/s over the configuration's wall time, and the
cached-token share by source: vLLM's `usage.prompt_tokens_details.cached_tokens` counts both
its own prefix cache and the connector's tokens, the connector's own are the servers' /metrics
`vllm:prefixcache_external_tokens` delta; vLLM's own share is the difference. With `--rounds N`
every configuration is played N times, round by round, every other round in the reverse order
(A B, B A, A B: the order alone moved pooled figures by 5-10% when every round ran A B), and
its row pools the rounds' requests; each round's TTFT p50 is printed too, and the TTFT
percentiles without each round's opening burst (the first --users requests, sent at once to
fresh servers: in short rounds they alone make p99), and the JSON holds every request. Where
the time goes: each configuration's CPU per request by process (vLLM servers, services), the
connector's counters, and the CPU per request of every thread by process and OS thread name
(vLLM's model runner, scheduler and API server, the connector's `pfx-*` threads, the service's).
The machine is shared and noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from benchmarks.stream_result import StreamResult  # noqa: E402

BLOCK = 32  # vLLM's CPU attention backend wants multiples of 32
VOCAB = 512
SEED = 20261203
READY_S = 600.0
WARM_SETTLE_S = 2.0  # after the warm-up: its background work (the connector's saves) done
MAX_MODEL_LEN = 4096  # each server's --max-model-len: its KV cache must hold at least this many tokens
ALL_CONFIGS = (
    "1",
    "2",
    "2p",
    "3",
    "3s",
    "3h",
    "3l",
    "3a",
    "4",
    "4s",
    "4l",
    "4a",
    "4r",
    "4c",
    "4p",
    "5",
    "4b",
    "4sb",
    "5b",
)
BEFORE_CONFIGS = ("4b", "4sb", "5b")  # run on --before-root's connector
TITLES = {
    "1": "one server, no prefix caching",
    "2": "one server, vLLM APC",
    "2p": "one server, APC + prefixcache (host tier), the service on a core of its own",
    "3": "two servers, APC, round-robin",
    "3s": "two servers, APC, sticky by conversation",
    "3h": "two servers, APC, sticky by a hash of the conversation",
    "3l": "two servers, APC, least requests in flight",
    "3a": "two servers, APC, sticky unless the server is --spill requests busier",
    "4s": "sticky by conversation, APC + prefixcache (host tier)",
    "4a": "sticky unless --spill busier, APC + prefixcache (host tier)",
    "4l": "least requests in flight, APC + prefixcache (host tier)",
    "4r": "prefixcache route in front, APC + prefixcache (host tier)",
    "4": "round-robin, APC + prefixcache (host tier)",
    "4c": "round-robin, APC + prefixcache (host tier), kv_consumer: loads only",
    "4p": "round-robin, APC + prefixcache (host tier), kv_producer: saves only",
    "5": "round-robin, APC + prefixcache (2 services, one Redis)",
    "4b": "round-robin, APC + prefixcache (host tier), the --before-root connector",
    "4sb": "sticky by conversation, APC + prefixcache (host tier), the --before-root connector",
    "5b": "round-robin, APC + prefixcache (2 services, one Redis), the --before-root connector",
}


@dataclass(frozen=True)
class Config:
    name: str
    servers: int
    apc: bool
    routing: (
        str  # "rr" | "sticky" | "hash" | "least" (fewest requests in flight, ties round-robin)
        # | "affinity" (the conversation's server unless it has --spill more in flight) | "router" (prefixcache route)
    )
    cache: str | None  # None | "host" | "redis"
    kv_mib: int  # each vLLM server's KV cache (--kv-cache-memory-bytes)
    role: str = "kv_both"  # the connector's kv_role


def configs(args: argparse.Namespace) -> list[Config]:
    kv = args.kv_mib
    table = {
        "1": Config("1", 1, False, "rr", None, kv),
        "2": Config("2", 1, True, "rr", None, kv),
        "2p": Config("2p", 1, True, "rr", "host", kv),
        "3": Config("3", 2, True, "rr", None, kv),
        "3s": Config("3s", 2, True, "sticky", None, kv),
        "3h": Config("3h", 2, True, "hash", None, kv),
        "3l": Config("3l", 2, True, "least", None, kv),
        "3a": Config("3a", 2, True, "affinity", None, kv),
        "4s": Config("4s", 2, True, "sticky", "host", kv),
        "4l": Config("4l", 2, True, "least", "host", kv),
        "4a": Config("4a", 2, True, "affinity", "host", kv),
        "4r": Config("4r", 2, True, "router", "host", kv),
        "4": Config("4", 2, True, "rr", "host", kv),
        "4c": Config("4c", 2, True, "rr", "host", kv, "kv_consumer"),
        "4p": Config("4p", 2, True, "rr", "host", kv, "kv_producer"),
        "5": Config("5", 2, True, "rr", "redis", kv),
        "4b": Config("4b", 2, True, "rr", "host", kv),
        "4sb": Config("4sb", 2, True, "sticky", "host", kv),
        "5b": Config("5b", 2, True, "rr", "redis", kv),
    }
    names = args.configs.split(",")
    chosen = [table[name] for name in names]
    if args.kv_pressure:
        # 3s, 4 and 4l always; 4s, 4a and 4r when chosen: each as configured, with the small cache
        pressured = ["3s", "4", "4l"] + [name for name in ("4s", "4a", "4r") if name in names]
        chosen += [replace(table[name], name=f"6/{name}", kv_mib=args.pressure_mib) for name in pressured]
    return chosen


# --- the workload ---------------------------------------------------------------------------


def schedule(args: argparse.Namespace) -> tuple[list[list[list[dict]]], list[str]]:
    """Per conversation, the message list of each turn; and the tokenizer's training corpus."""
    from tests.vllm_e2e.test_vllm_serve_replay import _text

    rng = random.Random(SEED)
    system = _text(rng, args.system_words)
    corpus = [system]
    chats = []
    for _ in range(args.conversations):
        history: list[dict] = [{"role": "system", "content": system}]
        turns = []
        uneven = 0 < args.min_turns < args.turns  # (drawn only then: the even schedule stays as it was)
        count = rng.randint(args.min_turns, args.turns) if uneven else args.turns
        for _turn in range(count):
            history.append({"role": "user", "content": _text(rng, rng.randrange(60, 160))})
            turns.append(list(history))
            history.append({"role": "assistant", "content": _text(rng, rng.randrange(40, 120))})
            corpus += [m["content"] for m in history[-2:]]
        chats.append(turns)
    return chats, corpus


@dataclass
class Result(StreamResult):
    server: int = 0
    conversation: int = 0
    turn: int = 0
    at_s: float = 0.0  # sent, seconds into the configuration's run

    def record(self) -> dict:
        """The request in the JSON output (where a tail came from: which turn, server, hit)."""
        return {
            "conversation": self.conversation,
            "turn": self.turn,
            "server": self.server,
            "at_s": round(self.at_s, 3),
            "ttft_ms": None if self.ttft_s is None else round(1000 * self.ttft_s, 1),
            "max_gap_ms": round(1000 * max(self.gaps_s, default=0.0), 1),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }


async def stream(session, url: str, messages: list[dict], max_tokens: int, result: Result) -> Result:
    from services.replay.openai_client import iter_sse_data

    body = {
        "model": "tiny",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return result
        async for payload in iter_sse_data(response.content.iter_any()):
            if payload == "[DONE]":
                break
            result.observe(json.loads(payload))
    result.finish()
    return result


async def drive(urls: list[str], chats: list[list[list[dict]]], config: Config, args: argparse.Namespace):
    import aiohttp

    # (conversation, turn) in the order users take them: a conversation's turns back to back, or
    # (--by-turn) every conversation's first turn, then every second turn, ... so all of them stay
    # live at once and a server's KV cache must hold them all between turns
    if args.by_turn:
        turns = max(len(turns) for turns in chats)
        queue = [(c, t) for t in range(turns) for c in range(len(chats)) if t < len(chats[c])]
    else:
        queue = [(c, t) for c in range(len(chats)) for t in range(len(chats[c]))]
    done = {(c, t): asyncio.Event() for c, t in queue}
    counter = 0
    in_flight = [0] * len(urls)
    homes: dict[int, int] = {}  # affinity: each conversation's server
    results: list[Result] = []

    def route(number: int) -> int:
        nonlocal counter
        if config.routing == "sticky":
            return number % len(urls)
        if config.routing == "hash":
            digest = hashlib.blake2b(f"conversation-{number}".encode(), digest_size=8).digest()
            return int.from_bytes(digest, "big") % len(urls)
        if config.routing == "router":
            return 0  # the one URL: the router chooses
        order = [(counter + i) % len(urls) for i in range(len(urls))]  # round-robin breaks ties
        counter += 1
        least = min(order, key=lambda i: in_flight[i])
        if config.routing == "least":
            return least
        if config.routing == "affinity":
            home = homes.get(number)
            if home is None or in_flight[home] - in_flight[least] >= args.spill:
                homes[number] = least
            return homes[number]
        return order[0]

    async def user(session) -> None:
        while queue:
            number, turn = queue.pop(0)
            if turn:
                await done[number, turn - 1].wait()  # its previous turn's answer first
            if args.think_ms > 0:  # the user reads, then writes: the same pause in every configuration
                await asyncio.sleep(random.Random(f"{number}/{turn}").expovariate(1000 / args.think_ms))
            server = route(number)
            in_flight[server] += 1
            try:
                messages = chats[number][turn]
                sent = Result(server=server, conversation=number, turn=turn, at_s=time.perf_counter() - started)
                results.append(await stream(session, urls[server], messages, args.max_tokens, sent))
            finally:
                in_flight[server] -= 1
                done[number, turn].set()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(user(session) for _ in range(args.users)))
        return results, time.perf_counter() - started


# --- servers --------------------------------------------------------------------------------


def serve(
    model: Path,
    work: Path,
    name: str,
    config: Config,
    cache: str | None,
    pythonpath: str,
    core: int | None,
    connector_extra: dict,
):
    """One vLLM OpenAI server; `core`: the CPU its processes (API server and engine) and OpenMP
    threads are bound to (None: vLLM's own binding, which puts every server of a fleet on the same
    cores, where they spin against each other's barriers: two servers on two cores are then each
    on one, as on two hosts, and an API server no longer crowds the other server's core)."""
    from tests.support.redis_server import free_port

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "bfloat16",
        "--block-size", str(BLOCK), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
        "--seed", "0", "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(config.kv_mib << 20),
        "--enable-prefix-caching" if config.apc else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if cache is not None:
        extra = {"cache": cache, **connector_extra}
        command += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "PrefixCacheConnector",
                    "kv_connector_module_path": "prefixcache.integrations.vllm",
                    "kv_role": config.role,
                    "kv_connector_extra_config": extra,
                }
            ),
        ]
    env = dict(
        os.environ,
        PYTHONPATH=pythonpath,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
    )
    env.pop("ONEDNN_MAX_CPU_ISA", None)  # vLLM's AMX kernels SIGILL under the HF worker's cap
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # (whole GiB only) would override --kv-cache-memory-bytes
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    log = (work / f"{name}.log").open("w")
    # cwd is the connector's checkout too: `python -m` puts the working directory ahead of PYTHONPATH
    process = subprocess.Popen(
        command,
        cwd=pythonpath,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}),
    )
    return process, f"http://127.0.0.1:{port}"


def start_router(model: Path, urls: list[str], caches: list[str | None]) -> tuple[subprocess.Popen, str]:
    """`prefixcache route` in front of the servers (each with its cache service), on a free port."""
    command = [sys.executable, "-m", "prefixcache_services", "--log-level", "WARNING", "route"]
    command += ["--listen", "127.0.0.1:0", "--tokenizer", str(model)]
    for url, cache in zip(urls, caches, strict=True):
        command += ["--engine", url if cache is None else f"{url}={cache}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    ready = "prefixcache route: listening on "
    while line := process.stdout.readline():
        if line.startswith(ready):
            return process, "http://" + line[len(ready) :].strip()
    process.kill()
    raise SystemExit("prefixcache route did not start")


def connector_counters(url: str) -> dict[str, float]:
    """The connector's `vllm:prefixcache_*` counters, each summed over its label sets (none without)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prefixcache_") and not line.startswith("#"):
            head = line.split(" ")[0].split("{")[0]
            if head.endswith("_created"):
                continue
            name = head.removeprefix("vllm:prefixcache_").removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def counters(urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        for name, value in connector_counters(url).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _stat(path: Path) -> tuple[str, list[str]]:
    """A /proc stat file's command name and the fields after it (state first)."""
    head, fields = path.read_text().rsplit(")", 1)
    return head.split("(", 1)[1], fields.split()


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _members(processes: list[subprocess.Popen]) -> Iterator[tuple[Path, int, str, list[str]]]:
    """(/proc directory, pid, name, stat fields) of these processes and every live process in their
    groups (a vLLM server, started in a session of its own: its API process, engine core, workers)."""
    groups = {process.pid for process in processes}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, fields = _stat(path)
        except OSError:
            continue  # gone meanwhile
        pid = int(path.parent.name)
        if pid in groups or int(fields[2]) in groups:  # pid or pgrp
            yield path.parent, pid, name, fields


def group_cpu_s(processes: list[subprocess.Popen]) -> float:
    """CPU seconds (user + system) used so far by these processes and their groups (`_members`)."""
    return sum(_cpu_s(fields) for _, _, _, fields in _members(processes))


def thread_cpu_s(
    servers: list[subprocess.Popen], services: list[subprocess.Popen], stores: list[subprocess.Popen]
) -> dict[str, float]:
    """CPU seconds so far of every live thread of the servers' groups, the services and the stores
    (redis-server), summed by process and OS thread name: `api/python` (a server's API process),
    `VLLM::Worker/pfx-save` (the connector's threads name themselves, prefixcache/threads.py),
    `service/...`, `redis/...`; numbered names (`gloo_tcp_loop`, `ZMQbg/IO/0`) pooled without
    their numbers."""
    leaders = (
        {process.pid: "api" for process in servers}
        | {process.pid: "service" for process in services}
        | {process.pid: "redis" for process in stores}
    )
    totals: dict[str, float] = {}
    for directory, pid, name, _ in _members(servers + services + stores):
        process = leaders.get(pid, name)
        try:
            for task in (directory / "task").iterdir():
                thread, fields = _stat(task / "stat")
                key = f"{process}/{re.sub(r'[-_/]?[0-9]+$', '', thread)}"
                totals[key] = totals.get(key, 0.0) + _cpu_s(fields)
        except OSError:
            continue  # gone meanwhile
    return totals


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@dataclass
class Run:
    """One configuration played once: its requests, wall time and counter deltas."""

    results: list[Result]
    wall_s: float
    connector: dict[str, float]  # the servers' prefixcache counters (empty without the connector)
    cpu: dict[str, float]  # CPU seconds of the vLLM servers' and the services' processes


def pooled(config: Config, runs: list[Run], users: int) -> dict:
    """A configuration's rounds as one row: requests pooled (percentiles over all of them),
    throughput over the summed wall time, counters summed; each round's TTFT p50 alongside, and
    the TTFT percentiles without each round's opening burst (its first `users` requests, sent at
    once to servers that have served only the warm-up: they set p99 when rounds are short)."""
    connector: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for run in runs:
        for totals, deltas in ((connector, run.connector), (cpu, run.cpu)):
            for name, value in deltas.items():
                totals[name] = totals.get(name, 0.0) + value
    results = [r for run in runs for r in run.results]
    row = summarise(config, results, sum(run.wall_s for run in runs), connector) | {"cpu": cpu}
    row["round_ttft_p50_ms"] = [
        pct([r.ttft_s * 1000 for r in run.results if r.error is None and r.ttft_s is not None], 50) for run in runs
    ]
    later = [r for run in runs for r in sorted(run.results, key=lambda r: r.at_s)[users:]]
    ttft = [r.ttft_s * 1000 for r in later if r.error is None and r.ttft_s is not None]
    row["ttft_after_opening_ms"] = {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)}
    return row


def run_config(config: Config, model: Path, work: Path, chats, args: argparse.Namespace) -> Run:
    from service_process import start_service

    from tests.support.redis_server import RedisServer
    from tests.vllm_e2e.test_vllm_serve_replay import _ready as ready  # the test's own probe
    from tests.vllm_e2e.test_vllm_serve_replay import _text

    services: list[subprocess.Popen] = []
    servers: list[subprocess.Popen] = []
    redis = None
    tag = config.name.replace("/", "-")
    try:
        addresses: list[str | None] = [None] * config.servers
        before_tree = config.name in BEFORE_CONFIGS
        service_root = Path(args.before_root) if before_tree and args.before_services else ROOT
        flags = ["--host-capacity", f"{args.service_mib}MiB", "--block-size", str(BLOCK)]
        cores = os.cpu_count() or 1
        # a lone server on core 0 leaves the other cores to its service (2 against 2p: the
        # connector's cost when the cache does not share the engine's core)
        spare = set(range(1, cores)) if args.bind_cores and config.servers == 1 and cores > 1 else None
        if config.cache == "host":
            process, address = start_service(*flags, cpus=spare, root=service_root)
            services.append(process)
            addresses = [address] * config.servers
        elif config.cache == "redis":
            (work / f"redis-{tag}").mkdir()
            redis = RedisServer(work / f"redis-{tag}").start()
            for i in range(config.servers):
                process, address = start_service(*flags, "--redis-url", redis.url, root=service_root)
                services.append(process)
                addresses[i] = address
        pythonpath = args.before_root if before_tree else str(ROOT)
        urls = []
        for i in range(config.servers):
            core = i % cores if args.bind_cores and (config.servers > 1 or spare) else None
            process, url = serve(model, work, f"{tag}-{i}", config, addresses[i], pythonpath, core, args.connector)
            servers.append(process)
            urls.append(url)
        deadline = time.monotonic() + READY_S
        for process, url in zip(servers, urls, strict=True):
            while not ready(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"config {config.name}: a vLLM server never came up; see {work}/{tag}-*.log")
                time.sleep(1.0)
        # Warm each server as the schedule will load it: --users prompts at once, each of a first
        # turn's length, sharing nothing with the schedule (its own words), so first-use costs
        # (kernels for long prefills, buffers, the connector's first large saves) are paid here.
        rng = random.Random(SEED + 1)
        words = args.system_words + 160
        warm = [[[{"role": "user", "content": _text(rng, words)}]] for _ in range(args.users)]
        for i in range(config.servers):
            asyncio.run(drive([urls[i]], warm, Config("warm", 1, False, "rr", None, 0), args))
        time.sleep(WARM_SETTLE_S)  # the warm-up's saves finish before the schedule starts, not during it
        targets = urls
        if config.routing == "router":
            process, router_url = start_router(model, urls, addresses)
            services.append(process)  # its CPU counts with the services'
            targets = [router_url]
        # Redis on the engines' cores is this benchmark's shape, not the cross-host one's: counted apart
        stores = [redis.process] if redis is not None and redis.process is not None else []
        before = counters(urls)
        cpu_before = group_cpu_s(servers), group_cpu_s(services), group_cpu_s(stores)
        threads_before = thread_cpu_s(servers, services, stores)
        results, wall_s = asyncio.run(drive(targets, chats, config, args))
        cpu = {
            "servers_s": group_cpu_s(servers) - cpu_before[0],
            "services_s": group_cpu_s(services) - cpu_before[1],
        }
        if stores:
            cpu["redis_s"] = group_cpu_s(stores) - cpu_before[2]
        for name, seconds in thread_cpu_s(servers, services, stores).items():
            cpu[f"thread {name}"] = seconds - threads_before.get(name, 0.0)
        time.sleep(0.5)
        after = counters(urls)
        connector = {name: value - before.get(name, 0.0) for name, value in after.items()}
        return Run(results, wall_s, connector, cpu)
    finally:
        stop(servers)
        for process in services:
            process.terminate()
            process.wait(30)
        if redis is not None:
            redis.stop()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarise(config: Config, results: list[Result], wall_s: float, connector: dict[str, float]) -> dict:
    """`connector`: the run's deltas of the servers' prefixcache counters (empty without the connector)."""
    ok = [r for r in results if r.error is None]
    if not ok:
        raise SystemExit(f"config {config.name}: every request failed, e.g. {sorted({r.error for r in results})[:3]}")
    external = connector.get("external_tokens", 0.0)
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    gaps = [g * 1000 for r in ok for g in r.gaps_s]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "config": config.name,
        "title": TITLES.get(config.name.split("/")[-1], config.name)
        + (f" (KV {config.kv_mib} MiB)" if config.name.startswith("6") else ""),
        "requests": len(results),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "mean": statistics.fmean(ttft)},
        "itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s,
        "prompt_tokens_per_s": prompt / wall_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefixcache_tokens": external,
        "cached_share": cached / prompt if prompt else 0.0,
        "vllm_share": (cached - external) / prompt if prompt else 0.0,
        "prefixcache_share": external / prompt if prompt else 0.0,
        "connector": connector,
        "per_request": [r.record() for r in results],
    }


def breakdown(rows: list[dict]) -> str:
    """Where each request's time and CPU go: the processes' CPU per request (every configuration),
    and the connector's own counters (configurations with it): its hooks' time on vLLM's threads,
    its threads' CPU, load and save times (wall, including waits for the cores)."""
    lines = [
        "| config | CPU ms per request: vLLM servers / services (and router) / redis-server "
        "| connector on vLLM's threads: CPU / grace waits / idle waits ms/req "
        "| connector threads CPU ms/req | lookups sent (requests skipped by the presence table): steps deferred / not awaited "
        "| hits (in-step) | misses "
        "| load ms per hit | save ms per request (wall) | load failures |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, cpu, n = r.get("connector") or {}, r.get("cpu") or {}, max(r["requests"], 1)
        hits = c.get("hits", 0.0)
        processes = " / ".join(
            f"{1000 * cpu.get(name, 0.0) / n:.1f}" if name in cpu else "—"
            for name in ("servers_s", "services_s", "redis_s")
        )
        if not c:  # no connector
            lines.append(f"| {r['config']} | {processes} | — | — | — | — | — | — | — | — |")
            continue
        lines.append(
            f"| {r['config']} | {processes} | {1000 * c.get('engine_thread_cpu_seconds', 0.0) / n:.2f} / "
            f"{1000 * c.get('lookup_grace_seconds', 0.0) / n:.2f} / {1000 * c.get('lookup_idle_seconds', 0.0) / n:.2f} "
            f"| {1000 * c.get('background_cpu_seconds', 0.0) / n:.2f} "
            f"| {c.get('lookups', 0.0):.0f} ({c.get('lookups_skipped', 0.0):.0f}): "
            f"{c.get('lookup_deferrals', 0.0):.0f} / {c.get('lookups_not_awaited', 0.0):.0f} "
            f"| {hits:.0f} ({c.get('in_step_loads', 0.0):.0f}) "
            f"| {c.get('misses', 0.0):.0f} | {1000 * c.get('load_seconds', 0.0) / max(hits, 1):.2f} "
            f"| {1000 * c.get('save_seconds', 0.0) / n:.2f} | {c.get('load_failures', 0.0):.0f} |"
        )
    return "\n".join(lines)


def thread_table(rows: list[dict]) -> str:
    """CPU ms per request by process and thread, one column per configuration: which of vLLM's
    threads a connector makes busier, and what its own threads (`pfx-*`) and the service cost."""
    names = sorted(
        {k for r in rows for k, v in (r.get("cpu") or {}).items() if k.startswith("thread ") and v > 0},
        key=lambda k: -max((r.get("cpu") or {}).get(k, 0.0) / max(r["requests"], 1) for r in rows),
    )
    lines = ["| process/thread | " + " | ".join(r["config"] for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name in names:
        cells = [1000 * (r.get("cpu") or {}).get(name, 0.0) / max(r["requests"], 1) for r in rows]
        if max(cells) >= 0.05:
            lines.append(f"| {name.removeprefix('thread ')} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One line per configuration; each compared with sticky APC-only under the same KV cache
    (3s, or 6/3s for the pressure configurations)."""
    by_name = {r["config"]: r for r in rows}
    lines = [
        "| config | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | req/s | prompt tok/s "
        "| cached share (vLLM + prefixcache) | vs sticky (3s or 6/3s): p50 / p99 / req/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        ref = by_name.get("6/3s" if r["config"].startswith("6/") else "3s")
        versus = "—"
        if ref is not None and r is not ref:
            versus = (
                f"{t['p50'] / ref['ttft_ms']['p50']:.2f}x / {t['p99'] / ref['ttft_ms']['p99']:.2f}x / "
                f"{r['requests_per_s'] / ref['requests_per_s']:.2f}x"
            )
        lines.append(
            f"| {r['config']} {r['title']} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} "
            f"| {i['p50']:.1f} / {i['p99']:.1f} | {r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} "
            f"| {r['cached_share']:.1%} ({r['vllm_share']:.1%} + {r['prefixcache_share']:.1%}) | {versus} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS), help="comma list of " + ",".join(ALL_CONFIGS))
    parser.add_argument(
        "--kv-pressure",
        action="store_true",
        help="also run 3s, 4 and 4l (and 4s, 4a, 4r when chosen) with a small vLLM KV cache",
    )
    parser.add_argument("--kv-mib", type=int, default=2048, help="each server's KV cache in configs 1-5")
    parser.add_argument(
        "--pressure-mib",
        type=int,
        default=10,
        help="each server's KV cache in config 6 (the default model: 5k tokens; 8 MiB is under --max-model-len)",
    )
    parser.add_argument(
        "--service-mib",
        type=int,
        default=2048,
        help="each prefixcache service's host tier (a small one fills, and LRU evicts from then on)",
    )
    parser.add_argument(
        "--connector",
        type=json.loads,
        default={},
        help="more kv_connector_extra_config for every connector, as JSON (e.g. '{\"lookup_grace_s\": 0}')",
    )
    parser.add_argument("--before-root", default="", help="the checkout whose connector configs 4b and 5b run")
    parser.add_argument(
        "--before-services", action="store_true", help="configs 4b, 4sb and 5b run --before-root's services too"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="play the configurations this many times, A B, B A, ...; rows pool the rounds",
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--min-turns", type=int, default=0, help="each conversation's turns drawn from [N, --turns] (0: all --turns)"
    )
    parser.add_argument(
        "--spill", type=int, default=2, help="3a/4a: move a conversation when its server has this many more in flight"
    )
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="mean pause (exponential, the same per turn in every configuration) before each request "
        "(0: none, a closed loop: then least-in-flight routing herds users onto the server that just freed them)",
    )
    parser.add_argument(
        "--no-bind-cores",
        dest="bind_cores",
        action="store_false",
        help="leave vLLM's own CPU binding (default: server i of a fleet on core i, as on separate hosts; "
        "a lone server on core 0 and its service on the others)",
    )
    parser.add_argument(
        "--by-turn", action="store_true", help="play every conversation's turn 1, then every turn 2, ... (all live)"
    )
    parser.add_argument("--system-words", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json-out", default="")
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(ALL_CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {','.join(ALL_CONFIGS)}")
    before = set(BEFORE_CONFIGS) & set(args.configs.split(","))
    if before and not (Path(args.before_root) / "prefixcache" / "integrations" / "vllm").is_dir():
        parser.error(f"--before-root: configs {sorted(before)} need a checkout with prefixcache/integrations/vllm")
    if args.before_services and not before:
        parser.error(f"--before-services: only configs {', '.join(BEFORE_CONFIGS)} run a before tree; none chosen")
    if not isinstance(args.connector, dict):
        parser.error(f"--connector: must be a JSON object of kv_connector_extra_config keys, got {args.connector!r}")
    if args.min_turns < 0 or args.min_turns > args.turns:
        parser.error(f"--min-turns must be between 0 and --turns ({args.turns}), got {args.min_turns}")
    for name in (
        "rounds",
        "conversations",
        "turns",
        "users",
        "max_tokens",
        "kv_mib",
        "pressure_mib",
        "service_mib",
        "spill",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    from vllm_ttft_bench import build_model, kv_bytes_per_token

    token_bytes = kv_bytes_per_token(args.layers, args.hidden)
    for name in ("kv_mib", "pressure_mib")[: 1 + args.kv_pressure]:  # vLLM refuses a smaller cache
        if (getattr(args, name) << 20) < MAX_MODEL_LEN * token_bytes:
            need = -(-MAX_MODEL_LEN * token_bytes // (1 << 20))
            parser.error(
                f"--{name.replace('_', '-')}: {getattr(args, name)} MiB holds "
                f"{(getattr(args, name) << 20) // token_bytes} tokens of a {args.layers}-layer model, under "
                f"--max-model-len {MAX_MODEL_LEN}: give at least {need}"
            )

    from tests.vllm_e2e.test_vllm_serve_replay import _tokenizer

    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        work = Path(tmp)
        chats, corpus = schedule(args)
        model = work / "model"
        build_model(model, args.layers, args.hidden, VOCAB)
        _tokenizer(model, corpus)
        chosen = configs(args)
        runs: dict[str, list[Run]] = {config.name: [] for config in chosen}
        for number in range(args.rounds):  # a slow spell of the machine hits every configuration,
            (work / f"round{number}").mkdir()  # and going first or last in a round every one alike
            for config in chosen if number % 2 == 0 else chosen[::-1]:
                started = time.monotonic()
                run = run_config(config, model, work / f"round{number}", chats, args)
                runs[config.name].append(run)
                row = summarise(config, run.results, run.wall_s, run.connector)
                print(
                    f"round {number + 1}, config {config.name}: {row['requests']} requests, "
                    f"TTFT p50 {row['ttft_ms']['p50']:.0f} ms, cached {row['cached_share']:.1%} "
                    f"({time.monotonic() - started:.0f} s incl. start-up)",
                    flush=True,
                )
        rows = [pooled(config, runs[config.name], args.users) for config in chosen]
    print(table(rows))
    print()
    print(breakdown(rows))
    print()
    print(thread_table(rows))
    print()
    for row in rows:
        later = row["ttft_after_opening_ms"]
        print(
            f"{row['config']}: TTFT p50 / p90 / p99 without each round's opening burst "
            f"{later['p50']:.0f} / {later['p90']:.0f} / {later['p99']:.0f} ms"
        )
    if args.rounds > 1:
        print()
        for row in rows:
            print(f"{row['config']}: TTFT p50 by round " + " / ".join(f"{v:.0f}" for v in row["round_ttft_p50_ms"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
