"""Async streaming client for any OpenAI-compatible chat-completions endpoint.

Owns: one request = POST {base}/v1/chat/completions with `stream=true`,
`stream_options.include_usage=true`, `temperature=0`, `max_tokens`; parsing the Server-Sent
Events stream; timing it. Returns a `Completion` value for every request.

Invariants:
- `complete()` never raises for anything the server or network does: HTTP errors, connection
  failures, timeouts, malformed events, in-stream error objects and streams that end before
  `data: [DONE]` all come back as `Completion.error` (a short message). Programming errors
  still raise.
- `ttft_s` is measured from just before the request is sent to the first chunk that carries
  non-empty `delta.content` (a role-only first chunk does not count); `latency_s` to `[DONE]`.
- `cached_tokens` is None when the server does not report `usage.prompt_tokens_details
  .cached_tokens` (servers without prompt caching); 0 means "reported, nothing cached".
"""

from __future__ import annotations

import codecs
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class StreamProtocolError(ValueError):
    """The SSE stream broke the OpenAI streaming protocol; the message names how."""


@dataclass(frozen=True)
class Completion:
    """Outcome of one streamed chat completion (see module invariants)."""

    text: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def chat_completions_url(base_url: str) -> str:
    """`http://h:p` or `http://h:p/v1` (with or without a trailing slash) -> the endpoint URL."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"base URL must start with http:// or https://, got {base_url!r}")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


async def iter_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Split a byte stream into text lines without a line-length limit (aiohttp's readline has
    one and raises a non-client error past it); a split UTF-8 sequence is decoded whole."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[str] = []  # pieces of the current line: joined once, so long lines stay O(n)
    async for chunk in chunks:
        text = decoder.decode(chunk)
        if "\n" not in text:
            parts.append(text)
            continue
        head, *rest = text.split("\n")
        yield ("".join(parts) + head).rstrip("\r")
        *middle, tail = rest
        for line in middle:
            yield line.rstrip("\r")
        parts = [tail]
    last = "".join(parts) + decoder.decode(b"", final=True)
    if last:
        yield last.rstrip("\r")


async def iter_sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Yield the `data` payload of each SSE event (multi-line data joined by newlines)."""
    data_lines: list[str] = []
    async for line in iter_lines(chunks):
        if not line:
            if data_lines:
                yield "\n".join(data_lines)
                data_lines = []
            continue
        if line.startswith(":"):  # comment / keep-alive
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines:  # stream closed without the final blank line
        yield "\n".join(data_lines)


@dataclass
class _Accumulator:
    """Mutable state of one stream while it is read; frozen into a Completion at the end."""

    started: float
    parts: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False

    def feed(self, payload: str) -> None:
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise StreamProtocolError(f"malformed SSE data: {exc.msg}") from exc
        if not isinstance(chunk, dict):
            raise StreamProtocolError("SSE data is not a JSON object")
        if "error" in chunk:
            raise StreamProtocolError(f"server error in stream: {chunk['error']}")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if piece:
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.started
                self.parts.append(piece)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def result(self, status: int) -> Completion:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text="".join(self.parts),
            ttft_s=self.ttft_s,
            latency_s=time.perf_counter() - self.started,
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_int_or_none(details.get("cached_tokens")),
            finish_reason=self.finish_reason,
            http_status=status,
        )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ChatClient:
    """One aiohttp session against one OpenAI-compatible server. Use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_connections: int = 256,
    ) -> None:
        self.url = chat_completions_url(base_url)
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        connector = aiohttp.TCPConnector(limit=self._max_connections)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def request_body(self, messages: Sequence[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": list(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": max_tokens,
        }

    async def complete(self, messages: Sequence[dict[str, str]], max_tokens: int) -> Completion:
        """Stream one chat completion; every failure is returned in `Completion.error`."""
        if self._session is None:
            raise RuntimeError("ChatClient used outside 'async with'")
        body = self.request_body(messages, max_tokens)
        acc = _Accumulator(started=time.perf_counter())
        status: int | None = None
        try:
            async with self._session.post(self.url, json=body) as resp:
                status = resp.status
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    return _failed(acc, status, f"HTTP {resp.status}: {detail}")
                async for payload in iter_sse_data(resp.content.iter_any()):
                    acc.feed(payload)
                    if acc.done:
                        break
        except StreamProtocolError as exc:
            return _failed(acc, status, str(exc))
        except (aiohttp.ClientError, UnicodeDecodeError) as exc:
            return _failed(acc, status, f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            return _failed(acc, status, "timeout")
        if not acc.done:
            return _failed(acc, status, "stream ended before data: [DONE]")
        return acc.result(status)


def _failed(acc: _Accumulator, status: int | None, message: str) -> Completion:
    log.debug("request failed: %s", message)
    return Completion(
        text="".join(acc.parts),
        ttft_s=acc.ttft_s,
        latency_s=time.perf_counter() - acc.started,
        error=message,
        http_status=status,
    )
