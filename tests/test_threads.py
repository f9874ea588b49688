"""The connector's threads name themselves for the OS (prefixcache/threads.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from prefixcache.threads import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")


def _named(name: str) -> str:
    seen: list[str] = []

    def run() -> None:
        name_os_thread(name)
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_shows_its_name_to_the_os_cut_to_fifteen_bytes() -> None:
    assert _named("pfx-save") == "pfx-save"
    assert _named("pfx-a-name-longer-than-fifteen") == "pfx-a-name-long"


def test_naming_a_thread_leaves_the_process_and_other_threads_alone() -> None:
    before = Path("/proc/self/comm").read_text()
    _named("pfx-lookup")
    assert Path("/proc/self/comm").read_text() == before
