"""The connector's counters as vLLM connector stats and Prometheus metrics.

Both roles count into a `PrefixCacheStats` (scheduler: lookups, hits, misses, offered and
external tokens, lookup errors; worker: loaded blocks/tokens, load seconds and failures, saved
blocks, save seconds and failures). vLLM collects them each step (`get_kv_connector_stats`),
sums them across roles and workers (`aggregate`), logs `reduce()` and feeds `observe` of
`PrefixCachePromMetrics`, so `vllm serve`'s /metrics shows `vllm:prefixcache_*` counters.

Invariant: every field is a monotonic count or a sum of seconds, so aggregation is addition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

FIELDS = (
    "lookups",
    "hits",
    "misses",
    "lookup_errors",
    "offered_tokens",
    "external_tokens",
    "loaded_blocks",
    "loaded_tokens",
    "loaded_layer_blocks",
    "load_seconds",
    "load_failures",
    "saved_blocks",
    "save_deduplicated",
    "save_rejected",
    "save_seconds",
    "save_failures",
    "saves_dropped",
    "saves_in_place",
    "loaded_states",
    "saved_states",
    "state_misses",
    "in_step_loads",
    "layered_loads",
    "engine_thread_cpu_seconds",
    "background_cpu_seconds",
    "lookup_grace_waits",
    "lookup_grace_seconds",
    "lookup_deferrals",
    "lookups_not_awaited",
    "lookups_skipped",
    "lookup_idle_waits",
    "lookup_idle_seconds",
)
_DESCRIPTIONS = {
    "lookups": "Lookups the scheduler sent to prefixcache",
    "hits": "Requests that loaded a prefix from prefixcache",
    "misses": "Requests that found nothing usable in prefixcache",
    "lookup_errors": "Lookups that failed (service down, slow or invalid): prefilled normally",
    "offered_tokens": "Cached tokens prefixcache offered beyond vLLM's own prefix cache",
    "external_tokens": "Tokens the scheduler told vLLM to load from prefixcache",
    "loaded_blocks": "Blocks copied from prefixcache into vLLM's KV cache",
    "loaded_tokens": "Tokens whose KV was copied from prefixcache",
    "loaded_layer_blocks": "Layer-blocks copied (a sliding-window layer copies only its window's blocks)",
    "load_seconds": "Seconds spent copying KV from prefixcache",
    "load_failures": "Scheduled loads that failed (vLLM recomputed those blocks)",
    "saved_blocks": "Blocks newly published to prefixcache",
    "save_deduplicated": "Saved blocks prefixcache already held",
    "save_rejected": "Saved blocks prefixcache had no room for",
    "save_seconds": "Seconds spent copying KV out and storing it",
    "save_failures": "Saves that failed (the blocks are simply not cached)",
    "saves_dropped": "Saves dropped: the save queue was full, or vLLM had freed a block before it was saved",
    "saves_in_place": "Saves copied straight into slots the service reserved (one copy; the save thread only commits)",
    "loaded_states": "Recurrent states (Mamba, GDN) copied from prefixcache at a hit's end",
    "saved_states": "Recurrent states newly published to prefixcache at prompt block boundaries",
    "state_misses": "Hits on a model with state layers unusable: no state stored at their last boundaries",
    "in_step_loads": "Loads copied within the step (mapped memory, cheaper than a step) instead of asynchronously",
    "layered_loads": "In-step loads copied layer by layer behind the forward (layer_loads), each layer before its attention",
    "engine_thread_cpu_seconds": "CPU seconds of the connector's hooks on vLLM's own threads (they delay its steps)",
    "background_cpu_seconds": "CPU seconds of the connector's own threads (Lookups, loads, saves), competing with vLLM",
    "lookup_grace_waits": "Times the scheduler waited briefly for a Lookup in flight instead of skipping its request a step",
    "lookup_grace_seconds": "Seconds of those waits (on vLLM's scheduler thread)",
    "lookup_deferrals": "Steps a request was skipped while its Lookup was in flight (vLLM asked again next step)",
    "lookup_idle_waits": "Times the scheduler waited for a Lookup's answer while vLLM was idle (stalls no one)",
    "lookup_idle_seconds": "Seconds of those waits: each adds to its request's time to first token",
    "lookups_skipped": (
        "Requests that prefilled without a Lookup (or without waiting for one): the service's presence "
        "table showed nothing cached past vLLM's own prefix"
    ),
    "lookups_not_awaited": (
        "Requests that prefilled without their Lookup's answer: no hit could have repaid a step's wait "
        "(at the odds of a hit, which recent misses lower)"
    ),
}


class PrefixCacheStats(KVConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> PrefixCacheStats:
        merged = PrefixCacheStats(dict(self.data))
        merged.add(**other.data)
        return merged

    def reduce(self) -> dict[str, int | float]:
        return {key: round(value, 6) if isinstance(value, float) else value for key, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsBox:
    """A thread-safe accumulator the connector drains once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = PrefixCacheStats()
        self.totals: dict[str, float] = {}  # since start (for logs and tests)

    def add(self, **counts: float) -> None:
        with self._lock:
            self._stats.add(**counts)
            for key, value in counts.items():
                self.totals[key] = self.totals.get(key, 0) + value

    @contextmanager
    def engine_thread(self) -> Iterator[None]:
        """Count the CPU time of a hook vLLM runs on its own thread (`engine_thread_cpu_seconds`;
        CPU, not wall, so a loaded machine's preemptions are not charged to the connector; its
        waits are counted apart, `lookup_grace_seconds`)."""
        with self._cpu("engine_thread_cpu_seconds"):
            yield

    def background(self) -> AbstractContextManager[None]:
        """Count the CPU time of one unit of work on a connector thread (`background_cpu_seconds`)."""
        return self._cpu("background_cpu_seconds")

    @contextmanager
    def _cpu(self, key: str) -> Iterator[None]:
        started = time.thread_time()
        try:
            yield
        finally:
            self.add(**{key: time.thread_time() - started})

    def take(self) -> PrefixCacheStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            taken, self._stats = self._stats, PrefixCacheStats()
            return taken


class PrefixCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]  # vLLM's own Counter class (multiprocess-aware)
        assert issubclass(counter_cls, Counter)
        self._counters: dict[str, dict[int, Counter]] = {}
        for key in FIELDS:
            counter = counter_cls(
                name=f"vllm:prefixcache_{key}", documentation=_DESCRIPTIONS[key], labelnames=labelnames
            )
            self._counters[key] = {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
