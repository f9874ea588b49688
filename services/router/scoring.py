"""The router's model: the TTFT each engine would give a request, learned from what it observes.

Owns:
- `Hit`: what one engine's cache service holds of a prompt (Match's blocks per tier), and the
  time to move that hit into the engine at the configured per-tier rates (`TierRates`).
- `PrefillModel`: TTFT without queueing = overhead + prefill tokens / rate, fitted by
  exponentially weighted least squares over observed (prefill tokens, seconds) pairs; until the
  samples spread enough to fit a line, the rate is an EWMA of tokens/second and the overhead its
  initial value.
- `EngineLoad`: one engine's in-flight requests and its queueing estimate; the queue model is the
  reference worker's (one request at a time, in arrival order): the wait is the remaining
  predicted service time (TTFT + decode) of everything already in flight.
- `rank`: engines best first by expected TTFT; the conversation's previous engine wins only a
  tie (within `TIE_FRACTION` of the best, plus `TIE_S`).

Invariants: pure (no I/O, no clocks: callers pass `now`); not thread-safe (the router's event
loop is the one owner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TIERS = ("device", "host", "disk", "redis")
TIE_FRACTION = 0.05
TIE_S = 0.002
MIN_FIT_SPREAD_TOKENS = 32.0  # weighted std of prefill tokens needed before the line is fitted


@dataclass(frozen=True)
class TierRates:
    """Tokens per second moved into an engine from each tier (configured: `--tier-rates`)."""

    device: float = 20e6
    host: float = 2e6
    disk: float = 1e6
    redis: float = 2e5

    @classmethod
    def parse(cls, text: str, flag: str = "--tier-rates: ") -> TierRates:
        values = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, sep, number = part.partition("=")
            name = name.strip()
            if not sep or name not in TIERS:
                raise ValueError(f"{flag}{part!r} is not TIER=TOKENS_PER_S with TIER one of {', '.join(TIERS)}")
            try:
                rate = float(number)
            except ValueError:
                raise ValueError(f"{flag}{name}={number!r} is not a number of tokens per second") from None
            if not rate > 0 or math.isinf(rate):
                raise ValueError(f"{flag}{name} must be a positive finite rate, got {number!r}")
            values[name] = rate
        return cls(**values)


@dataclass(frozen=True)
class Hit:
    """One engine's cached prefix of a prompt, from its service's Match (zeros: a miss)."""

    prompt_tokens: int
    block_size: int = 0
    device_blocks: int = 0
    host_blocks: int = 0
    remote_blocks: int = 0  # leading blocks the service believes Redis holds
    disk_blocks: int = 0  # blocks past the local hit its disk tier holds, in a row

    @property
    def local_blocks(self) -> int:
        return self.device_blocks + self.host_blocks

    @property
    def hit_tokens(self) -> int:
        """Tokens the engine need not prefill: the longer of the local hit (with what the disk
        holds past it) and the Redis hit."""
        blocks = max(self.local_blocks + self.disk_blocks, self.remote_blocks)
        return min(self.prompt_tokens, blocks * self.block_size)

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def transfer_s(self, rates: TierRates) -> float:
        size = self.block_size
        redis_only = max(0, self.remote_blocks - self.local_blocks - self.disk_blocks)
        return (
            self.device_blocks * size / rates.device
            + self.host_blocks * size / rates.host
            + self.disk_blocks * size / rates.disk
            + redis_only * size / rates.redis
        )


@dataclass
class PrefillModel:
    """seconds = overhead_s + tokens / rate, fitted with exponential forgetting (`alpha`)."""

    initial_rate: float = 4000.0
    initial_overhead_s: float = 0.005
    alpha: float = 0.1
    samples: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens < 0:
            return
        keep = 1.0 - self.alpha
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + tokens * tokens
        self._xy = keep * self._xy + tokens * seconds
        self.samples += 1

    def _fit(self) -> tuple[float, float]:
        """(overhead_s, seconds per token)."""
        if self.samples == 0:
            return self.initial_overhead_s, 1.0 / self.initial_rate
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if self.samples >= 3 and var_x >= MIN_FIT_SPREAD_TOKENS**2:
            slope = (self._xy / self._w - mean_x * mean_y) / var_x
            if slope > 0:
                overhead = mean_y - slope * mean_x
                if overhead >= 0:
                    return overhead, slope
                return 0.0, mean_y / mean_x  # through the origin: never a negative overhead
        overhead = min(self.initial_overhead_s, mean_y)
        if mean_x <= 0:
            return mean_y, 1.0 / self.initial_rate
        return overhead, max(mean_y - overhead, 0.0) / mean_x or 1.0 / self.initial_rate

    @property
    def overhead_s(self) -> float:
        return self._fit()[0]

    @property
    def rate(self) -> float:
        """Prefill tokens per second."""
        return 1.0 / self._fit()[1]

    def seconds_for(self, tokens: int) -> float:
        overhead, per_token = self._fit()
        return overhead + tokens * per_token


@dataclass(frozen=True)
class Estimate:
    engine: str
    queue_s: float
    prefill_s: float
    transfer_s: float
    hit: Hit

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s


@dataclass
class Flight:
    """One request dispatched to an engine and not yet finished."""

    estimate: Estimate
    dispatched_at: float
    service_s: float  # predicted time the engine spends on it (prefill, transfer, decode)
    first_at: float | None = None


@dataclass
class EngineLoad:
    """One engine's learned speeds and its in-flight requests."""

    prefill: PrefillModel = field(default_factory=PrefillModel)
    decode_alpha: float = 0.2
    decode_s: float = 0.0  # EWMA of first token -> end of response
    flights: dict[int, Flight] = field(default_factory=dict)
    _anchor: float = 0.0  # when the request now being served started (busy start or last completion)
    _last_done: float = -math.inf

    def queue_s(self, now: float) -> float:
        if not self.flights:
            return 0.0
        work = sum(f.service_s for f in self.flights.values())
        return max(0.0, work - (now - self._anchor))

    def estimate(self, engine: str, hit: Hit, rates: TierRates, now: float) -> Estimate:
        return Estimate(
            engine, self.queue_s(now), self.prefill.seconds_for(hit.prefill_tokens), hit.transfer_s(rates), hit
        )

    def start(self, key: int, estimate: Estimate, now: float) -> Flight:
        if not self.flights:
            self._anchor = now
        flight = Flight(estimate, now, estimate.prefill_s + estimate.transfer_s + self.decode_s)
        self.flights[key] = flight
        return flight

    def first_token(self, key: int, now: float) -> float | None:
        """Records the first token; returns the observed TTFT (dispatch -> first token)."""
        flight = self.flights.get(key)
        if flight is None or flight.first_at is not None:
            return None
        flight.first_at = now
        # Served from when it reached the head: its dispatch, or the completion before it.
        served_from = max(flight.dispatched_at, self._last_done)
        if now > served_from:
            self.prefill.observe(
                flight.estimate.hit.prefill_tokens, max(now - served_from - flight.estimate.transfer_s, 1e-6)
            )
        return now - flight.dispatched_at

    def finish(self, key: int, now: float, streamed: bool) -> None:
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        if streamed and flight.first_at is not None:
            sample = now - flight.first_at
            self.decode_s = (
                sample if self.decode_s == 0.0 else self.decode_s + self.decode_alpha * (sample - self.decode_s)
            )
        self._last_done = now
        self._anchor = now


def rank(estimates: list[Estimate], sticky: str | None) -> tuple[list[Estimate], str]:
    """Best first, and why the first won: "score", or "sticky" (the conversation's engine in a tie)."""
    ordered = sorted(estimates, key=lambda e: e.ttft_s)
    if not ordered:
        return ordered, "score"
    best = ordered[0].ttft_s
    if sticky is not None and ordered[0].engine != sticky:
        for position, estimate in enumerate(ordered):
            if estimate.engine == sticky and estimate.ttft_s <= best * (1 + TIE_FRACTION) + TIE_S:
                return [estimate, *ordered[:position], *ordered[position + 1 :]], "sticky"
    return ordered, "score"
