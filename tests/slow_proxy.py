"""A deliberately slow TCP proxy on loopback, for tests: latency per chunk and a bandwidth cap.

`SlowProxy(target_port, latency_s=..., bytes_per_s=...).start()` listens on a free loopback
port and relays every connection to `127.0.0.1:target_port` from an asyncio loop running in a
thread of its own. Each direction of each connection behaves like a slow link: a chunk read
at time t leaves no earlier than t + latency_s (propagation), and chunks leave one after
another at no more than bytes_per_s (serialisation), so a reply of n bytes takes about
latency_s + n / bytes_per_s. `latency_s` and `bytes_per_s` may be changed while it runs
(plain float attributes, read per chunk). `stop()` closes the listener and every connection.
"""

from __future__ import annotations

import asyncio
import threading
import time

from tests.support.redis_server import free_port

CHUNK_BYTES = 16 << 10
READY_TIMEOUT_S = 10.0


class SlowProxy:
    def __init__(
        self, target_port: int, latency_s: float = 0.02, bytes_per_s: float = 4e6, target_host: str = "127.0.0.1"
    ) -> None:
        if latency_s < 0 or bytes_per_s <= 0:
            raise ValueError(f"latency_s must be >= 0 and bytes_per_s > 0, got {latency_s}, {bytes_per_s}")
        self.target = (target_host, target_port)
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        self.port = free_port()
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slow-proxy-{self.port}", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> SlowProxy:
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"slow proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._shutdown()))
            self._thread.join(READY_TIMEOUT_S)

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()

    # -- the loop thread ---------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        except OSError as error:
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._loop.stop()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._link(client_reader, upstream_writer), self._link(upstream_reader, client_writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a peer went away, or `stop()`: either way this connection is over
        finally:
            for writer in (client_writer, upstream_writer):
                writer.close()
            self._tasks.discard(task)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: chunks are stamped on arrival and released by a pacing task."""
        queue: asyncio.Queue = asyncio.Queue()
        pacer = asyncio.ensure_future(self._pace(queue, writer))
        self._tasks.add(pacer)
        pacer.add_done_callback(self._tasks.discard)
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                queue.put_nowait((time.monotonic(), chunk))
        finally:
            queue.put_nowait(None)
            await pacer

    async def _pace(self, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        free_at = 0.0  # when the link has sent everything released so far
        while (item := await queue.get()) is not None:
            arrived, chunk = item
            start = max(arrived + self.latency_s, free_at)
            free_at = start + len(chunk) / self.bytes_per_s
            delay = free_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
