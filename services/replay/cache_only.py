"""Cache-only load test: replay a schedule against the cache service itself, no model.

Owns: driving the service exactly as a worker drives it for each turn — Lookup with a lease,
read the hit blocks, store the prompt's new full blocks, release the lease — with synthetic
KV of a stated model size (`synthetic_kv`), and summarising what that cost.

Invariants:
- every turn's token ids are the worker's (services/replay/prompt_tokens.py), so lookups hash
  the same blocks a worker would and turn k finds the blocks turn k-1 stored;
- every hit is checked byte for byte against the synthetic KV of its tokens (unless
  verification is off); a differing block is counted in `corrupt_blocks` and fails its
  request, it is never silently accepted;
- nothing a request does raises into the runner: service errors (`PrefixCacheError`) become
  the request's error; a lease taken is released on every path;
- at most `concurrency` requests run at once (the runner's limit, and one pool thread each);
  the sync, thread-safe `CacheClient` does the I/O on the pool's threads, results are
  collected on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.console import Console

from prefixcache.client import CacheClient
from prefixcache.client.api import Hit
from prefixcache.errors import PrefixCacheError

from .openai_client import Completion
from .report import CacheOnlySummary, Percentiles
from .runner import RunOptions, RunResult, Target, run_schedule_with
from .schedule import Schedule
from .synthetic_kv import ModelPreset, SyntheticKV, equal_blocks
from .turns import Turn

log = logging.getLogger(__name__)

TokenIds = dict[tuple[str, int], list[int]]


@dataclass(frozen=True)
class CacheOnlyOptions:
    address: str
    preset: ModelPreset
    block_size: int = 16
    verify: bool = True
    same_host: bool = True  # False: KV moves over the gRPC streams even when co-located
    timeout_s: float = 10.0
    auth_token: str | None = None


@dataclass(frozen=True)
class OpTimes:
    """One request's service calls: seconds and blocks (read/stored counts are blocks)."""

    lookup_s: float
    read_s: float | None
    store_s: float | None
    hit_blocks: int
    blocks_stored: int
    blocks_deduplicated: int
    blocks_rejected: int
    verified_blocks: int
    corrupt_blocks: int


class _Driver:
    """Sends turns to the service; owns the client and the per-request timings."""

    def __init__(self, options: CacheOnlyOptions, token_ids: TokenIds, pool: ThreadPoolExecutor) -> None:
        self.options = options
        self.token_ids = token_ids
        self.pool = pool
        self.layout = options.preset.layout(options.block_size)
        self.kv = SyntheticKV(self.layout)
        self.client = CacheClient(options.address, auth_token=options.auth_token, timeout_s=options.timeout_s)
        self.ops: list[OpTimes] = []

    def attach(self) -> bool:
        """Attach as a synthetic worker; True when KV moves through shared memory."""
        attachment = self.client.attach(
            f"replay-synthetic-{self.options.preset.name}",
            self.layout,
            revision="synthetic-v1",
            same_host=self.options.same_host,
        )
        return attachment.shared_memory

    async def send(self, turn: Turn) -> Completion:
        tokens = self.token_ids[(turn.conversation_id, turn.index)]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            ops = await loop.run_in_executor(self.pool, self._request, tokens)
        except PrefixCacheError as error:
            return Completion(error=f"{type(error).__name__}: {error}", latency_s=time.perf_counter() - started)
        self.ops.append(ops)
        hit_tokens = ops.hit_blocks * self.layout.block_size
        corrupt = f"corrupt KV: {ops.corrupt_blocks} block(s) differ" if ops.corrupt_blocks else None
        return Completion(
            latency_s=time.perf_counter() - started,
            prompt_tokens=len(tokens),
            completion_tokens=0,
            cached_tokens=hit_tokens,
            error=corrupt,
        )

    def _request(self, tokens: list[int]) -> OpTimes:
        """One worker-shaped request on a pool thread: lookup, read, store, release."""
        t0 = time.perf_counter()
        hit = self.client.lookup(tokens, take_lease=True)
        t1 = time.perf_counter()
        try:
            read_s, verified, corrupt = self._read(hit, tokens) if hit.blocks else (None, 0, 0)
            store_s, result = self._store(tokens, hit.blocks)
        finally:
            self.client.release(hit)
        return OpTimes(t1 - t0, read_s, store_s, hit.blocks, result[0], result[1], result[2], verified, corrupt)

    def _read(self, hit: Hit, tokens: list[int]) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        got = self.client.read(hit)
        read_s = time.perf_counter() - t0
        if not self.options.verify:
            return read_s, 0, 0
        same = equal_blocks(got, self.kv.blocks(tokens, 0, hit.blocks))
        return read_s, len(same), same.count(False)

    def _store(self, tokens: list[int], start: int) -> tuple[float | None, tuple[int, int, int]]:
        end = len(tokens) // self.layout.block_size
        if end <= start:
            return None, (0, 0, 0)
        kv = self.kv.blocks(tokens, start, end - start)  # made before the clock: a worker has it
        t0 = time.perf_counter()
        result = self.client.store(tokens, kv, start_block=start)
        return time.perf_counter() - t0, (result.stored, result.deduplicated, result.rejected)


def summarize(
    ops: list[OpTimes], options: CacheOnlyOptions, shared_memory: bool, requests: int, wall_s: float
) -> CacheOnlySummary:
    block_bytes = options.preset.layout(options.block_size).block_bytes
    read = sum(o.hit_blocks for o in ops if o.read_s is not None)
    stored = sum(o.blocks_stored for o in ops)
    wall = wall_s if wall_s > 0 else float("inf")
    return CacheOnlySummary(
        address=options.address,
        model_size=options.preset.name,
        block_bytes=block_bytes,
        shared_memory=shared_memory,
        verify=options.verify,
        requests=requests,
        lookups=len(ops),
        lookup_s=Percentiles.of([o.lookup_s for o in ops]),
        read_s=Percentiles.of([o.read_s for o in ops if o.read_s is not None]),
        store_s=Percentiles.of([o.store_s for o in ops if o.store_s is not None]),
        lookups_per_s=len(ops) / wall,
        blocks_read=read,
        blocks_stored=stored,
        blocks_deduplicated=sum(o.blocks_deduplicated for o in ops),
        blocks_rejected=sum(o.blocks_rejected for o in ops),
        read_bytes_per_s=read * block_bytes / wall,
        store_bytes_per_s=stored * block_bytes / wall,
        verified_blocks=sum(o.verified_blocks for o in ops),
        corrupt_blocks=sum(o.corrupt_blocks for o in ops),
    )


async def run_cache_only(
    schedule: Schedule,
    token_ids: TokenIds,
    options: CacheOnlyOptions,
    run_options: RunOptions = RunOptions(),
    console: Console | None = None,
) -> tuple[RunResult, CacheOnlySummary]:
    """Replay `schedule` against the service at `options.address` (token ids per (conv, turn))."""
    target = Target(f"cache-only ({options.preset.name})", f"grpc://{options.address}", options.preset.name)
    with ThreadPoolExecutor(max_workers=schedule.config.concurrency, thread_name_prefix="cache-only") as pool:
        driver = _Driver(options, token_ids, pool)
        try:
            shared = await asyncio.get_running_loop().run_in_executor(pool, driver.attach)
            log.info(
                "cache-only: attached to %s as %s (shared memory: %s)", options.address, options.preset.name, shared
            )
            run = await run_schedule_with(schedule, target, driver.send, run_options, console)
        finally:
            driver.client.close()
    summary = summarize(driver.ops, options, shared, len(run.records), run.wall_s)
    return run, summary
