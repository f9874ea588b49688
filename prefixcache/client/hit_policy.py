"""Whether an engine loads its cached prefix, part of it, or recomputes it: the one rule, its
priors and the one prefill-cost estimator that every engine (the reference worker, the vLLM
connector) uses.

A hit is only worth taking when loading its KV beats recomputing it. The rule compares:
- loading: the blocks' bytes over the path they would take — mapped memory (the host tier's
  shared memory, or the device pool by CUDA IPC) for blocks the engine has mapped, else the
  service's Fetch stream, which always carries the whole lease — plus installing them into the
  engine's KV cache;
- recomputing: the same tokens at the engine's measured marginal prefill cost (`PrefillMeter`).
The prefill cost also travels with each Lookup (`recompute_s_per_token`), so the service applies
the same rule to blocks it would have to read from disk or fetch from Redis first.

Owns:
- `HIT_POLICIES`: `auto` (the rule) or `always` (load every usable block; the Lookup then carries
  no budget, so the service fetches all Redis holds).
- `choose`: the pure decision on the client's `Hit` as the Lookup returned it and a set of
  `Estimates`; it returns a small `Decision` (how many blocks to load, by which path).
- `worth_waiting`: before the answer, whether a Lookup in flight is worth delaying its request
  (vLLM's scheduler: a grace wait, a step) at all, from the most it could save and how often
  Lookups bring something (`HitOdds`).
- The priors: `PREFILL_PRIOR`; `MAPPED_PRIOR`, `STREAM_PRIOR`, `INSTALL_PRIOR` for an engine that
  times its own reads and installs (the reference worker learns each from there,
  services/worker/hit_policy.py); `UNTIMED_LOADS` (`MAPPED_LOAD`,
  `STREAM_LOAD`) for one whose loads are not timed where it decides (vLLM's scheduler: a load's
  whole cost, read and install together).
- `PrefillMeter`: `seconds = latency + tokens / tokens_per_s`, learned online (a `TransferMeter`
  with "bytes" = computed tokens) from timed prefills (`observe`) or from an engine's step
  intervals (`step`, `exclude`, `idle`: vLLM's scheduler times the steps it sees).

Invariants:
- A decision loads a contiguous run of the hit (from `first`, the blocks the engine already
  holds; KV is only valid from the first token on), never past the usable blocks (the engine
  computes at least one token).
- A partial load only ever uses the mapped path: a stream read moves the whole lease anyway.
- No I/O, no metrics; `PrefillMeter` is not thread-safe (one owner: the worker's inference
  thread, vLLM's scheduler thread); `HitOdds` is (answers arrive on Lookup threads).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import KVLayout
from ..transfer import TransferEstimate, TransferMeter
from .api import Hit

log = logging.getLogger(__name__)

HIT_POLICIES = ("always", "auto")

PREFILL_PRIOR = TransferEstimate(latency_s=5e-3, bytes_per_s=5e3)  # "bytes" are tokens: 5 ms + 5k tokens/s
MAX_STEP_S = 60.0  # a longer gap between two steps is not a step (the engine waited)
HIT_ODDS_WEIGHT = 1 / 16  # each miss's weight in `HitOdds`: about the last 16 Lookups count
HIT_ODDS_HIT_WEIGHT = 1 / 4  # a hit's: an unawaited hit costs a whole prefill, a needless wait a grace or a step


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
    install: TransferEstimate | None  # None: the read estimates include installing

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill.bytes_per_s

    def install_s(self, nbytes: int) -> float:
        return 0.0 if self.install is None else self.install.seconds(nbytes)


# Starting points of an engine that times its reads and installs apart (the reference worker).
MAPPED_PRIOR = TransferEstimate(latency_s=20e-6, bytes_per_s=4e9)  # a memcpy out of shared memory
STREAM_PRIOR = TransferEstimate(latency_s=1e-3, bytes_per_s=300e6)  # gRPC Python on loopback
INSTALL_PRIOR = TransferEstimate(latency_s=50e-6, bytes_per_s=4e9)  # blocks -> the model's KV cache
# An engine whose loads are not timed where it decides (vLLM's scheduler): read and install as one.
MAPPED_LOAD = TransferEstimate(latency_s=100e-6, bytes_per_s=2e9)  # shared memory -> staging -> paged cache
STREAM_LOAD = TransferEstimate(latency_s=2e-3, bytes_per_s=300e6)  # gRPC Fetch stream on loopback
UNTIMED_LOADS = Estimates(prefill=PREFILL_PRIOR, mapped=MAPPED_LOAD, stream=STREAM_LOAD, install=None)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    blocks: int  # blocks to load (from `first`), 0 for RECOMPUTE and MISS
    path: ReadPath | None  # how they are read (for RECOMPUTE: the best path, turned down)
    load_s: float  # estimated time to read and install the best option's blocks
    recompute_s: float  # estimated time to prefill those blocks' tokens instead

    @property
    def saved_s(self) -> float:
        return self.recompute_s - self.load_s


def choose(
    hit: Hit,
    layout: KVLayout,
    estimates: Estimates,
    always_take: bool = False,
    *,
    first: int = 0,
    end: int | None = None,
    partial: bool = True,
) -> Decision:
    """The option (mapped blocks, or all of them by stream, or nothing) that saves the most time.

    Blocks `first` .. `end` (default: the hit's usable blocks) are on offer; `first` is what the
    engine already holds itself. `partial` False: the mapped path only when it reaches `end` (an
    engine that loads all it offered or nothing: vLLM). `always_take` skips the comparison with
    recomputing (the `always` policy)."""
    end = hit.usable_blocks if end is None else min(end, hit.usable_blocks)
    offered = end - first
    if offered <= 0:
        return Decision(Verdict.MISS, 0, None, 0.0, 0.0)
    block_bytes = layout.block_bytes
    block_s = layout.block_size * estimates.prefill_s_per_token
    options: list[tuple[ReadPath, int, float]] = []
    mapped_end = min(hit.mapped_blocks, end)
    if mapped_end > first and (partial or mapped_end == end):
        nbytes = (mapped_end - first) * block_bytes
        options.append(
            (ReadPath.MAPPED, mapped_end - first, estimates.mapped.seconds(nbytes) + estimates.install_s(nbytes))
        )
    if hit.mapped_blocks < end:
        load = estimates.stream.seconds(hit.blocks * block_bytes) + estimates.install_s(offered * block_bytes)
        options.append((ReadPath.STREAM, offered, load))
    path, count, load = max(options, key=lambda option: option[1] * block_s - option[2])
    recompute = count * block_s
    if recompute <= load and not always_take:
        return Decision(Verdict.RECOMPUTE, 0, path, load, recompute)
    verdict = Verdict.TAKEN if count == offered else Verdict.PARTIAL
    return Decision(verdict, count, path, load, recompute)


def worth_waiting(tokens: int, prefill: TransferEstimate, wait_s: float, odds: float = 1.0) -> bool:
    """Delay a request by `wait_s` for its Lookup in flight? Only when recomputing the `tokens`
    the Lookup could bring at most (the usable prompt beyond what the engine holds), discounted
    by the odds that it brings anything (`HitOdds`), takes longer than the wait: a smaller hit
    saves less than the wait costs, and a miss saves nothing."""
    return tokens > 0 and odds * tokens / prefill.bytes_per_s > wait_s


class HitOdds:
    """How often a Lookup brings something: the weighted share of recent answers that reached
    beyond what the engine already held. The prior (1: wait for Lookups until their answers show
    otherwise) counts as one answer and the mean runs over every answer until there are
    1/`weight` of them, so a fresh engine learns within a few answers; from there each miss
    weighs `weight` (an exponentially weighted mean over about the last 1/`weight`) and each hit
    `hit_weight`. Hits weigh more because the errors cost unlike amounts: a hit the engine did
    not wait for is a whole prefill recomputed, a wait for a miss at most a grace or a step; so
    after a run of misses one hit makes Lookups worth waiting for at once (meant for a regime
    change, e.g. conversations' second turns after their first: a slow machine lost 5 of 97 hits
    there with even weights, a faster one none either way, docs/benchmarks.md). An engine whose
    Lookups keep missing (a workload without reuse) thus stops delaying requests for them; the
    Lookups still run and every answer is counted, also one nobody waited for."""

    def __init__(self, weight: float = HIT_ODDS_WEIGHT, prior: float = 1.0, hit_weight: float | None = None) -> None:
        """`hit_weight` None: `HIT_ODDS_HIT_WEIGHT`, or `weight` where that is larger."""
        hit_weight = max(weight, HIT_ODDS_HIT_WEIGHT) if hit_weight is None else hit_weight
        if not 0 < weight <= 1 or not 0 < hit_weight <= 1 or not 0 <= prior <= 1:
            raise ValueError(
                f"hit odds need 0 < weight, hit_weight <= 1 and 0 <= prior <= 1, got {weight}, {hit_weight}, {prior}"
            )
        self._weights = (weight, hit_weight)
        self._value = prior
        self._answers = 0
        self._lock = threading.Lock()

    def observe(self, hit: bool) -> None:
        """One Lookup answered: it brought something (`hit`) or nothing."""
        with self._lock:
            self._answers += 1
            self._value += max(self._weights[hit], 1 / (self._answers + 1)) * (float(hit) - self._value)

    @property
    def value(self) -> float:
        return self._value


class PrefillMeter:
    """An engine's prefill cost, `seconds = latency + tokens / tokens_per_s`, learned online.

    Fed either way (an engine uses one):
    - `observe(tokens, seconds)`: one timed prefill of `tokens` computed tokens (the worker);
    - `step(tokens, load_s)`: an engine that only sees its steps go by (vLLM calls the scheduler
      side once per step, right after scheduling it): the time from one call to the next is
      that step's forward (and output processing) plus the next step's scheduling. From it are
      taken the time the caller itself spent in the interval (its Lookups, `exclude`) and the
      estimated time of the step's planned loads (copied inside the forward, so not the
      engine's compute). A gap in which the engine had no request (`idle`) is not a step. A
      step's tokens are all it scheduled (prefill and decode alike: a forward costs per token),
      so the rate is the marginal tokens per second that a hit saves.
    The prior holds until a sample arrives, and again once the samples are `stale_s` old.
    """

    def __init__(
        self,
        prior: TransferEstimate = PREFILL_PRIOR,
        *,
        stale_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "measured prefill cost",
        unit: str = "prefills",
        logger: logging.Logger = log,
    ) -> None:
        """`name`, `unit` and `logger`: how `log` writes the estimate ("<name> <ms> ms + <rate>
        tokens/s (<n> <unit>)")."""
        self._clock = clock
        self._meter = TransferMeter(prior, stale_s=stale_s, clock=clock)
        self._open: tuple[float, int, float] | None = None  # (start, tokens, planned load seconds)
        self._excluded = 0.0
        self.name, self.unit, self._log = name, unit, logger
        self.steps = 0  # steps timed so far

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill of `tokens` computed tokens that took `seconds`."""
        self._meter.observe(tokens, seconds)

    def step(self, tokens: int, load_s: float = 0.0) -> None:
        """A step of `tokens` scheduled tokens starts now (0: nothing); closes the previous one."""
        now = self._clock()
        if self._open is not None:
            started, previous, previous_load_s = self._open
            seconds = now - started - self._excluded - previous_load_s
            if previous > 0 and 0 < seconds < MAX_STEP_S:
                self._meter.observe(previous, seconds)
                self.steps += 1
                if self.steps >= 8 and not self.steps & (self.steps - 1):
                    self.log()  # at 8, 16, 32, ... timed steps
        self._open, self._excluded = ((now, tokens, load_s) if tokens > 0 else None), 0.0

    def exclude(self, seconds: float) -> None:
        """Time inside the open step that was the caller's, not the engine's (a Lookup)."""
        self._excluded += seconds

    def idle(self) -> None:
        """The engine had nothing running: the open interval includes waiting for requests."""
        self._open, self._excluded = None, 0.0

    def estimate(self) -> TransferEstimate:
        return self._meter.estimate()

    @property
    def tokens_per_s(self) -> float:
        return self._meter.estimate().bytes_per_s

    @property
    def s_per_token(self) -> float:
        return 1.0 / self.tokens_per_s

    def log(self) -> None:
        """The cost as measured so far, at INFO (vLLM: at 8, 16, 32, ... steps and at shutdown, so
        a line survives an engine process killed before its shutdown)."""
        e = self.estimate()
        self._log.info(
            "%s %.3g ms + %.4g tokens/s (%s)",
            self.name,
            1000 * e.latency_s,
            e.bytes_per_s,
            f"{e.samples} {self.unit}" if e.samples else "the prior",
        )
