"""Retention controls a caller may give: a store's retention hint and an operator pin's priority.

A retention hint (OpenAI's `prompt_cache_retention`) asks the service to keep a prompt's blocks at
least that long since their last use, in the index and in Redis, where that outlasts the service's
`--ttl` / `--redis-ttl`. The service bounds it per tenant (`--max-retention`, a credentials line's
`retention=`): a longer hint is cut to the bound and counted, never refused. A hint never shortens
a block's retention. Torch-free: the worker's HTTP layer and the vLLM scheduler parse with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .config import parse_duration
from .errors import ConfigError, InvalidArgument

# OpenAI's values: "in_memory" is the default retention (here the service's TTLs: no hint), "24h"
# the extended one. Any duration ("30m", "2h", seconds as a number) is accepted too.
IN_MEMORY = "in_memory"

# An operator pin's priority (TensorRT-LLM's retention priorities use the same range).
PIN_PRIORITIES = range(0, 101)


def parse_retention(value: object, field_name: str = "prompt_cache_retention") -> float | None:
    """Seconds of a retention hint, or None for "in_memory" / None (the service's TTLs)."""
    if value is None or value == IN_MEMORY:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidArgument(field_name, f"expected 'in_memory', '24h' or a duration such as '30m', got {value!r}")
    try:
        seconds = parse_duration(value, field_name)
    except ConfigError:
        raise InvalidArgument(
            field_name, f"expected 'in_memory', '24h' or a duration such as '30m', got {value!r}"
        ) from None
    return check_retention(seconds, field_name)


def check_retention(seconds: float | None, field_name: str = "retention_seconds") -> float | None:
    """A retention in seconds as given to a store: None, or a finite number >= 0."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise InvalidArgument(field_name, f"must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def check_priority(priority: object, field_name: str = "priority") -> int:
    """An operator pin's priority: an integer 0..100."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in PIN_PRIORITIES:
        raise InvalidArgument(
            field_name, f"must be an integer {PIN_PRIORITIES.start}..{PIN_PRIORITIES.stop - 1}, got {priority!r}"
        )
    return priority


# The keys a request's vLLM `kv_transfer_params` may carry for the connector.
RETENTION_KEY = "prompt_cache_retention"
MAX_TOKENS_KEY = "prompt_cache_max_tokens"


@dataclass(frozen=True)
class StoreHints:
    """What one request asks of its store: a retention hint (seconds; None: the service's TTLs)
    and how many leading prompt tokens to store at most (None: all)."""

    retention_s: float | None = None
    max_tokens: int | None = None


def store_hints(params: object) -> StoreHints:
    """The hints in a request's `kv_transfer_params` (vLLM's per-request dict; None: none), e.g.
    {"prompt_cache_retention": "24h", "prompt_cache_max_tokens": 4096}. Other keys belong to
    other connectors and are ignored. InvalidArgument naming the key for a bad value."""
    if params is None:
        return StoreHints()
    if not isinstance(params, Mapping):
        raise InvalidArgument("kv_transfer_params", f"expected a JSON object, got {type(params).__name__}")
    most = params.get(MAX_TOKENS_KEY)
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 0):
        raise InvalidArgument(MAX_TOKENS_KEY, f"must be an integer >= 0, got {most!r}")
    return StoreHints(parse_retention(params.get(RETENTION_KEY), RETENTION_KEY), most)
