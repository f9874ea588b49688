"""Chaos soak: ShareGPT chats through service + cached worker over Redis while things break on a schedule.

    PYTHONPATH=. python benchmarks/chaos_soak.py [--duration 75] [--json-out soak.json]          # CI
    PYTHONPATH=. python benchmarks/chaos_soak.py --duration 540 --fault-spacing 30    # the long version

Everything runs on loopback, bounded in time (`--duration` of load, then at most `--drain`):
a redis-server, `prefixcache serve` over it with a small `--host-capacity` (the host tier is
under eviction pressure the whole run, so hits depend on Redis), a cached worker and a
`--no-cache` reference worker (both `--no-onednn` unless `--onednn`: see SoakConfig.onednn).
ShareGPT conversations with at least two turns under the caps are replayed (services/replay)
to both workers at once, with Poisson conversation arrivals and fixed think times (a steady
request rate). After `--warm`, faults come one at a time, each `--fault-spacing` seconds after
the previous one ended, as long as a spacing is left afterwards to see the hit rate recover,
in turn: Redis paused with `CLIENT PAUSE ALL` for `--pause`; Redis SIGKILLed (its data lost)
and restarted after `--redis-down`; the cache service restarted on the same port, warm from
Redis (alternately SIGKILL and SIGTERM). Once a second, the sampler reads the service's and
the workers' RSS (/proc/PID/status) and the service's GetStats.

Checks (benchmarks/chaos_checks.py, which defines them): 0 failed requests, 0 output
mismatches against the no-cache worker, hit rate recovering after each fault, no lease left
at the end, service and worker RSS flat within 5% between the first and last third of the
warm run, the Redis queue bounded and drained. Prints each check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import chaos_checks as checks  # noqa: E402
from prefixcache.errors import PrefixCacheError  # noqa: E402
from prefixcache.tiers.redis_options import RedisOptions  # noqa: E402
from prefixcache_services.replay.prompt_tokens import ChatTokens  # noqa: E402
from prefixcache_services.replay.runner import RunOptions, RunResult, Target, run_schedule  # noqa: E402
from prefixcache_services.replay.schedule import Schedule, ScheduleConfig, build_schedule  # noqa: E402
from prefixcache_services.replay.workload import WorkloadSpec, load_workload  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.worker_procs import CacheService, WorkerProcess, start_all  # noqa: E402

FAULTS = ("redis_pause", "redis_kill", "service_restart")
KEY_PREFIX = "soak"
SETTLE_S = 30.0  # after the load: leases released, queue drained
QUEUE_BOUND_BYTES = next(f.default for f in dataclasses.fields(RedisOptions) if f.name == "max_queue_bytes")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 75.0
    warm_s: float = 8.0
    fault_spacing_s: float = 10.0
    redis_down_s: float = 2.0
    pause_s: float = 3.0
    restart_s: float = 15.0  # how long a service restart is expected to take (for the schedule)
    rate: float = 0.5  # conversations per second (~3 turns each)
    think_s: float = 1.0
    concurrency: int = 4
    max_turns: int = 8
    max_prompt_tokens: int = 1536
    max_tokens: int = 8
    host_capacity: str = "4MiB"  # 256 blocks of the tiny model: eviction pressure
    drain_s: float = 60.0
    seed: int = 0
    onednn: bool = False  # workers keep oneDNN (torch's CPU default): RSS then grows per new prompt length
    workdir: str = ""  # "": a new temporary directory

    def expected_s(self, kind: str) -> float:
        return {"service_restart": self.restart_s, "redis_kill": self.redis_down_s + 1.0}.get(kind, self.pause_s)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process is gone (a restart in progress)
        return None
    return None


def service_stats(service: CacheService):
    """The service's GetStats (`snapshot` None before the first Attach), or None while it is down."""
    try:
        with service.client(timeout_s=1.0) as client:
            return client.stats()
    except PrefixCacheError:
        return None


class Soak:
    """The processes of one soak and what happens to them."""

    def __init__(self, config: SoakConfig) -> None:
        if not config.workdir:
            config = dataclasses.replace(config, workdir=tempfile.mkdtemp(prefix="chaos-soak-"))
        self.config = config
        work = Path(config.workdir)
        self.redis = RedisServer(work / "redis")
        self.service = None
        self.cached = self.reference = None
        self.faults: list[checks.Fault] = []
        self.samples: list[checks.Sample] = []
        self.t0 = 0.0
        self.service_ready = 0.0  # perf_counter when the current service process became ready

    def start(self) -> None:
        config, work = self.config, Path(self.config.workdir)
        self.redis.start()
        redis_args = ("--redis-url", self.redis.url, "--redis-key-prefix", KEY_PREFIX, "--redis-timeout-ms", "50")
        self.service = CacheService(work / "service", config.host_capacity, extra_args=redis_args).start()
        self.service_ready = time.perf_counter()
        # Two workers share the box; without oneDNN, whose per-shape kernel cache grows with every new
        # prompt length in both (docs/benchmarks.md), RSS measures the cache's own memory.
        options = ("--threads", "1") + (() if config.onednn else ("--no-onednn",))
        self.cached = WorkerProcess(work / "cached", self.service, options)
        self.reference = WorkerProcess(work / "reference", None, options)
        start_all([self.cached, self.reference])

    def stop(self) -> None:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: p.stop(), [p for p in (self.cached, self.reference, self.service) if p]))
        self.redis.stop()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def inject(self, kind: str, index: int) -> None:
        start = self.now()
        if kind == "redis_kill":
            self.redis.kill()
            time.sleep(self.config.redis_down_s)
            self.redis.start()
        elif kind == "redis_pause":
            self.redis.pause(int(self.config.pause_s * 1000))
            time.sleep(self.config.pause_s)
        elif index % 2:
            self.service.stop()  # SIGTERM: drain, then gone
            self.service.start()
            kind, self.service_ready = "service_stop_start", time.perf_counter()
        else:
            self.service.restart()  # SIGKILL, as a crash would
            kind, self.service_ready = "service_kill_start", time.perf_counter()
        self.faults.append(checks.Fault(kind, start, self.now()))
        print(f"[{start:6.1f}s] {kind} ({self.now() - start:.1f}s)", flush=True)

    def sample(self) -> None:
        stats = service_stats(self.service)
        snapshot = stats.snapshot if stats else None
        self.samples.append(
            checks.Sample(
                self.now(),
                rss_bytes(self.service.process.pid if self.service.alive() else None),
                rss_bytes(self.cached.process.pid),
                snapshot.remote.get("queue_bytes") if snapshot else None,
                snapshot.active_leases if snapshot else None,
                time.perf_counter() - self.service_ready,
                rss_bytes(self.reference.process.pid),
            )
        )


async def _faults(soak: Soak) -> None:
    config, at, index = soak.config, soak.config.warm_s + soak.config.fault_spacing_s, 0
    while at + config.expected_s(kind := FAULTS[index % len(FAULTS)]) + config.fault_spacing_s <= config.duration_s:
        await asyncio.sleep(max(0.0, at - soak.now()))
        await asyncio.to_thread(soak.inject, kind, index // len(FAULTS))
        at, index = soak.now() + config.fault_spacing_s, index + 1


async def _sampler(soak: Soak, done: asyncio.Event) -> None:
    while not done.is_set():
        await asyncio.to_thread(soak.sample)
        try:
            await asyncio.wait_for(done.wait(), 1.0)
        except TimeoutError:
            pass


async def _run(soak: Soak, schedule, options: RunOptions) -> tuple[RunResult, RunResult]:
    cached = Target("cached", f"http://127.0.0.1:{soak.cached.port}", "prefixcache-tiny-llama")
    reference = Target("no-cache", f"http://127.0.0.1:{soak.reference.port}", "prefixcache-tiny-llama")
    done = asyncio.Event()
    soak.t0 = time.perf_counter()
    sampler = asyncio.ensure_future(_sampler(soak, done))
    faults = asyncio.ensure_future(_faults(soak))
    results = await asyncio.gather(run_schedule(schedule, cached, options), run_schedule(schedule, reference, options))
    await faults
    done.set()
    await sampler
    return results


def _requests(result: RunResult) -> list[checks.Request]:
    return [
        checks.Request(
            r.conversation_id,
            r.turn_index,
            r.start_s,
            r.completion.prompt_tokens or 0,
            r.completion.cached_tokens or 0,
            r.completion.text,
            r.completion.error,
        )
        for r in result.records
    ]


def _settle(soak: Soak) -> tuple[int | None, float | None, dict]:
    """Leases and queue bytes once idle (polled until both are 0, at most SETTLE_S), and the
    Redis tier's figures of the last service process."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = service_stats(soak.service)
        leases, queued, remote = None, None, {}
        if stats is not None:  # a service no worker has attached to yet holds no lease and no queue
            snapshot = stats.snapshot
            leases, queued = (snapshot.active_leases, snapshot.remote.get("queue_bytes")) if snapshot else (0, 0.0)
            remote = dict(snapshot.remote) if snapshot else {}
        if (leases == 0 and queued == 0) or time.monotonic() > deadline:
            return leases, queued, remote
        time.sleep(0.2)


def _warm_up(soak: Soak, max_prompt_tokens: int, max_tokens: int) -> None:
    """One prompt of the largest size to each worker, so that memory high-water marks come first."""
    tokens = [(7919 * i) % 90_000 + 100 for i in range(max_prompt_tokens)]
    for worker in (soak.cached, soak.reference):
        worker.client.complete(tokens, max_tokens=max_tokens)


def verdict(
    soak: Soak, cached: RunResult, reference: RunResult, leases, queued, remote: dict
) -> tuple[list[checks.Check], dict]:
    config = soak.config
    a, b = _requests(cached), _requests(reference)
    recovery, baseline, times = checks.check_recovery(a, soak.faults, config.warm_s, config.duration_s)
    found = [
        checks.check_failures(a, b),
        checks.check_outputs(a, b),
        recovery,
        *checks.check_memory(soak.samples, config.warm_s, config.duration_s),
        checks.check_queue(soak.samples, QUEUE_BOUND_BYTES, queued),
        checks.check_leases(leases),
    ]
    overall, _ = checks.hit_rate(a, config.warm_s, config.duration_s)
    figures = {
        "requests": len(a),
        "not_sent": cached.not_sent,
        "wall_s": cached.wall_s,
        "hit_rate": overall,
        "baseline_hit_rate": baseline,
        "recovery_s": times,
        "faults": [dataclasses.asdict(f) for f in soak.faults],
        "last_service_redis": remote,
        "samples": [dataclasses.asdict(s) for s in soak.samples],
        "workdir": config.workdir,
        "requests_cached": [
            [r.conversation, r.turn, round(r.start_s, 2), r.prompt_tokens, r.cached_tokens, r.error] for r in a
        ],
    }
    return found, figures


def multi_turn_schedule(config: SoakConfig) -> Schedule:
    """ShareGPT conversations with at least two turns under the caps (every conversation then
    brings requests a hit can serve, so the hit rate is measurable all along), Poisson arrivals."""
    wanted = math.ceil(config.rate * config.duration_s * 1.5) + 5
    spec = WorkloadSpec(
        conversations=3 * wanted, max_turns=config.max_turns, max_prompt_tokens=config.max_prompt_tokens
    )
    workload = load_workload(spec, ChatTokens().count)
    chats = tuple(turns for turns in workload.turns if len(turns) >= 2)[:wanted]
    return build_schedule(
        chats,
        ScheduleConfig(
            rate=config.rate,
            think_time_s=config.think_s,
            concurrency=config.concurrency,
            duration_s=config.duration_s,
            seed=config.seed,
        ),
    )


def soak_once(config: SoakConfig) -> tuple[list[checks.Check], dict]:
    schedule = multi_turn_schedule(config)
    run_options = RunOptions(max_tokens=config.max_tokens, request_timeout_s=120.0, drain_s=config.drain_s)
    soak = Soak(config)
    try:
        soak.start()
        _warm_up(soak, config.max_prompt_tokens, config.max_tokens)
        print(
            f"load: {schedule.request_count} requests planned over {config.duration_s:.0f}s, a fault every "
            f"{config.fault_spacing_s:.0f}s after the previous one ({' -> '.join(FAULTS)})",
            flush=True,
        )
        cached, reference = asyncio.run(_run(soak, schedule, run_options))
        return verdict(soak, cached, reference, *_settle(soak))
    finally:
        soak.stop()


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    for field in dataclasses.fields(SoakConfig):
        flag, default = "--" + field.name.removesuffix("_s").replace("_", "-"), getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(flag, dest=field.name, action="store_true")
        else:
            parser.add_argument(flag, dest=field.name, type=type(default), default=default, help=f"default {default}")
    parser.add_argument("--json-out", type=Path, default=None, help="write checks and figures here")
    args = vars(parser.parse_args(argv))
    json_out = args.pop("json_out")
    return SoakConfig(**args), json_out


def main(argv: list[str] | None = None) -> int:
    config, json_out = parse_args(argv)
    started = time.perf_counter()
    found, figures = soak_once(config)
    figures["total_s"] = time.perf_counter() - started
    print(f"work directory (logs): {figures['workdir']}")
    for check in found:
        print(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    print(f"requests {figures['requests']}, token hit rate {figures['hit_rate']}, total {figures['total_s']:.0f}s")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(
                {
                    "config": dataclasses.asdict(config),
                    "figures": figures,
                    "checks": [dataclasses.asdict(c) for c in found],
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if all(c.ok for c in found) else 1


if __name__ == "__main__":
    sys.exit(main())
