"""Measured prefill speed, for deciding whether loading cached KV beats recomputing it.

Owns `PrefillRateMeter`: an exponentially weighted moving average of tokens/s over real
prefills. Invariants: only prefills of at least `min_tokens` computed tokens are counted
(tiny ones measure call overhead, not throughput); `rate` is None until the first such
sample; samples with non-positive duration are ignored. Not thread-safe: one owner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillRateMeter:
    alpha: float = 0.2
    min_tokens: int = 32
    _rate: float | None = None
    _samples: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < self.min_tokens or seconds <= 0.0:
            return
        sample = tokens / seconds
        self._rate = sample if self._rate is None else self._rate + self.alpha * (sample - self._rate)
        self._samples += 1

    @property
    def rate(self) -> float | None:
        """Tokens per second (EWMA), or None before the first counted prefill."""
        return self._rate

    @property
    def samples(self) -> int:
        return self._samples

    def seconds_for(self, tokens: int) -> float | None:
        """Estimated time to prefill `tokens` tokens, or None if not yet measured."""
        return None if self._rate is None else tokens / self._rate
