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
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_DECISIONS = "prefixcache_worker_hit_decisions_total"


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
