"""The one wait-until helper of the tests and benchmarks: a bounded poll, never a blind sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(condition: Callable[[], T], timeout_s: float, what: str | None = None, interval_s: float = 0.05) -> T:
    """Calls `condition` until it returns a truthy value, and returns that value.

    At the deadline: with `what`, raises TimeoutError naming it and the last value; without,
    returns the last (falsy) value, for `assert poll(...), "message"`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            if what is None:
                return value
            raise TimeoutError(f"{what}: not true after {timeout_s}s (last value {value!r})")
        time.sleep(interval_s)
