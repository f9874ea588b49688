"""OS-level names for prefixcache's threads that run inside vLLM's processes.

Python 3.11 names threads for Python only: in `top -H`, `/proc/PID/task/*/comm`, perf or py-spy
the connector's threads carry the process's name (`VLLM::Worker`) and cannot be told from vLLM's
own. Each of them names itself once, at its start (Linux `prctl(PR_SET_NAME)`; 15 bytes at most;
nothing elsewhere or when libc cannot be loaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

_PR_SET_NAME = 15


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_os_thread(name: str) -> None:
    """Name the calling thread `name` (cut to 15 bytes) where the OS shows thread names."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
