"""OpenAI-compatible request parsing and response shapes (no I/O here).

Parsing turns a JSON body into a frozen `GenerationRequest` or raises
`ApiError` whose message names the offending field; the HTTP layer maps it
to a 400 with an OpenAI-style error body. Responses follow the OpenAI
chat/completions schemas, including `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from .events import RequestKind

MAX_STOP_SEQUENCES = 4
MAX_TOKENS_LIMIT = 8192


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.param, "code": None}}


@dataclass(frozen=True)
class GenerationRequest:
    kind: RequestKind
    messages: tuple[tuple[str, str], ...]  # chat only
    prompt: str | tuple[int, ...]  # completion only
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_salt: str | None


def _loads(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _number(body: dict, name: str, default, low, high, integer: bool):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(f"'{name}' must be {kind} in [{low}, {high}], got {value!r}", name)
    return value


def _flag(body: dict, name: str, param: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):  # the string "false" must not mean True
        raise ApiError(f"'{param}' must be a boolean, got {value!r}", param)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES}", "stop")
    return tuple(stop)


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(f"messages[{i}] must be an object", f"messages[{i}]")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise ApiError(f"messages[{i}].role must be system, user or assistant", f"messages[{i}].role")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", f"messages[{i}].content")
        parsed.append((role, content))
    return tuple(parsed)


def _prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return tuple(prompt)
    raise ApiError("'prompt' must be a non-empty string or list of token ids", "prompt")


def parse_request(raw: bytes, kind: RequestKind) -> GenerationRequest:
    body = _loads(raw)
    stream_options = body.get("stream_options")
    stream_options = {} if stream_options is None else stream_options
    if not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128 or not salt.isprintable()):
        raise ApiError("'cache_salt' must be 1 to 128 printable characters", "cache_salt")
    choices = body.get("n")
    if choices is not None and (isinstance(choices, bool) or choices != 1):
        raise ApiError(f"'n' must be 1 (one choice per request), got {choices!r}", "n")
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return GenerationRequest(
        kind=kind,
        messages=_messages(body) if kind is RequestKind.CHAT else (),
        prompt=_prompt(body) if kind is RequestKind.COMPLETION else "",
        max_tokens=_number(body, tokens_field, 16, 1, MAX_TOKENS_LIMIT, True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0, False)),
        seed=_number(body, "seed", None, 0, 2**63 - 1, True),
        stop=_stop(body),
        stream=_flag(body, "stream", "stream"),
        include_usage=_flag(stream_options, "include_usage", "stream_options.include_usage"),
        cache_salt=salt,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseShaper:
    """Builds the response objects of one request (ids and timestamps fixed once)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta if text or first else {}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, usage_body: dict) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage_body}

    def full(self, text: str, finish_reason: str, usage_body: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": usage_body}
