"""OpenAI-compatible HTTP front end of the worker (aiohttp).

Concurrency model: requests are accepted concurrently but generated one at a
time, in arrival order, on a single inference thread (a CPU model gains
nothing from interleaving, and one owner keeps the model and the cache link
simple). Each request's events flow back to its handler through an asyncio
queue. A client that disconnects (streaming or not: aiohttp cancels the
handler when its connection is lost) sets its request's cancel flag, which
stops its generation at the next token and releases its lease; a request that
fails only fails itself. A response ends at the backend's `Finished` event: the
cache store that follows it (a copy on the inference thread, RPCs on store_queue.py's
thread) is never waited for.

With `api_key` set, every route but /health and /metrics (probes and scrapers) needs
`Authorization: Bearer KEY`, compared in constant time (vLLM's --api-key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefixcache.version import version

from .events import Finished, Piece, RequestKind, Started
from .openai_api import (
    ApiError,
    GenerationRequest,
    ResponseShaper,
    parse_detokenize,
    parse_request,
    parse_tokenize,
    usage,
)

log = logging.getLogger(__name__)


class Backend(Protocol):
    model_name: str
    registry: CollectorRegistry

    @property
    def cache_state(self) -> str:
        """ "off" (--no-cache), or the cache link's "up" / "down" / "pending"."""

    def generate(self, request: GenerationRequest, cancelled: threading.Event) -> Iterator[Started | Piece | Finished]:
        """Runs on the inference thread: Started, then text pieces, then Finished."""

    def tokenize(self, request) -> dict:
        """/tokenize's answer for an `openai_api.TokenizeRequest` (inference thread)."""

    def detokenize(self, tokens: list[int]) -> str:
        """/detokenize's text (inference thread)."""


class _End:
    """Sentinel closing a request's event queue, optionally with the error that ended it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


OPEN_PATHS = frozenset({"/health", "/metrics"})  # never behind --api-key


class WorkerApp:
    def __init__(self, backend: Backend, api_key: str | None = None) -> None:
        self.backend = backend
        self._api_key = None if api_key is None else api_key.encode()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self.app = web.Application(client_max_size=8 * 1024 * 1024, middlewares=[self._errors, self._auth])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/version", self.version),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        self.app.on_shutdown.append(self._shutdown)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._api_key is None or request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise ApiError("Incorrect API key provided (Authorization: Bearer KEY)", status=401, code="invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status)
        except web.HTTPException as error:
            if error.status >= 400:
                body = ApiError(error.reason or "request failed", status=error.status).body()
                return web.json_response(body, status=error.status)
            raise

    async def _shutdown(self, _app: web.Application) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def health(self, _request: web.Request) -> web.Response:
        # Healthy whatever the cache's state: the worker fails open and serves without it.
        return web.json_response({"status": "ok", "model": self.backend.model_name, "cache": self.backend.cache_state})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.backend.model_name, "object": "model", "owned_by": "prefixcache"}]}
        )

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": version()})

    async def _on_inference_thread(self, function, *args):
        # The tokenizer and the cache link belong to the inference thread (module docstring).
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def tokenize(self, request: web.Request) -> web.Response:
        parsed = parse_tokenize(await request.read(), self.backend.model_name)
        return web.json_response(await self._on_inference_thread(self.backend.tokenize, parsed))

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = parse_detokenize(await request.read(), self.backend.model_name)
        return web.json_response({"prompt": await self._on_inference_thread(self.backend.detokenize, tokens)})

    async def metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.backend.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, RequestKind.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, RequestKind.COMPLETION)

    async def _serve(self, http: web.Request, kind: RequestKind) -> web.StreamResponse:
        parsed = parse_request(await http.read(), kind, self.backend.model_name)
        cancelled = threading.Event()
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._pump, parsed, cancelled, events, loop)
        try:
            if parsed.stream:
                return await self._stream(http, parsed, events)
            return await self._collect(parsed, events)
        except BaseException:
            cancelled.set()  # stops generation on disconnect (the handler is cancelled)
            await asyncio.shield(future)
            raise
        # Ended at the backend's Finished: what the inference thread still does for this request
        # (copying its blocks for the cache) must not hold the response (store_queue.py).

    def _pump(
        self,
        parsed: GenerationRequest,
        cancelled: threading.Event,
        events: asyncio.Queue,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        end = _End()
        try:
            if not cancelled.is_set():
                for event in self.backend.generate(parsed, cancelled):
                    loop.call_soon_threadsafe(events.put_nowait, event)
        except ApiError as error:
            end = _End(error)
        except Exception as error:  # noqa: BLE001 - one request's failure must not stop the worker
            log.exception("generation failed")
            end = _End(error)
        loop.call_soon_threadsafe(events.put_nowait, end)

    async def _events(self, events: asyncio.Queue):
        while True:
            event = await events.get()
            if isinstance(event, _End):
                if event.error is not None:
                    raise event.error
                return
            yield event

    async def _collect(self, parsed: GenerationRequest, events: asyncio.Queue) -> web.Response:
        shaper = ResponseShaper(parsed.kind, self.backend.model_name, parsed.sampling.logprobs is not None)
        pieces, logprobs, started, finished = [], [], None, None
        try:
            async for event in self._events(events):
                if isinstance(event, Started):
                    started = event
                elif isinstance(event, Finished):
                    finished = event
                    break  # the response is complete: never wait for the backend's store
                else:
                    pieces.append(event.text)
                    logprobs.extend(event.logprobs)
                    if event.echo:
                        shaper.skip_text(event.text)
        except ApiError:
            raise
        except Exception as error:  # noqa: BLE001 - reported to this client only
            return web.json_response(
                {
                    "error": {
                        "message": f"generation failed: {error}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=500,
            )
        assert started is not None and finished is not None  # the backend yields Started first, Finished last
        body = usage(started.prompt_tokens, finished.completion_tokens, started.cached_tokens)
        response = web.json_response(shaper.full("".join(pieces), finished.finish_reason, body, tuple(logprobs)))
        finished.delivered.set()  # built; aiohttp writes it as this handler returns
        return response

    async def _stream(self, http: web.Request, parsed: GenerationRequest, events: asyncio.Queue) -> web.StreamResponse:
        shaper = ResponseShaper(parsed.kind, self.backend.model_name, parsed.sampling.logprobs is not None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        started = finished = None

        async def send(payload: dict) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        try:
            async for event in self._events(events):
                if isinstance(event, Started):
                    started = event
                    await response.prepare(http)
                    if parsed.kind == "chat":
                        await send(shaper.chunk("", None, first=True))
                elif isinstance(event, Finished):
                    finished = event
                    await send(shaper.chunk("", event.finish_reason))
                    if parsed.include_usage:
                        assert started is not None  # the backend yields Started before anything else
                        await send(
                            shaper.usage_chunk(
                                usage(started.prompt_tokens, event.completion_tokens, started.cached_tokens)
                            )
                        )
                    break  # the response is complete: [DONE] never waits for the backend's store
                else:
                    if event.echo:
                        shaper.skip_text(event.text)
                    await send(shaper.chunk(event.text, None, logprobs=event.logprobs))
        except ApiError:
            if not response.prepared:
                raise
            await send(ApiError("generation failed").body())
        except ConnectionResetError:  # the client went away mid-stream: nothing left to tell it
            log.info("client disconnected mid-stream; generation stopped")
            return response
        except Exception as error:  # noqa: BLE001 - reported to this client only
            if not response.prepared:
                await response.prepare(http)
            await send({"error": {"message": f"generation failed: {error}", "type": "server_error"}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        if finished is not None:
            finished.delivered.set()  # the request's background store may start now (store_queue.py)
        return response


async def run_app(app: WorkerApp, host: str, port: int, ready: threading.Event | None = None) -> None:
    """Serve until cancelled (SIGINT/SIGTERM handled by the caller's loop)."""
    # handler_cancellation: a lost connection cancels its handler, whose `finally` stops the
    # generation (without it a non-streaming request would run to max_tokens for nobody).
    runner = web.AppRunner(app.app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("worker listening on http://%s:%d", host, port)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
