"""Circuit breaker, jittered exponential backoff and a tiny retry policy for a remote dependency.

Used by the Redis tier (tiers/redis.py, its reads and its writes) and by the worker's link to the
service (services/worker/cache_link.py, its re-attach); a module of its own so neither reaches
into the other's package for it.

The breaker has two states. UP: calls go through; `failure_threshold`
consecutive failures switch it to DOWN. DOWN: callers skip I/O entirely; one
probe becomes due after a jittered exponential backoff, and its outcome either
brings the breaker UP (any success resets everything) or schedules the next
probe with a longer delay. Each state change is logged once, never per call.

Invariants:
- Thread-safe: the request path records read outcomes while a background
  writer records write and probe outcomes.
- While DOWN, `probe_due()` is false until the scheduled time; the delay grows
  from `min_s` to at most `max_s` and is never below half of its base, so a
  fleet of caches does not probe a recovering Redis in lock step nor too soon.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential delay with "equal jitter": half of the base delay fixed, half random."""

    min_s: float
    max_s: float
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ConfigError("backoff", f"need 0 < min_s <= max_s, got {self.min_s} and {self.max_s}")
        if self.multiplier < 1:
            raise ConfigError("backoff", f"multiplier must be >= 1, got {self.multiplier}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before try number `attempt` (0-based)."""
        base = min(self.max_s, self.min_s * self.multiplier ** min(attempt, 64))
        return base / 2 + rng.uniform(0.0, base / 2)


@dataclass(frozen=True)
class Retry:
    """Run an idempotent call up to `1 + retries` times on the listed errors only."""

    retries: int
    backoff: Backoff
    retry_on: tuple[type[BaseException], ...]

    def call(self, fn: Callable[[], T], rng: random.Random, sleep: Callable[[float], None] = time.sleep) -> T:
        for attempt in range(self.retries):
            try:
                return fn()
            except self.retry_on as exc:
                log.debug("retrying after %s (attempt %d of %d)", type(exc).__name__, attempt + 1, self.retries)
                sleep(self.backoff.delay(attempt, rng))
        return fn()


class BreakerState(enum.Enum):
    UP = "up"
    DOWN = "down"


class CircuitBreaker:
    """Counts consecutive failures of one dependency and decides when to call it."""

    def __init__(
        self,
        name: str,
        failure_threshold: int,
        backoff: Backoff,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ConfigError("breaker_failures", f"must be >= 1, got {failure_threshold}")
        self.name = name
        self._threshold = failure_threshold
        self._backoff = backoff
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._state = BreakerState.UP
        self._failures = 0  # consecutive, while UP
        self._probes_failed = 0  # consecutive, while DOWN: the backoff exponent
        self._probe_at = 0.0
        self.trips = 0  # times it went DOWN (monotonic counter)

    @property
    def state(self) -> BreakerState:
        return self._state

    def is_up(self) -> bool:
        return self._state is BreakerState.UP

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._probes_failed = 0
            if self._state is BreakerState.DOWN:
                self._state = BreakerState.UP
                log.info("%s is up again", self.name)

    def record_failure(self, reason: str) -> None:
        with self._lock:
            if self._state is BreakerState.DOWN:
                self._probes_failed += 1
                self._schedule_probe()
                log.debug("%s probe failed (%s); next in %.2fs", self.name, reason, self._probe_at - self._clock())
                return
            self._failures += 1
            if self._failures >= self._threshold:
                self._go_down(reason)

    def trip(self, reason: str) -> None:
        """Go DOWN now (e.g. the first probe at start-up failed)."""
        with self._lock:
            if self._state is BreakerState.UP:
                self._go_down(reason)

    def probe_due(self) -> bool:
        return self._state is BreakerState.DOWN and self._clock() >= self._probe_at

    def seconds_until_probe(self) -> float:
        """0 when UP or when a probe is due."""
        if self._state is BreakerState.UP:
            return 0.0
        return max(0.0, self._probe_at - self._clock())

    def _go_down(self, reason: str) -> None:
        self._state = BreakerState.DOWN
        self._probes_failed = 0
        self.trips += 1
        self._schedule_probe()
        log.warning("%s is down after %d consecutive failure(s): %s", self.name, max(self._failures, 1), reason)

    def _schedule_probe(self) -> None:
        self._probe_at = self._clock() + self._backoff.delay(self._probes_failed, self._rng)
