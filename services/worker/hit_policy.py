"""The reference worker's hit policy: the shared load-or-recompute rule (prefixcache/client/
hit_policy.py: `choose`, its priors, `PrefillMeter`) fed with this worker's own measurements and
exported as Prometheus metrics.

Every term of the rule is learned online from this worker's own reads, installs and prefills,
starting from the shared priors: the mapped and stream reads and the install as `TransferMeter`s
(latency + size / rate; a read counts as at most `READ_CLIP` times its estimate, so one read
preempted on a busy host cannot turn the next hits into recomputes), the prefill cost as a `PrefillMeter` (calibrated at start-up by timing two
real prefills, then fed each request's). The prefill cost also travels with each Lookup
(`recompute_s_per_token`), so the service applies the same rule to blocks it would have to read
from disk or fetch from Redis first.

`HitPolicy` owns the meters, asks `choose`, and exports each decision and the estimates behind it
as Prometheus metrics (docs/replay.md lists them). It does no I/O: the cache link (cache_link.py)
reads and reports each read's timing (`observe_read`).

Invariants: those of `choose` (a prefix of the hit, never more than the usable blocks, a partial
load only by the mapped path); the policy is driven by the inference thread; prometheus metrics
are thread-safe to scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixcache.client.api import Hit
from prefixcache.client.hit_policy import (
    INSTALL_PRIOR,
    MAPPED_PRIOR,
    PREFILL_PRIOR,
    STREAM_PRIOR,
    Decision,
    Estimates,
    PrefillMeter,
    ReadPath,
    choose,
)
from prefixcache.config import KVLayout
from prefixcache.transfer import TransferEstimate, TransferMeter

log = logging.getLogger(__name__)

STALE_S = 600.0  # without samples this long, an estimate goes back to its prior
READ_CLIP = 2.0  # a read or install counts as at most this many times its estimate (`TransferMeter`'s clip)
CALIBRATION_TOKENS = (64, 512)


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
        self._prefill = PrefillMeter(PREFILL_PRIOR, stale_s=STALE_S, clock=clock, logger=log)
        self._paths = {
            ReadPath.MAPPED: TransferMeter(MAPPED_PRIOR, stale_s=STALE_S, clock=clock, clip=READ_CLIP),
            ReadPath.STREAM: TransferMeter(STREAM_PRIOR, stale_s=STALE_S, clock=clock, clip=READ_CLIP),
        }
        self._install = TransferMeter(INSTALL_PRIOR, stale_s=STALE_S, clock=clock, clip=READ_CLIP)
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
        self._prefill.log()
        return self._prefill.estimate()

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
        self.metrics.prefill.set(self._prefill.s_per_token)
        for label, meter in (
            ("shared_memory", self._paths[ReadPath.MAPPED]),
            ("stream", self._paths[ReadPath.STREAM]),
            ("install", self._install),
        ):
            estimate = meter.estimate()
            self.metrics.latency.labels(label).set(estimate.latency_s)
            self.metrics.rate.labels(label).set(estimate.bytes_per_s)
