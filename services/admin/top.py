"""`prefixcache top`: the live view's loop, keyboard and terminal handling.

On a terminal it takes over the screen (rich `Live`, alternate screen), polls
`GetStats` every `--interval` and redraws; `q` or Ctrl-C quits with exit 0
and the terminal restored. When stdout is not a terminal it prints
`--iterations` frames (default 1) as plain text, each after one interval, so
the rates in every frame are real; scripts should prefer `stats --json`.

Invariants:
- The terminal's line discipline is restored on every exit path (the key
  reader is a context manager around the whole loop).
- A failure of the first `GetStats` (bad address, wrong token) ends the
  command with a one-line error; later "unreachable" answers only show a red
  status line, so a service restart does not kill a watching operator's view.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live

from prefixcache.client import CacheClient, CacheUnavailable

from .connect import AdminError, connect, describe
from .document import stats_document
from .top_model import TopModel
from .top_view import top_frame

QUIT_KEYS = frozenset("qQ")


INTERRUPT = "\x03"  # what `KeyReader.wait` returns once Ctrl-C (SIGINT) arrived


class KeyReader:
    """Single key presses from stdin in cbreak mode, and Ctrl-C as a key (`INTERRUPT`).

    SIGINT only sets a flag and wakes `wait` (a wakeup pipe): raised as KeyboardInterrupt inside
    a gRPC call it could leave the channel unable to close, and the process hung at exit."""

    def __init__(self, stream=None) -> None:
        self._stream = stream if stream is not None else sys.stdin
        self._fd: int | None = None
        self._saved: list[Any] | None = None  # termios attributes, as typeshed types them
        self._wakeup: tuple[int, int] | None = None  # the pipe signal.set_wakeup_fd writes to
        self._previous: tuple[Any, int] | None = None  # the SIGINT handler and wakeup fd replaced
        self.interrupted = False

    def __enter__(self) -> KeyReader:
        if self._stream is not None and self._stream.isatty():
            self._fd = self._stream.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = read, write
            handler = signal.signal(signal.SIGINT, self._interrupt)
            self._previous = handler, signal.set_wakeup_fd(write)
        return self

    def __exit__(self, *_exc) -> None:
        if self._fd is not None and self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
        if self._previous is not None and self._wakeup is not None:
            signal.signal(signal.SIGINT, self._previous[0])
            signal.set_wakeup_fd(self._previous[1])
            for end in self._wakeup:
                os.close(end)
            self._previous = self._wakeup = None

    def _interrupt(self, _signum: int, _frame: Any) -> None:
        self.interrupted = True

    def wait(self, timeout_s: float) -> str | None:
        """A key pressed within `timeout_s` (`INTERRUPT` after Ctrl-C), else None (without a
        terminal: just waits, or until Ctrl-C)."""
        if self.interrupted:
            return INTERRUPT
        readable = [fd for fd in (self._fd, self._wakeup[0] if self._wakeup else None) if fd is not None]
        ready, _, _ = select.select(readable, [], [], max(0.0, timeout_s))
        if self._wakeup is not None and self._wakeup[0] in ready:
            while True:  # drain the wakeup bytes
                try:
                    if not os.read(self._wakeup[0], 64):
                        break
                except BlockingIOError:
                    break
        if self.interrupted:
            return INTERRUPT
        if self._fd is None or self._fd not in ready:
            return None
        data = os.read(self._fd, 32).decode("utf-8", "replace")
        return data[:1] or None


def _sampler(client: CacheClient, address: str) -> Callable[[], dict]:
    return lambda: stats_document(client.stats(), address)


def _fetch(model: TopModel, sample: Callable[[], dict], address: str) -> str | None:
    """Add one snapshot; a status line when the service did not answer."""
    try:
        model.add(sample())
    except CacheUnavailable as error:
        return f"{describe(error, address, False)} (showing the last answer)"
    return None


def run_live(
    sample: Callable[[], dict], address: str, interval_s: float, iterations: int | None, console: Console
) -> int:
    model = TopModel()
    model.add(sample())  # errors here (bad token, unreachable) end the command
    status, shown = None, 1
    try:
        with KeyReader() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
            live.update(top_frame(model, address, interval_s, status, True), refresh=True)
            due = time.monotonic() + interval_s
            while iterations is None or shown < iterations:
                key = keys.wait(due - time.monotonic())
                if key in QUIT_KEYS or key == INTERRUPT:
                    break
                if key is not None and time.monotonic() < due:
                    continue  # another key: keep waiting for the refresh
                due = max(due + interval_s, time.monotonic() + interval_s / 2)
                status = _fetch(model, sample, address)
                shown += 1
                live.update(top_frame(model, address, interval_s, status, True), refresh=True)
    except KeyboardInterrupt:
        pass  # Ctrl-C before the key reader took SIGINT over; Live and KeyReader restored the terminal
    return 0


def run_plain(sample: Callable[[], dict], address: str, interval_s: float, iterations: int, console: Console) -> int:
    model = TopModel()
    model.add(sample())
    for frame in range(iterations):
        time.sleep(interval_s)  # pacing the polls, not waiting for readiness
        status = _fetch(model, sample, address)
        if frame:
            console.print()
        console.print(top_frame(model, address, interval_s, status, False))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise AdminError(f"--interval: must be > 0, got {args.interval:g}")
    if args.iterations is not None and args.iterations < 1:
        raise AdminError(f"--iterations: must be >= 1, got {args.iterations}")
    interactive = sys.stdout.isatty()
    if not interactive:
        print(
            "prefixcache top: stdout is not a terminal; printing "
            f"{args.iterations or 1} frame(s) (for scripts use `prefixcache stats --json`)",
            file=sys.stderr,
        )
    with connect(args) as client:
        sample = _sampler(client, client.address)
        if interactive:
            return run_live(sample, client.address, args.interval, args.iterations, Console())
        return run_plain(
            sample,
            client.address,
            args.interval,
            args.iterations or 1,
            Console(width=max(100, Console().width), no_color=True),
        )
