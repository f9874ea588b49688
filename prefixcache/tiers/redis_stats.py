"""Counters and latency histograms of the Redis tier, and their frozen snapshot.

Counters only grow. Histograms use fixed bucket bounds so snapshots from any
two instances (or two moments) can be added or subtracted bucket by bucket.
The owner (`RedisLink`, which the tier's reader and writer share) guards every mutation
with its lock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..breaker import BreakerState
from ..transfer import TransferEstimate

LATENCY_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class LatencySnapshot:
    """`counts[i]` observations in (bounds[i-1], bounds[i]]; the last count is above every bound."""

    bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS_S) + 1)
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> tuple[int, ...]:
        """Prometheus-style running totals (`le` buckets, the last one is +Inf)."""
        totals, running = [], 0
        for n in self.counts:
            running += n
            totals.append(running)
        return tuple(totals)


class LatencyHistogram:
    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> LatencySnapshot:
        return LatencySnapshot(LATENCY_BOUNDS_S, tuple(self._counts), self._sum)


@dataclass
class RedisCounters:
    """Mutable counters; only the tier writes them, under its lock."""

    hits: int = 0
    misses: int = 0
    reads_skipped: int = 0  # fetches answered "miss" without I/O because the tier was down
    read_errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    spills_queued: int = 0
    spills_dropped: int = 0  # refused at submit (queue full, tier down, closed) or dropped from the queue
    writes_failed: int = 0  # SETs sent in a batch that failed
    integrity_failures: int = 0  # frames that failed verification, and values refused as oversized
    oversized_replies: int = 0  # values announced longer than the frame size: refused unread, key deleted
    read_deadlines: int = 0  # read round trips cut by read_deadline_s (each also a read error)
    write_deadlines: int = 0  # write batches cut by write_deadline_s (each also a failed write)
    probes_declined: int = 0  # lookups whose probe a budget cut short or skipped (ProbeBudget)
    probe_blocks_declined: int = 0  # blocks those probes never asked for
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass(frozen=True)
class RedisStats:
    state: BreakerState
    hits: int
    misses: int
    reads_skipped: int
    read_errors: int
    bytes_read: int
    bytes_written: int
    spills_queued: int
    spills_dropped: int
    writes_failed: int
    integrity_failures: int
    queue_bytes: int
    breaker_trips: int
    read_latency: LatencySnapshot
    write_latency: LatencySnapshot
    probes_declined: int = 0
    probe_blocks_declined: int = 0
    link_latency_s: float = 0.0  # the link's estimated round-trip latency ...
    link_bytes_per_s: float = 0.0  # ... and bandwidth (transfer.TransferMeter)
    link_samples: int = 0  # 0: the estimate is still the prior
    write_state: BreakerState = BreakerState.UP  # writes have a breaker of their own (`state`: reads)
    write_breaker_trips: int = 0
    oversized_replies: int = 0
    read_deadlines: int = 0
    write_deadlines: int = 0
    write_set_s: float = 0.0  # seconds per SET the writer measured (0: not yet): it sizes the batches
    reads_up: bool = True  # numeric copies of the two states for the stats maps and metrics
    writes_up: bool = True
    # The presence feed (tiers/redis_presence.py): whether engines may trust its cells, blocks they
    # hold, fingerprints announced and taken in, subscriptions redone after a fault.
    presence_live: bool = False
    presence_held: int = 0
    presence_announced: int = 0
    presence_followed: int = 0
    presence_resyncs: int = 0

    @property
    def up(self) -> bool:
        return self.state is BreakerState.UP

    @classmethod
    def of(
        cls,
        counters: RedisCounters,
        state: BreakerState,
        queue_bytes: int,
        trips: int,
        link: TransferEstimate | None = None,
        write_state: BreakerState = BreakerState.UP,
        write_trips: int = 0,
        write_set_s: float = 0.0,
    ) -> RedisStats:
        return cls(
            state=state,
            hits=counters.hits,
            misses=counters.misses,
            reads_skipped=counters.reads_skipped,
            read_errors=counters.read_errors,
            bytes_read=counters.bytes_read,
            bytes_written=counters.bytes_written,
            spills_queued=counters.spills_queued,
            spills_dropped=counters.spills_dropped,
            writes_failed=counters.writes_failed,
            integrity_failures=counters.integrity_failures,
            queue_bytes=queue_bytes,
            breaker_trips=trips,
            read_latency=counters.read_latency.snapshot(),
            write_latency=counters.write_latency.snapshot(),
            probes_declined=counters.probes_declined,
            probe_blocks_declined=counters.probe_blocks_declined,
            link_latency_s=link.latency_s if link else 0.0,
            link_bytes_per_s=link.bytes_per_s if link else 0.0,
            link_samples=link.samples if link else 0,
            write_state=write_state,
            write_breaker_trips=write_trips,
            oversized_replies=counters.oversized_replies,
            read_deadlines=counters.read_deadlines,
            write_deadlines=counters.write_deadlines,
            write_set_s=write_set_s,
            reads_up=state is BreakerState.UP,
            writes_up=write_state is BreakerState.UP,
        )
