"""Heap tuning for a process that moves multi-MiB KV frames (glibc only).

Holding a Redis batch of large frames alive at once makes glibc hand freed
memory back to the kernel after every batch, so each new frame page-faults in
again: measured, 2 MiB reads ran at ~60% of plain redis-py by default and at
86–112% with these settings (docs/benchmarks.md). The environment variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ do the same but must be set
before the process starts; `mallopt` applies them from inside.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 256 << 20  # keep up to 256 MiB of freed heap instead of trimming it
MMAP_THRESHOLD = 64 << 20  # serve blocks below 64 MiB from the heap, not fresh mmaps


def tune_for_large_frames() -> bool:
    """Apply the settings; False (and nothing changed) where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    log.debug("malloc tuned for large frames: %s", ok)
    return ok
