"""Whether a request loads its cached prefix, part of it, or recomputes it.

A hit is only worth taking when loading its KV beats recomputing it. Per request the worker
compares two estimates:
- loading: the hit's bytes over the path they would take — mapped memory (the host tier's
  shared memory, or the device pool by CUDA IPC) for the leading blocks this worker has
  mapped, else the service's Fetch stream, which always carries the whole lease — plus
  installing them into the model's KV cache;
- recomputing: the same tokens at the engine's measured marginal prefill cost.
Every term is a `TransferMeter` (latency + size / rate) learned online from this worker's own
reads, installs and prefills, starting from the priors below. The prefill cost also travels
with each Lookup (`recompute_seconds_per_token`), so the service applies the same rule to
blocks it would have to fetch from Redis first.

`choose` is the pure decision, made on the client's `Hit` as the Lookup returned it (its usable
blocks, how many of them lead in mapped memory, the whole lease a stream moves); what it returns
is a small `Decision`: how many leading blocks to load and by which path. `HitPolicy` owns the
meters, asks `choose`, and exports each
decision and the estimates behind it as Prometheus metrics (docs/replay.md lists them). It does
no I/O: the cache link (cache_link.py) reads and reports each read's timing (`observe_read`).

Invariants:
- A decision loads a prefix of the hit (blocks 0..n-1; KV is only valid from the first
  token on), never more than the usable blocks (the engine computes at least one token).
- A partial load only ever uses the mapped path: a stream read moves the whole lease anyway.
- The policy is driven by the inference thread; prometheus metrics are thread-safe to scrape.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixcache.client.api import Hit
from prefixcache.config import KVLayout
from prefixcache.transfer import TransferEstimate, TransferMeter

log = logging.getLogger(__name__)

# Priors, used until this worker has measured its own (and again after `STALE_S` without samples).
MAPPED_PRIOR = TransferEstimate(latency_s=20e-6, bytes_per_s=4e9)  # a memcpy out of shared memory
STREAM_PRIOR = TransferEstimate(latency_s=1e-3, bytes_per_s=300e6)  # gRPC Python on loopback
INSTALL_PRIOR = TransferEstimate(latency_s=50e-6, bytes_per_s=4e9)  # blocks -> the model's KV cache
PREFILL_PRIOR = TransferEstimate(latency_s=5e-3, bytes_per_s=5e3)  # "bytes" are tokens: 5k tokens/s
STALE_S = 600.0
CALIBRATION_TOKENS = (64, 512)


class Verdict(enum.Enum):
    TAKEN = "taken"  # every usable block is loaded
    PARTIAL = "partial"  # a leading part of them is loaded, the rest recomputed
    RECOMPUTE = "recompute"  # a hit was offered but recomputing it is faster
    MISS = "miss"  # nothing usable was offered


class ReadPath(enum.Enum):
    MAPPED = "shared_memory"  # host tier shared memory (or the device pool by CUDA IPC)
    STREAM = "stream"  # the service's Fetch stream


@dataclass(frozen=True)
class Estimates:
    prefill: TransferEstimate  # seconds = fixed + tokens / tokens_per_s
    mapped: TransferEstimate
    stream: TransferEstimate
    install: TransferEstimate

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill.bytes_per_s


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    blocks: int  # blocks to load, 0 for RECOMPUTE and MISS
    path: ReadPath | None  # how they are read (for RECOMPUTE: the best path, turned down)
    load_s: float  # estimated time to read and install the best option's blocks
    recompute_s: float  # estimated time to prefill those blocks' tokens instead

    @property
    def saved_s(self) -> float:
        return self.recompute_s - self.load_s


def choose(hit: Hit, layout: KVLayout, estimates: Estimates, always_take: bool = False) -> Decision:
    """The option (mapped prefix, or the whole lease by stream, or nothing) that saves the most time.

    `always_take` skips the comparison with recomputing (the worker's `--hit-policy always`)."""
    usable = hit.usable_blocks
    if usable <= 0:
        return Decision(Verdict.MISS, 0, None, 0.0, 0.0)
    block_bytes = layout.block_bytes
    block_s = layout.block_size * estimates.prefill_s_per_token
    options: list[tuple[ReadPath, int, float]] = []
    mapped = min(hit.mapped_blocks, usable)
    if mapped > 0:
        nbytes = mapped * block_bytes
        options.append((ReadPath.MAPPED, mapped, estimates.mapped.seconds(nbytes) + estimates.install.seconds(nbytes)))
    if hit.mapped_blocks < usable:
        load = estimates.stream.seconds(hit.blocks * block_bytes) + estimates.install.seconds(usable * block_bytes)
        options.append((ReadPath.STREAM, usable, load))
    path, count, load = max(options, key=lambda option: option[1] * block_s - option[2])
    recompute = count * block_s
    if recompute <= load and not always_take:
        return Decision(Verdict.RECOMPUTE, 0, path, load, recompute)
    verdict = Verdict.TAKEN if count == usable else Verdict.PARTIAL
    return Decision(verdict, count, path, load, recompute)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "prefixcache_worker_hit_decisions",
            "Per request: cached prefix taken, partly taken, recomputed instead, or nothing usable offered",
            ["decision"],
            registry=registry,
        )
        self.blocks = Counter(
            "prefixcache_worker_hit_blocks",
            "Offered hit blocks loaded, or declined because recomputing them was estimated faster",
            ["outcome"],
            registry=registry,
        )
        self.remote_declined = Counter(
            "prefixcache_worker_remote_blocks_declined",
            "Blocks the service did not fetch from Redis because this worker recomputes them faster",
            registry=registry,
        )
        self.saved = Counter(
            "prefixcache_worker_hit_estimated_seconds",
            "Estimated seconds of the options chosen: loading them, or prefilling them instead",
            ["estimate"],
            registry=registry,
        )
        self.prefill = Gauge(
            "prefixcache_worker_prefill_seconds_per_token", "Estimated marginal prefill cost", registry=registry
        )
        self.latency = Gauge(
            "prefixcache_worker_transfer_latency_seconds",
            "Estimated fixed cost per transfer",
            ["path"],
            registry=registry,
        )
        self.rate = Gauge(
            "prefixcache_worker_transfer_bytes_per_second", "Estimated transfer rate", ["path"], registry=registry
        )
        for label in ("taken", "partial", "recompute", "miss"):
            self.decisions.labels(label)
        for label in ("loaded", "declined"):
            self.blocks.labels(label)


class HitPolicy:
    """Online estimates + `choose` + metrics; see the module docstring."""

    def __init__(
        self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic, always_take: bool = False
    ) -> None:
        self.always_take = always_take
        self._prefill = TransferMeter(PREFILL_PRIOR, stale_s=STALE_S, clock=clock)
        self._paths = {
            ReadPath.MAPPED: TransferMeter(MAPPED_PRIOR, stale_s=STALE_S, clock=clock),
            ReadPath.STREAM: TransferMeter(STREAM_PRIOR, stale_s=STALE_S, clock=clock),
        }
        self._install = TransferMeter(INSTALL_PRIOR, stale_s=STALE_S, clock=clock)
        self.metrics = _Metrics(registry)
        self._publish()

    # -- estimates ----------------------------------------------------------
    def estimates(self) -> Estimates:
        return Estimates(
            self._prefill.estimate(),
            self._paths[ReadPath.MAPPED].estimate(),
            self._paths[ReadPath.STREAM].estimate(),
            self._install.estimate(),
        )

    def recompute_s_per_token(self) -> float | None:
        """The budget sent with each Lookup: this worker's marginal prefill seconds per token
        (None with `always_take`: the service then fetches every block Redis holds)."""
        return None if self.always_take else self.estimates().prefill_s_per_token

    def observe(self, prefill, prefix_blocks: torch.Tensor | None = None) -> None:
        """One real prefill (`engine.PrefillResult`): its forward pass over the computed tokens and,
        with `prefix_blocks`, the installing of those blocks into the model's KV cache."""
        self._prefill.observe(prefill.computed_tokens, prefill.compute_seconds)
        if prefix_blocks is not None and prefix_blocks.numel():
            self._install.observe(prefix_blocks.numel() * prefix_blocks.element_size(), prefill.load_seconds)
        self._publish()

    def calibrate(self, engine, sizes: tuple[int, ...] = CALIBRATION_TOKENS) -> TransferEstimate:
        """Time real prefills of synthetic prompts of two sizes (at start-up): latency and rate."""
        vocab = engine.loaded.model.get_input_embeddings().num_embeddings
        for size in sizes:
            self.observe(engine.prefill([(1000 + i) % vocab for i in range(size)]))
        estimate = self._prefill.estimate()
        log.info(
            "prefill: %.2f ms + %.1f us/token (%.0f tokens/s marginal)",
            estimate.latency_s * 1e3,
            1e6 / estimate.bytes_per_s,
            estimate.bytes_per_s,
        )
        return estimate

    # -- per request ----------------------------------------------------------
    def decide(self, hit: Hit, layout: KVLayout) -> Decision:
        """How many of the hit's leading blocks to load, and by which path (counted in the metrics)."""
        decision = choose(hit, layout, self.estimates(), self.always_take)
        metrics = self.metrics
        metrics.decisions.labels(decision.verdict.value).inc()
        metrics.blocks.labels("loaded").inc(decision.blocks)
        metrics.blocks.labels("declined").inc(max(0, hit.usable_blocks - decision.blocks))
        metrics.remote_declined.inc(hit.remote_blocks_declined)
        if decision.blocks:
            metrics.saved.labels("load").inc(decision.load_s)
            metrics.saved.labels("recompute").inc(decision.recompute_s)
        log.debug(
            "hit decision %s: %d of %d blocks by %s (load %.2f ms vs recompute %.2f ms)",
            decision.verdict.value,
            decision.blocks,
            hit.usable_blocks,
            decision.path.value if decision.path else "-",
            decision.load_s * 1e3,
            decision.recompute_s * 1e3,
        )
        return decision

    def observe_read(self, path: ReadPath, nbytes: int, seconds: float) -> None:
        """One read the cache link did by `path` (the policy itself does no I/O)."""
        self._paths[path].observe(nbytes, seconds)
        self._publish()

    def _publish(self) -> None:
        estimates = self.estimates()
        self.metrics.prefill.set(estimates.prefill_s_per_token)
        for label, estimate in (
            ("shared_memory", estimates.mapped),
            ("stream", estimates.stream),
            ("install", estimates.install),
        ):
            self.metrics.latency.labels(label).set(estimate.latency_s)
            self.metrics.rate.labels(label).set(estimate.bytes_per_s)
