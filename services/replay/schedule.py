"""The replay schedule: which requests are sent, when conversations start, how long users think.

Owns: a deterministic, seeded plan. Start times and think times are drawn here, once, from a
private `random.Random(seed)`; the runner only follows the plan. What depends on the server
(when a turn completes) is left to the runner: turn k+1 is sent `think_times_s[k]` after
turn k's response has completed.

Invariants of a `Schedule`:
- same conversations + same `ScheduleConfig` (incl. seed) -> equal `Schedule`;
- conversations are ordered by `start_s` (non-decreasing); all start at 0.0 when `rate` is None;
  otherwise start times are a Poisson process of `rate` conversations/s (exponential gaps);
- no conversation starts at or after `duration_s`;
- `request_count <= max_requests`: conversations are taken whole in start order until the
  budget runs out, and the last one is cut to the turns left. The request set is therefore
  fixed by the plan, so an A and a B run aim at exactly the same requests;
- every conversation has `len(think_times_s) == len(turns) - 1` and at least one turn.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from .turns import Turn


class ScheduleError(ValueError):
    """A schedule parameter is out of range; the message names it."""


class ThinkTime(StrEnum):
    """How the pause between a response and the user's next message is drawn."""

    FIXED = "fixed"  # exactly think_time_s
    EXPONENTIAL = "exponential"  # exponential with mean think_time_s


@dataclass(frozen=True)
class ScheduleConfig:
    """Validated schedule parameters. `rate` is conversations per second (None: all at once)."""

    rate: float | None = None
    think_time_s: float = 0.0
    think_time: ThinkTime = ThinkTime.FIXED
    concurrency: int = 8
    duration_s: float | None = None
    max_requests: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ScheduleError(f"rate must be > 0 conversations/s or None, got {self.rate}")
        if not self.think_time_s >= 0:
            raise ScheduleError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if self.concurrency < 1:
            raise ScheduleError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ScheduleError(f"duration_s must be > 0 or None, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ScheduleError(f"max_requests must be >= 1 or None, got {self.max_requests}")


@dataclass(frozen=True)
class ScheduledConversation:
    """One conversation's plan: start offset from run start, its turns, pauses between them."""

    conversation_id: str
    start_s: float
    turns: tuple[Turn, ...]
    think_times_s: tuple[float, ...]


@dataclass(frozen=True)
class Schedule:
    """The whole plan (see module invariants)."""

    config: ScheduleConfig
    conversations: tuple[ScheduledConversation, ...]

    @property
    def request_count(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def requests(self) -> Iterable[Turn]:
        for conv in self.conversations:
            yield from conv.turns


def _draw_think(rng: random.Random, config: ScheduleConfig) -> float:
    if config.think_time is ThinkTime.FIXED or config.think_time_s == 0:
        return config.think_time_s
    return rng.expovariate(1.0 / config.think_time_s)


def build_schedule(turns_per_conversation: Sequence[Sequence[Turn]], config: ScheduleConfig) -> Schedule:
    """Plan the replay of the given conversations (each a list of its turns, in load order).

    Conversations with no turns (e.g. the first prompt already over the token cap) are dropped.
    """
    rng = random.Random(config.seed)
    budget = config.max_requests
    clock = 0.0
    planned: list[ScheduledConversation] = []
    for turns in turns_per_conversation:
        if not turns:
            continue
        if budget is not None and budget <= 0:
            break
        if config.rate is not None:
            clock += rng.expovariate(config.rate)
        if config.duration_s is not None and clock >= config.duration_s:
            break
        kept = tuple(turns if budget is None else turns[:budget])
        # Draw a think time for every transcript turn, not only the kept ones, so the request
        # cap never shifts the random stream seen by later conversations.
        thinks = tuple(_draw_think(rng, config) for _ in range(len(turns) - 1))
        planned.append(
            ScheduledConversation(
                conversation_id=kept[0].conversation_id,
                start_s=clock,
                turns=kept,
                think_times_s=thinks[: len(kept) - 1],
            )
        )
        if budget is not None:
            budget -= len(kept)
    return Schedule(config=config, conversations=tuple(planned))
