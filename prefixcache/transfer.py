"""How long moving bytes takes, learned online; and a lookup's budget for probing a slow tier.

A hit is only worth taking when loading its KV beats recomputing it. Both sides of that
comparison are measured, never assumed: `TransferMeter` learns one data path (a Redis
connection, a shared-memory copy, a gRPC stream) as `seconds = latency + bytes / bandwidth`
from timed transfers, and `ProbeBudget` carries the asking worker's recompute cost into a
Redis probe so that the cache only fetches blocks it expects to fetch faster than the
worker would recompute them, and stops starting round trips once the time those blocks
would save is spent.

Invariants:
- `TransferMeter.estimate()` always returns finite values: latency >= 0 and bandwidth > 0
  (the prior until a sample arrives, again once the samples are older than `stale_s`, so a
  path measured slow is tried again later rather than written off for good).
- The fit is least squares over exponentially decayed samples (recent ones count most); when
  the samples' sizes are too alike to separate latency from bandwidth, the prior's bandwidth
  is kept and the rest of the time is latency.
- With `clip`, no sample counts as slower than `clip` x the estimate it arrived to: one transfer
  that was preempted (a busy host) moves the estimate by a bounded step, while a path that
  really slowed down is still followed, a bounded step per sample.
- Not thread-safe: each meter has one owner, who serialises calls (the Redis tier under its
  lock, the worker on its inference thread).
- A `ProbeBudget` belongs to one lookup; `grant` never allows more blocks than planned, and
  once it refuses a round trip it refuses every later one (`declined` is set once).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

PROBE_MARGIN = 1.25  # a fetch (and its check) must be estimated this much faster than recomputing:
# admitting and the worker's own copy of the blocks cost time too
_MIN_BYTES_PER_S = 1e3
_MAX_BYTES_PER_S = 1e12
_ALIKE = 0.01  # squared coefficient of variation of sample sizes below which sizes are "alike"


@dataclass(frozen=True)
class TransferEstimate:
    """`seconds(n, trips)` = trips x latency + n / bandwidth."""

    latency_s: float
    bytes_per_s: float
    samples: int = 0  # 0: this is the prior

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"bytes_per_s must be a finite number > 0, got {self.bytes_per_s!r}")

    def seconds(self, nbytes: float, trips: int = 1) -> float:
        return trips * self.latency_s + nbytes / self.bytes_per_s

    def then(self, after: TransferEstimate) -> TransferEstimate:
        """The same bytes through this path and then `after` (e.g. a fetch, then checking it):
        latencies add, and so do the seconds per byte."""
        return TransferEstimate(
            self.latency_s + after.latency_s, 1.0 / (1.0 / self.bytes_per_s + 1.0 / after.bytes_per_s), self.samples
        )


class TransferMeter:
    """Online `TransferEstimate` of one data path from timed transfers (see module docstring)."""

    def __init__(
        self,
        prior: TransferEstimate,
        *,
        alpha: float = 0.2,
        stale_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        clip: float | None = None,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if clip is not None and not clip > 1.0:
            raise ValueError(f"clip must be > 1 (or None), got {clip}")
        self.prior = prior
        self._clip = clip
        self._keep = 1.0 - alpha
        self._stale_s = stale_s
        self._clock = clock
        self._last = -math.inf
        self._reset()

    def _reset(self) -> None:
        # Decayed sums of weight, bytes, seconds, bytes^2 and bytes*seconds.
        self._w = self._b = self._t = self._bb = self._bt = 0.0
        self._samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """One transfer of `nbytes` that took `seconds` (a round trip, a copy, a stream)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if not (math.isfinite(seconds) and seconds > 0):
            return  # a clock that did not advance says nothing about the path
        now = self._clock()
        if now - self._last > self._stale_s:
            self._reset()
        if self._clip is not None and self._samples:
            expected = self.estimate().seconds(nbytes)
            if expected > 0:
                seconds = min(seconds, self._clip * expected)
        self._last = now
        keep = self._keep
        self._w = self._w * keep + 1.0
        self._b = self._b * keep + nbytes
        self._t = self._t * keep + seconds
        self._bb = self._bb * keep + float(nbytes) * nbytes
        self._bt = self._bt * keep + nbytes * seconds
        self._samples += 1

    def estimate(self) -> TransferEstimate:
        if self._samples == 0 or self._clock() - self._last > self._stale_s:
            return self.prior
        latency, per_byte = self._fit()
        bandwidth = min(_MAX_BYTES_PER_S, max(_MIN_BYTES_PER_S, 1.0 / per_byte if per_byte > 0 else _MAX_BYTES_PER_S))
        return TransferEstimate(max(0.0, latency), bandwidth, self._samples)

    def _fit(self) -> tuple[float, float]:
        """(latency, seconds per byte) by least squares; see the module docstring for the fallbacks."""
        w = self._w
        mean_b, mean_t = self._b / w, self._t / w
        var_b = self._bb / w - mean_b * mean_b
        if mean_b > 0 and var_b > _ALIKE * mean_b * mean_b:
            per_byte = (self._bt / w - mean_b * mean_t) / var_b
            latency = mean_t - per_byte * mean_b
            if per_byte <= 0:  # bigger was not slower (noise): as if alike
                return self._split(mean_b, mean_t)
            if latency < 0:  # through the origin instead
                return 0.0, self._bt / self._bb
            return latency, per_byte
        return self._split(mean_b, mean_t)

    def _split(self, mean_b: float, mean_t: float) -> tuple[float, float]:
        """Sizes cannot tell latency from bandwidth: keep the prior's bandwidth, the rest is latency."""
        per_byte = 1.0 / self.prior.bytes_per_s
        latency = mean_t - per_byte * mean_b
        if latency < 0:
            return 0.0, mean_t / mean_b
        return latency, per_byte


def blocks_worth_fetching(
    estimate: TransferEstimate,
    blocks: int,
    frame_bytes: int,
    per_trip: int,
    saving_per_block_s: float,
    margin: float = PROBE_MARGIN,
) -> int:
    """How many of the next `blocks` to fetch (in round trips of `per_trip`) so that the time
    saved (`saving_per_block_s` each) beats `margin` x the estimated fetch time by the most;
    0 when no count does. Assumes the blocks are there: a probe that misses costs one trip.

    The gain is linear in whole trips, so the best count is 0, every whole trip, or all.
    """
    if blocks <= 0 or per_trip <= 0 or saving_per_block_s <= 0:
        return 0
    whole = (blocks // per_trip) * per_trip
    best, best_gain = 0, 0.0
    for count in {whole, blocks} - {0}:
        trips = -(-count // per_trip)
        gain = count * saving_per_block_s - margin * estimate.seconds(count * frame_bytes, trips)
        if gain > best_gain:
            best, best_gain = count, gain
    return best


@dataclass
class ProbeBudget:
    """One lookup's allowance for probing a slow tier, carried through its fetch calls.

    Mutable, owned by that lookup. `blocks` is how many blocks the prompt has past its local
    hit; `saving_per_block_s` what recomputing one costs the asking worker. The first `grant`
    plans the probe (`blocks_worth_fetching`) and sets a deadline: the time the planned blocks
    would save, divided by the margin. Later grants hand out round trips until the plan or the
    deadline runs out; from the first refusal on, `declined` counts the blocks never asked for.
    """

    blocks: int
    saving_per_block_s: float
    margin: float = PROBE_MARGIN
    planned: int | None = None
    deadline: float = math.inf
    asked: int = 0
    declined: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        if self.blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {self.blocks}")
        if not (math.isfinite(self.saving_per_block_s) and self.saving_per_block_s >= 0):
            raise ValueError(f"saving_per_block_s must be a finite number >= 0, got {self.saving_per_block_s!r}")

    def grant(self, wanted: int, estimate: TransferEstimate, frame_bytes: int, per_trip: int, now: float) -> int:
        """How many of the `wanted` next blocks the coming round trip may ask for (0: stop)."""
        if self.closed:
            return 0
        if self.planned is None:
            self.planned = blocks_worth_fetching(
                estimate, self.blocks, frame_bytes, per_trip, self.saving_per_block_s, self.margin
            )
            self.deadline = now + self.planned * self.saving_per_block_s / self.margin
        count = min(wanted, self.planned - self.asked)
        if count > 0 and now + estimate.seconds(count * frame_bytes) > self.deadline:
            count = 0  # the probe has used up the time its blocks would save
        self.asked += count
        if count < wanted:
            self.closed = True
            self.declined = self.blocks - self.asked
        return count
