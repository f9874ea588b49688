"""OpenAI-compatible request parsing and response shapes (no I/O here).

Parsing turns a JSON body into a frozen `GenerationRequest` or raises `ApiError`, whose
`param` names the offending field as OpenAI's schema spells it; the HTTP layer maps it to a
400 (404 for an unknown `model`) with OpenAI's error body. Responses follow the OpenAI
chat/completions schemas, including `usage.prompt_tokens_details.cached_tokens` and logprobs.

The contract (docs/openai.md lists every field): each request field of OpenAI's chat and
completions schemas is either implemented or rejected with a 400 naming it, never silently
ignored. A field that has no effect on a single worker's output by OpenAI's own definition
(`user`, `metadata`, `safety_identifier`, `prompt_cache_key`) is validated and accepted.
A field outside the schemas (and vLLM's extensions implemented here) is rejected too, as
OpenAI rejects an unrecognized argument.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.errors import InvalidArgument
from prefixcache.retention import parse_retention

from .events import RequestKind
from .sampling import SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_TOKENS_LIMIT = 8192  # the most max_tokens one request may ask for
MAX_CACHE_TOKENS = 2**31 - 1  # prompt_cache_max_tokens' range (any prompt fits)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; chat defaults to the context left
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_TOKEN_IDS = 64

_COMMON = frozenset(
    {
        "model",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "user",
        "logprobs",
        # vLLM's extensions
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "cache_salt",
        # the cache's retention hints: OpenAI's name, and this worker's bound on what is stored
        "prompt_cache_retention",
        "prompt_cache_max_tokens",
    }
)
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "metadata",
    "store",
    "modalities",
    "audio",
    "parallel_tool_calls",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "service_tier",
    "tool_choice",
    "tools",
    "functions",
    "function_call",
    "verbosity",
    "web_search_options",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}

# Fields rejected unless their value is the neutral one (None always is): why, and what is neutral.
_UNSUPPORTED: dict[str, tuple[str, Callable[[object], bool]]] = {
    "tools": ("tool calling is not supported", lambda v: v == []),
    "tool_choice": ("tool calling is not supported", lambda v: v == "none"),
    "parallel_tool_calls": ("tool calling is not supported", lambda v: False),
    "functions": ("function calling is not supported", lambda v: v == []),
    "function_call": ("function calling is not supported", lambda v: v == "none"),
    "audio": ("audio output is not supported", lambda v: False),
    "modalities": ("only the text modality is supported", lambda v: v == ["text"]),
    "prediction": ("predicted outputs are not supported", lambda v: False),
    "reasoning_effort": ("this is not a reasoning model", lambda v: False),
    "verbosity": ("verbosity is not supported", lambda v: False),
    "web_search_options": ("web search is not supported", lambda v: False),
    "store": ("completions are not stored", lambda v: v is False),
    "service_tier": ("only the default service tier exists", lambda v: v in ("auto", "default")),
    "response_format": ('only response_format {"type": "text"} is supported', lambda v: v == {"type": "text"}),
    "suffix": ("suffix (fill-in-the-middle) is not supported", lambda v: False),
}


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    kind: RequestKind
    messages: tuple[tuple[str, str], ...]  # chat only: (system | user | assistant, text)
    prompt: str | tuple[int, ...]  # completion only
    max_tokens: int | None  # None: what the context leaves after the prompt (chat's default)
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]  # in addition to the model's own end tokens (vLLM)
    stream: bool
    include_usage: bool
    cache_salt: str | None
    echo: bool = False  # completions: the prompt's text leads the output
    # prompt_cache_retention: seconds the cache should keep the prompt's blocks (None: the
    # service's TTLs; the service bounds it per tenant); prompt_cache_max_tokens: store at most
    # that many leading prompt tokens (None: all).
    cache_retention_s: float | None = None
    cache_max_tokens: int | None = None

    @property
    def temperature(self) -> float:
        return self.sampling.temperature


def _loads(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _number(body: dict, name: str, default, low, high, integer: bool, param: str | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(f"'{param or name}' must be {kind} in [{low}, {high}], got {value!r}", param or name)
    return value


def _flag(body: dict, name: str, param: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):  # the string "false" must not mean True
        raise ApiError(f"'{param}' must be a boolean, got {value!r}", param)
    return value


def _string(body: dict, name: str, limit: int = 512) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        raise ApiError(f"'{name}' must be a string of up to {limit} characters", name)


def _metadata(body: dict) -> None:
    value = body.get("metadata")
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()
        )
    ):
        raise ApiError("'metadata' must map up to 16 keys (<= 64 characters) to strings (<= 512)", "metadata")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES}", "stop")
    return tuple(stop)


def _token_ids(value, param: str, limit: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > limit
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise ApiError(f"'{param}' must be a list of up to {limit} token ids (integers >= 0)", param)
    return tuple(value)


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 300:
        raise ApiError("'logit_bias' must map up to 300 token ids to a bias in [-100, 100]", "logit_bias")
    bias = {}
    for key, number in value.items():
        if (
            not (isinstance(key, str) and key.isdigit())
            or isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not -100 <= number <= 100
        ):
            raise ApiError(
                f"'logit_bias' must map token ids to a bias in [-100, 100], got {key!r}: {number!r}", "logit_bias"
            )
        bias[int(key)] = float(number)
    return bias


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ApiError(
                        f"messages[{i}].content[{j}] is a {kind!r} part; only text parts are supported",
                        f"messages[{i}].content[{j}].type",
                    )
                raise ApiError(
                    f'messages[{i}].content[{j}] must be {{"type": "text", "text": ...}}', f"messages[{i}].content[{j}]"
                )
            if part.get("type") != "text":
                raise ApiError(f"messages[{i}].content[{j}].type must be 'text'", f"messages[{i}].content[{j}].type")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "function_call", "refusal", "audio", "tool_call_id"}
)


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role in ("tool", "function"):
            raise ApiError(f"messages[{i}].role {role!r}: tool calling is not supported", f"messages[{i}].role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"messages[{i}].role must be system, developer, user or assistant", f"messages[{i}].role")
        for name in message:
            if name not in _MESSAGE_FIELDS:
                raise ApiError(f"messages[{i}].{name} is not a message field", f"messages[{i}].{name}")
        for name in ("name", "tool_calls", "function_call", "audio", "tool_call_id", "refusal"):
            if message.get(name) is not None:  # the chat template has no place for them
                raise ApiError(f"messages[{i}].{name} is not supported", f"messages[{i}].{name}")
        # developer is the newer name of system (OpenAI); the templates here know system.
        parsed.append(("system" if role == "developer" else role, _content(message.get("content"), i)))
    return tuple(parsed)


def _prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    raise ApiError("'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def _check_fields(body: dict, kind: str) -> None:
    known = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for name, value in body.items():
        if name not in known:
            raise ApiError(f"Unrecognized request argument supplied: {name}", name, code="unknown_parameter")
        if name in _UNSUPPORTED and value is not None:
            why, neutral = _UNSUPPORTED[name]
            if not neutral(value):
                raise ApiError(
                    f"'{name}' = {json.dumps(value)[:80]} is not supported: {why}", name, code="unsupported_parameter"
                )
    stream_options = body.get("stream_options")
    if isinstance(stream_options, dict):
        for name, value in stream_options.items():
            if name == "include_obfuscation" and value is not None and value is not False:
                raise ApiError(
                    "stream_options.include_obfuscation is not supported",
                    "stream_options.include_obfuscation",
                    code="unsupported_parameter",
                )
            if name not in ("include_usage", "include_obfuscation"):
                raise ApiError(f"stream_options.{name} is not a stream option", f"stream_options.{name}")


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top alternatives to report per token, or None for no logprobs."""
    if kind == "chat":
        wanted = _flag(body, "logprobs", "logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_CHAT_TOP_LOGPROBS, True)
        if top is not None and not wanted:
            raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else None
    return _number(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, True)


def _sampling(body: dict, kind: str) -> SamplingParams:
    top_k = _number(body, "top_k", 0, -1, 1 << 20, True)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, False)
    if top_p == 0:
        raise ApiError("'top_p' must be in (0, 1], got 0", "top_p")
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 2.0, False)
    if repetition == 0:
        raise ApiError("'repetition_penalty' must be in (0, 2], got 0", "repetition_penalty")
    return SamplingParams(
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0, False)),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(_number(body, "min_p", 0.0, 0.0, 1.0, False)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0, False)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0, False)),
        repetition_penalty=float(repetition),
        logit_bias=_logit_bias(body),
        logprobs=_logprobs(body, kind),
    )


def check_model(body_model, served: str) -> None:
    if body_model is None:
        return  # optional here (vLLM too): one worker serves one model
    if not isinstance(body_model, str):
        raise ApiError("'model' must be a string", "model")
    if body_model != served:
        raise ApiError(
            f"The model `{body_model}` does not exist (this worker serves `{served}`)",
            "model",
            status=404,
            code="model_not_found",
        )


def parse_request(raw: bytes, kind: str, served_model: str | None = None) -> GenerationRequest:
    """`served_model`: the name `model` must match (None: not checked)."""
    body = _loads(raw)
    _check_fields(body, kind)
    if served_model is not None:
        check_model(body.get("model"), served_model)
    stream_options = body.get("stream_options")
    stream_options = {} if stream_options is None else stream_options
    if not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    salt = _salt(body)
    for name in ("n", "best_of"):
        choices = body.get(name)
        if choices is not None and (isinstance(choices, bool) or choices != 1):
            raise ApiError(f"'{name}' must be 1 (one choice per request), got {choices!r}", name)
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        _string(body, name)
    _metadata(body)
    stream = _flag(body, "stream", "stream")
    include_usage = _flag(stream_options, "include_usage", "stream_options.include_usage")
    if body.get("stream_options") is not None and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default_tokens = None if kind == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling = _sampling(body, kind)
    echo = _flag(body, "echo", "echo") if kind == "completion" else False
    if echo and sampling.logprobs is not None:
        raise ApiError("'echo' with 'logprobs' is not supported (no logprobs of prompt tokens)", "echo")
    stop_ids = body.get("stop_token_ids")
    return GenerationRequest(
        kind=RequestKind(kind),
        messages=_messages(body) if kind == "chat" else (),
        prompt=_prompt(body) if kind == "completion" else "",
        max_tokens=_number(body, tokens_field, default_tokens, 1, MAX_TOKENS_LIMIT, True),
        sampling=sampling,
        seed=_number(body, "seed", None, 0, 2**63 - 1, True),
        stop=_stop(body),
        stop_token_ids=frozenset(
            () if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        ),
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        echo=echo,
        cache_retention_s=_retention(body),
        cache_max_tokens=_number(body, "prompt_cache_max_tokens", None, 0, MAX_CACHE_TOKENS, True),
    )


def _retention(body: dict) -> float | None:
    try:
        return parse_retention(body.get("prompt_cache_retention"))
    except InvalidArgument as error:
        raise ApiError(str(error), "prompt_cache_retention") from None


@dataclass(frozen=True)
class TokenizeRequest:
    """/tokenize (vLLM's shape): a completions `prompt` or chat `messages` (template applied)."""

    messages: tuple[tuple[str, str], ...]
    prompt: str
    cache_salt: str | None


def _salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128 or not salt.isprintable()):
        raise ApiError("'cache_salt' must be 1 to 128 printable characters", "cache_salt")
    return salt


def parse_tokenize(raw: bytes, served_model: str) -> TokenizeRequest:
    body = _loads(raw)
    for name in body:
        if name not in ("model", "prompt", "messages", "cache_salt"):
            raise ApiError(f"Unrecognized request argument supplied: {name}", name, code="unknown_parameter")
    check_model(body.get("model"), served_model)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("give exactly one of 'prompt' or 'messages'", "prompt")
    if "messages" in body:
        return TokenizeRequest(_messages(body), "", _salt(body))
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("'prompt' must be a non-empty string", "prompt")
    return TokenizeRequest((), prompt, _salt(body))


def parse_detokenize(raw: bytes, served_model: str) -> list[int]:
    body = _loads(raw)
    for name in body:
        if name not in ("model", "tokens"):
            raise ApiError(f"Unrecognized request argument supplied: {name}", name, code="unknown_parameter")
    check_model(body.get("model"), served_model)
    return list(_token_ids(body.get("tokens"), "tokens", 1 << 20))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class Logprob:
    """One generated token's logprob, decoded: what both APIs' logprobs objects are built from."""

    text: str
    raw: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...]


class ResponseShaper:
    """Builds the response objects of one request (ids and timestamps fixed once)."""

    def __init__(self, kind: str, model: str, logprobs: bool = False) -> None:
        self.kind = kind
        self.model = model
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset of the next token

    def _envelope(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: tuple[Logprob, ...]) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": e.text,
                        "logprob": e.logprob,
                        "bytes": list(e.raw),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # vLLM's shape: the k most likely, plus the chosen token
            "top_logprobs": [{**{t: lp for t, _, lp in e.top}, e.text: e.logprob} for e in entries],
            "text_offset": offsets,
        }

    def skip_text(self, text: str) -> None:
        """Echoed prompt text: later tokens' text offsets start after it."""
        self._offset += len(text)

    def chunk(
        self, text: str, finish_reason: str | None, first: bool = False, logprobs: tuple[Logprob, ...] = ()
    ) -> dict:
        if self.kind == "chat":
            delta = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta if text or first else {}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        if self.logprobs:
            choice["logprobs"] = self._logprobs(logprobs) if logprobs else None
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, usage_body: dict) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage_body}

    def full(self, text: str, finish_reason: str, usage_body: dict, logprobs: tuple[Logprob, ...] = ()) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        choice["logprobs"] = self._logprobs(logprobs)
        return {**self._envelope(False), "choices": [choice], "usage": usage_body}
