"""The worker's load-or-recompute decisions during a replay, read from its Prometheus `/metrics`.

Owns: scraping `GET <target>/metrics` before and after a run and turning the two scrapes into
the report's `hit_policy` section (services/worker/hit_policy.py defines the metrics):
- `decisions`: requests whose cached prefix was taken, partly taken, recomputed instead
  (loading was estimated slower), or that had nothing usable (miss), during the run;
- `hit_blocks`: offered blocks loaded / declined by the worker, during the run;
- `remote_blocks_declined`: blocks the service did not fetch from Redis on the worker's
  budget (slower than recomputing them), during the run;
- `estimated_seconds`: of the options taken: loading them, and prefilling them instead;
- `estimates`: at the end of the run, the marginal prefill cost (seconds per token) and each
  read path's latency and rate (shared_memory, stream, install).

Invariants: the section is plain JSON, or None when the target does not expose these metrics
(any OpenAI-compatible server other than the reference worker); a failed scrape never fails
the replay (it is logged and the section is None).

Also owns `StoreSettle`: in an interleaved A/B run one request at a time (the session passes it
only at concurrency 1), waits before each no-cache request until the
reference worker's background stores are done (`prefixcache_worker_stores_pending` is 0), so the
cached worker's store work never runs during its twin's request on a shared machine (it may
still run during the cached worker's own next request, as it would in production). Bounded:
it gives up after `timeout_s` and never fails the replay.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_DECISIONS = "prefixcache_worker_hit_decisions_total"
_PENDING = "prefixcache_worker_stores_pending"
_PENDING_LINE = re.compile(rf"^{_PENDING} (\S+)$", re.MULTILINE)


def metrics_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/metrics"


def scrape(base_url: str, timeout_s: float = 5.0) -> Scrape | None:
    """Every sample of the target's /metrics, or None when it has none of the worker's decisions."""
    url = metrics_url(base_url)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - the user's own target
            return parse(response.read().decode("utf-8", errors="replace"))
    except (OSError, urllib.error.URLError, ValueError) as error:
        log.info("no worker metrics at %s (%s); the report has no hit_policy section", url, error)
        return None


def parse(text: str) -> Scrape | None:
    """Samples of a Prometheus text exposition, or None when it has none of the worker's decisions."""
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples if any(name == _DECISIONS for name, _ in samples) else None


def _by_label(scrape: Scrape, name: str, label: str) -> dict[str, float]:
    return {
        dict(labels)[label]: value
        for (sample, labels), value in scrape.items()
        if sample == name and label in dict(labels)
    }


def _delta(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    start = _by_label(before, name, label)
    return {key: value - start.get(key, 0.0) for key, value in sorted(_by_label(after, name, label).items())}


def section(base_url: str, before: Scrape | None, after: Scrape | None) -> dict[str, Any] | None:
    """The report's `hit_policy` section from scrapes before and after the run (see the module docstring)."""
    if before is None or after is None:
        return None
    declined = after.get(("prefixcache_worker_remote_blocks_declined_total", ()), 0.0) - before.get(
        ("prefixcache_worker_remote_blocks_declined_total", ()), 0.0
    )
    return {
        "url": metrics_url(base_url),
        "decisions": {k: int(v) for k, v in _delta(before, after, _DECISIONS, "decision").items()},
        "hit_blocks": {
            k: int(v) for k, v in _delta(before, after, "prefixcache_worker_hit_blocks_total", "outcome").items()
        },
        "remote_blocks_declined": int(declined),
        "estimated_seconds": _delta(before, after, "prefixcache_worker_hit_estimated_seconds_total", "estimate"),
        "estimates": {
            "prefill_seconds_per_token": after.get(("prefixcache_worker_prefill_seconds_per_token", ())),
            "latency_s": _by_label(after, "prefixcache_worker_transfer_latency_seconds", "path"),
            "bytes_per_s": _by_label(after, "prefixcache_worker_transfer_bytes_per_second", "path"),
        },
    }


def stores_pending(text: str) -> float | None:
    """The worker's `prefixcache_worker_stores_pending` gauge in a /metrics text, or None."""
    match = _PENDING_LINE.search(text)
    return float(match.group(1)) if match else None


class StoreSettle:
    """Awaitable: returns once the reference worker at `base_url` has no background store pending
    (see the module docstring); `waits` and `waited_s` count what it did."""

    def __init__(self, base_url: str, timeout_s: float = 5.0, poll_s: float = 0.002) -> None:
        self.url = metrics_url(base_url)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.waits = 0
        self.waited_s = 0.0
        self.gave_up = 0

    def _pending(self) -> float | None:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310 - the user's target
                return stores_pending(response.read().decode("utf-8", errors="replace"))
        except (OSError, urllib.error.URLError, ValueError):
            return None

    async def __call__(self) -> None:
        started = time.perf_counter()
        deadline = started + self.timeout_s
        while True:
            pending = await asyncio.to_thread(self._pending)
            if not pending:  # 0, or not the reference worker / unreachable: nothing to wait for
                break
            if time.perf_counter() >= deadline:
                self.gave_up += 1
                break
            await asyncio.sleep(self.poll_s)
        waited = time.perf_counter() - started
        self.waits += 1
        self.waited_s += waited
