"""The router's HTTP side (aiohttp): OpenAI routes proxied to the engine scoring best.

Per generation request (/v1/completions, /v1/chat/completions): tokenize the prompt once (the
engine's tokenizer, prompts.py), one Match per healthy engine with a cache, concurrently, under
`--match-timeout-ms` (probe.py), an estimate per engine (scoring.py), then the body is forwarded
unchanged to the best engine. Responses carry `X-Prefixcache-Engine` and
`X-Prefixcache-Predicted-Ttft-Ms`.

Failover: an engine that refuses the connection, drops it, or answers 502/503/504 before the
router has sent the client a byte is marked unhealthy and the request goes to the next engine in
the ranking (each engine once). A stream is passed through as it arrives; the client's response
starts with the engine's first body chunk, and after that nothing is retried: an engine that dies
mid-stream ends the client's stream with an SSE error event.

Health: every `--health-interval-ms` each engine's GET /health; a failing engine is skipped until
it answers 200 again. The same loop resolves each cache's namespace (probe.py) and, with
`--discover`, re-resolves the names given: each address is an engine (a Kubernetes headless
Service lists the ready worker pods), one no longer listed is dropped once nothing is in flight
on it.

TTFT, predicted and observed, runs from the request's arrival at the router to the first SSE event
carrying text (observed for streamed requests only): the prediction is the router's time so far
plus the chosen engine's estimate. The engine's part (dispatch to first text) feeds its prefill
model (scoring.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .probe import CacheProbe
from .prompts import PromptTokenizer, conversation_key
from .scoring import EngineLoad, Estimate, Hit, PrefillModel, TierRates, rank

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
)
STICKY_ENTRIES = 100_000
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Engine:
    name: str
    url: str
    probe: CacheProbe | None
    load: EngineLoad
    healthy: bool = True


@dataclass(frozen=True)
class RouterSettings:
    match_timeout_s: float = 0.05
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    tier_rates: TierRates = field(default_factory=TierRates)
    initial_prefill_rate: float = 4000.0


class EngineLost(Exception):
    """The engine failed before the client got a byte: the request may go elsewhere."""


def engine_name(url: str) -> str:
    return urlsplit(url).netloc or url


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "prefixcache_router_"
        self.decisions = Counter(
            p + "decisions", "requests routed, by engine and reason", ["engine", "reason"], registry=registry
        )
        self.outcomes = Counter(
            p + "responses", "responses by engine and outcome", ["engine", "outcome"], registry=registry
        )
        self.failovers = Counter(
            p + "failovers",
            "requests moved off an engine that failed before the first byte",
            ["engine"],
            registry=registry,
        )
        self.matches = Counter(
            p + "matches", "Match calls by engine and outcome", ["engine", "outcome"], registry=registry
        )
        self.hit_tokens = Counter(
            p + "predicted_hit_tokens",
            "cached prompt tokens Match found on the chosen engine",
            ["engine"],
            registry=registry,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens routed", ["engine"], registry=registry)
        self.predicted = Histogram(
            p + "predicted_ttft_seconds",
            "the chosen engine's expected TTFT",
            ["engine"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.observed = Histogram(
            p + "observed_ttft_seconds",
            "dispatch to first streamed token",
            ["engine"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.error = Histogram(
            p + "ttft_prediction_ratio", "predicted / observed TTFT of streamed requests", ["engine"],
            buckets=(0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0), registry=registry,
        )  # fmt: skip
        self.healthy = Gauge(
            p + "engine_healthy", "1 while the engine passes its health check", ["engine"], registry=registry
        )
        self.in_flight = Gauge(p + "in_flight", "requests in flight per engine", ["engine"], registry=registry)
        self.rate = Gauge(
            p + "prefill_tokens_per_second", "learned prefill rate per engine", ["engine"], registry=registry
        )
        self.overhead = Gauge(
            p + "ttft_overhead_seconds", "learned fixed TTFT cost per engine", ["engine"], registry=registry
        )
        self.match_seconds = Histogram(
            p + "match_seconds", "the concurrent Match round per request",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=registry,
        )  # fmt: skip


class RouterApp:
    def __init__(
        self,
        engines: list[tuple[str, str | None]],
        tokenizer: PromptTokenizer,
        settings: RouterSettings,
        namespace: str | None = None,
        cache_auth_token: str | None = None,
        discover: list[tuple[str, int | None]] | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self._namespace = namespace
        self._cache_auth_token = cache_auth_token
        self.discover = list(discover or [])
        self.engines: list[Engine] = []
        self._discovered: dict[str, Engine] = {}  # by URL, the engines --discover found
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        for url, cache in engines:
            self.engines.append(self._engine(url, cache))
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="router")
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.generate),
                web.post("/v1/chat/completions", self.generate),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics_page),
            ]
        )
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)
        for engine in self.engines:
            self.metrics.healthy.labels(engine.name).set(1)

    # --- lifecycle -------------------------------------------------------------------------------

    async def _startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _cleanup(self, _app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._session is not None:
            await self._session.close()
        for engine in self.engines:
            if engine.probe is not None:
                engine.probe.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("health check round failed")

    def _engine(self, url: str, cache: str | None) -> Engine:
        probe = None
        if cache is not None:
            probe = CacheProbe(cache, self.settings.match_timeout_s, self._namespace, self._cache_auth_token)
        load = EngineLoad(PrefillModel(initial_rate=self.settings.initial_prefill_rate))
        return Engine(engine_name(url), url.rstrip("/"), probe, load)

    async def check_all(self) -> None:
        if self.discover:
            await self._rediscover()
        await asyncio.gather(*(self._check(engine) for engine in self.engines))

    async def _rediscover(self) -> None:
        """--discover: every address of each name is an engine (a Kubernetes headless Service's pods)."""
        loop = asyncio.get_running_loop()
        found: dict[str, str | None] = {}
        for url, cache_port in self.discover:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                infos = await loop.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
            except OSError as error:
                log.warning("--discover %s: %s", url, error)
                continue
            for info in infos:
                address = str(info[4][0])
                host = f"[{address}]" if ":" in address else address
                found[f"{parts.scheme}://{host}:{port}"] = None if cache_port is None else f"{host}:{cache_port}"
        for url, cache in found.items():
            if url not in self._discovered:
                engine = self._engine(url, cache)
                self._discovered[url] = engine
                self.engines.append(engine)
                log.info("engine %s found%s", engine.name, "" if cache is None else f" (cache {cache})")
        for url in [u for u, e in self._discovered.items() if u not in found and not e.load.flights]:
            engine = self._discovered.pop(url)
            self.engines.remove(engine)
            if engine.probe is not None:
                engine.probe.close()
            log.info("engine %s gone from the discovered addresses", engine.name)

    async def _check(self, engine: Engine) -> None:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self._session.get(engine.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok != engine.healthy:
            log.warning("engine %s is %s", engine.name, "healthy again" if ok else "failing its health check")
        engine.healthy = ok
        self.metrics.healthy.labels(engine.name).set(1 if ok else 0)
        if ok and engine.probe is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, engine.probe.resolve)
            except Exception as error:  # noqa: BLE001 - a cache that is down only makes misses
                log.debug("cache %s of %s not resolved: %s", engine.probe.address, engine.name, error)
        self.metrics.rate.labels(engine.name).set(engine.load.prefill.rate)
        self.metrics.overhead.labels(engine.name).set(engine.load.prefill.overhead_s)

    def _mark_down(self, engine: Engine) -> None:
        if engine.healthy:
            log.warning("engine %s failed a request; skipped until its health check passes", engine.name)
        engine.healthy = False
        self.metrics.healthy.labels(engine.name).set(0)

    # --- plain routes ----------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        engines = [
            {"engine": e.name, "url": e.url, "healthy": e.healthy, "in_flight": len(e.load.flights)}
            for e in self.engines
        ]
        up = any(e.healthy for e in self.engines)
        return web.json_response(
            {"status": "ok" if up else "unavailable", "engines": engines}, status=200 if up else 503
        )

    async def metrics_page(self, _request: web.Request) -> web.Response:
        for engine in self.engines:
            self.metrics.in_flight.labels(engine.name).set(len(engine.load.flights))
            self.metrics.rate.labels(engine.name).set(engine.load.prefill.rate)
            self.metrics.overhead.labels(engine.name).set(engine.load.prefill.overhead_s)
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        for engine in [e for e in self.engines if e.healthy] or self.engines:
            try:
                async with self._session.get(
                    engine.url + "/v1/models", headers=_forwarded(request.headers)
                ) as response:
                    body = await response.read()
                    return web.Response(body=body, status=response.status, content_type="application/json")
            except (aiohttp.ClientError, OSError):
                self._mark_down(engine)
        return _error(503, "no engine answered /v1/models")

    # --- generation ------------------------------------------------------------------------------

    async def _estimates(self, candidates: list[Engine], body: dict, path: str) -> list[Estimate]:
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(self._executor, self.tokenizer.tokens, path, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        now = time.monotonic()
        if tokens is None:
            return [e.load.estimate(e.name, Hit(0), self.settings.tier_rates, now) for e in candidates]
        started = time.perf_counter()

        async def hit_of(engine: Engine) -> Hit:
            if engine.probe is None:
                return Hit(len(tokens))
            hit, outcome = await engine.probe.match(self._executor, tokens, salt)
            self.metrics.matches.labels(engine.name, outcome).inc()
            return hit

        hits = await asyncio.gather(*(hit_of(e) for e in candidates))
        self.metrics.match_seconds.observe(time.perf_counter() - started)
        now = time.monotonic()
        return [
            e.load.estimate(e.name, hit, self.settings.tier_rates, now) for e, hit in zip(candidates, hits, strict=True)
        ]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            body = {}
        candidates = [e for e in self.engines if e.healthy]
        if not candidates:
            await self.check_all()  # every engine failed: look again before refusing
            candidates = [e for e in self.engines if e.healthy]
        if not candidates:
            return _error(503, "no healthy engine")
        estimates = await self._estimates(candidates, body, request.path)
        key = conversation_key(request.headers, body)
        ordered, reason = rank(estimates, self._sticky.get(key) if key else None)
        if len({round(e.ttft_s, 6) for e in ordered}) == 1 and len(ordered) > 1 and reason == "score":
            shift = next(self._rr) % len(ordered)  # an exact tie (nothing known yet): spread round-robin
            ordered = ordered[shift:] + ordered[:shift]
        by_name = {e.name: e for e in candidates}
        streaming = body.get("stream") is True
        for attempt, estimate in enumerate(ordered):
            engine = by_name[estimate.engine]
            if not engine.healthy and attempt > 0:
                continue
            self.metrics.decisions.labels(engine.name, reason if attempt == 0 else "failover").inc()
            try:
                response = await self._forward(request, raw, engine, estimate, streaming, arrived)
            except EngineLost as lost:
                log.warning("engine %s lost before the first byte (%s); trying the next", engine.name, lost)
                self._mark_down(engine)
                self.metrics.failovers.labels(engine.name).inc()
                self.metrics.outcomes.labels(engine.name, "failed_over").inc()
                continue
            if key is not None:
                self._sticky[key] = engine.name
                self._sticky.move_to_end(key)
                while len(self._sticky) > STICKY_ENTRIES:
                    self._sticky.popitem(last=False)
            return response
        return _error(503, "every engine failed before answering")

    async def _forward(
        self, request: web.Request, raw: bytes, engine: Engine, estimate: Estimate, streaming: bool, arrived: float
    ) -> web.StreamResponse:
        assert self._session is not None
        key = next(self._ids)
        load = engine.load
        load.start(key, estimate, time.monotonic())
        # The client's TTFT runs from the request's arrival: the router's own time so far (tokenizing,
        # the Match round, earlier failed attempts) is known; the engine's part is the estimate.
        predicted = time.monotonic() - arrived + estimate.ttft_s
        self.metrics.predicted.labels(engine.name).observe(predicted)
        self.metrics.hit_tokens.labels(engine.name).inc(estimate.hit.hit_tokens)
        self.metrics.prompt_tokens.labels(engine.name).inc(estimate.hit.prompt_tokens)
        headers = {
            "X-Prefixcache-Engine": engine.name,
            "X-Prefixcache-Predicted-Ttft-Ms": f"{predicted * 1000:.1f}",
            "X-Prefixcache-Hit-Tokens": str(estimate.hit.hit_tokens),
        }
        first_streamed = False
        try:
            try:
                upstream = await self._session.post(
                    engine.url + request.path, data=raw, headers=_forwarded(request.headers)
                )
            except (aiohttp.ClientError, OSError) as error:
                raise EngineLost(str(error) or type(error).__name__) from None
            async with upstream:
                if upstream.status in RETRY_STATUSES:
                    raise EngineLost(f"HTTP {upstream.status}")
                content_type = upstream.headers.get("Content-Type", "application/json")
                if not (streaming and upstream.status == 200 and content_type.startswith("text/event-stream")):
                    try:
                        data = await upstream.read()
                    except (aiohttp.ClientError, OSError) as error:
                        raise EngineLost(str(error) or type(error).__name__) from None
                    self.metrics.outcomes.labels(
                        engine.name, "ok" if upstream.status < 400 else f"http_{upstream.status}"
                    ).inc()
                    return web.Response(
                        body=data, status=upstream.status, headers={**headers, "Content-Type": content_type}
                    )
                response = web.StreamResponse(
                    status=200, headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"}
                )
                scanner = _FirstText()
                chunks = upstream.content.iter_any()
                while True:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as error:
                        if not first_streamed:
                            raise EngineLost(str(error) or type(error).__name__) from None
                        log.warning("engine %s failed mid-stream: %s (not retried)", engine.name, error)
                        self._mark_down(engine)
                        self.metrics.outcomes.labels(engine.name, "failed_mid_stream").inc()
                        message = {
                            "error": {"message": f"engine {engine.name} failed mid-stream", "type": "server_error"}
                        }
                        with contextlib.suppress(ConnectionError):
                            await response.write(b"data: " + json.dumps(message).encode() + b"\n\n")
                            await response.write_eof()
                        return response
                    if not scanner.found and scanner.feed(chunk):
                        now = time.monotonic()
                        if load.first_token(key, now) is not None:
                            observed = now - arrived
                            self.metrics.observed.labels(engine.name).observe(observed)
                            self.metrics.error.labels(engine.name).observe(predicted / max(observed, 1e-6))
                    try:
                        if not first_streamed:
                            first_streamed = True  # from here on, never retried
                            await response.prepare(request)
                        await response.write(chunk)
                    except ConnectionError:  # the client left: closing the upstream stops the generation
                        self.metrics.outcomes.labels(engine.name, "client_gone").inc()
                        return response
                if not first_streamed:
                    raise EngineLost("the stream ended before its first byte")
                self.metrics.outcomes.labels(engine.name, "ok").inc()
                with contextlib.suppress(ConnectionError):  # a client may close as soon as it reads [DONE]
                    await response.write_eof()
                return response
        finally:
            load.finish(key, time.monotonic(), streamed=first_streamed)


class _FirstText:
    """Finds the first SSE event with generated text in a stream's chunks (then stops looking)."""

    def __init__(self) -> None:
        self.found = False
        self._buffer = b""

    def feed(self, chunk: bytes) -> bool:
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            line = line.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            try:
                event = json.loads(line[5:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            choices = event.get("choices") if isinstance(event, dict) else None
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict) and ((choice.get("delta") or {}).get("content") or choice.get("text")):
                    self.found = True
                    self._buffer = b""
                    return True
        return False


def _forwarded(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error"}}
    return web.json_response(body, status=status)


async def run_router(app: RouterApp, host: str, port: int) -> None:
    runner = web.AppRunner(app.app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port  # port 0: the one the kernel chose
    print(f"prefixcache route: listening on {host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
