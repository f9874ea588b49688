"""One request's life on the inference thread: the hit path.

tokenize -> lookup with a lease -> load the hit blocks -> prefill only the
suffix -> stream tokens -> copy the prompt's new full blocks out of the model's
KV -> (store_queue.py, on its own thread) commit them and release the lease. Text is detokenised incrementally; stop strings end the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram

from .cache_link import WorkerLink
from .chat import ChatMessage, Role
from .engine import Engine
from .events import Finished, FinishReason, LinkState, Piece, Started
from .openai_api import MAX_TOKENS_LIMIT, ApiError, GenerationRequest, Logprob, TokenizeRequest
from .sampling import TokenLogprob
from .store_queue import StoreQueue

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("prefixcache_worker_requests", "Requests served", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("prefixcache_worker_prompt_tokens", "Prompt tokens received", registry=registry)
        self.cached_tokens = Counter(
            "prefixcache_worker_cached_tokens", "Prompt tokens loaded from the cache", registry=registry
        )
        self.ttft = Histogram(
            "prefixcache_worker_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=registry
        )


class TextStream:
    """Incremental detokenisation with stop strings; never splits a UTF-8 character."""

    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self._decode = decode
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._sent = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        for stop in self._stop:
            at = text.find(stop)
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character
        return self._emit(text[: len(text) - self._hold])

    def flush(self) -> str:
        return "" if self.stopped else self._emit(self._decode(self._ids))

    def _emit(self, text: str) -> str:
        piece = text[self._sent :] if len(text) > self._sent else ""
        self._sent = max(self._sent, len(text))
        return piece


class InferenceBackend:
    """Implements `http.Backend` with an `Engine` and an optional `WorkerLink`."""

    def __init__(self, engine: Engine, cache: WorkerLink | None, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.cache = cache
        self.registry = registry
        self.metrics = WorkerMetrics(registry)
        self.model_name = engine.loaded.model_id
        self._vocab = engine.vocab_size
        self.stores = None if cache is None else StoreQueue(cache, registry)  # stores off the inference thread

    @property
    def cache_state(self) -> LinkState:
        return LinkState.OFF if self.cache is None else self.cache.state

    def _encode(self, messages, prompt: str | tuple[int, ...], param: str) -> list[int]:
        loaded = self.engine.loaded
        try:
            if messages:
                return loaded.render_chat([ChatMessage(Role(r), c) for r, c in messages])
            if isinstance(prompt, tuple):
                return list(prompt)
            return loaded.tokenizer.encode(prompt)
        except ValueError as error:
            raise ApiError(str(error), param) from None

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        loaded = self.engine.loaded
        tokens = self._encode(request.messages, request.prompt, "messages" if request.kind == "chat" else "prompt")
        if not tokens:
            raise ApiError("the prompt encodes to no tokens", "prompt")
        bad = next((t for t in tokens if not 0 <= t < self._vocab), None)
        if bad is not None:  # before the cache lookup: the service would reject it too
            raise ApiError(f"token id {bad} is outside the model vocabulary [0, {self._vocab})", "prompt")
        if not self.engine.fits(len(tokens) + 1):
            raise ApiError(
                f"the prompt has {len(tokens)} tokens; the model allows {loaded.max_positions}",
                "messages" if request.kind == "chat" else "prompt",
            )
        return tokens

    def tokenize(self, request: TokenizeRequest) -> dict:
        """Token ids as the worker would prefill them, and how many leading full blocks of them
        the cache holds right now (Inspect: no lease, no LRU touch; null when the cache is off
        or unreachable)."""
        tokens = self._encode(request.messages, request.prompt, "messages" if request.messages else "prompt")
        cached = block_size = cached_tokens = None
        if self.cache is not None:
            cached = self.cache.cached_blocks(tokens, request.cache_salt)
            block_size = self.cache.layout.block_size
            cached_tokens = None if cached is None else cached * block_size
        return {
            "count": len(tokens),
            "max_model_len": self.engine.loaded.max_positions,
            "tokens": tokens,
            "block_size": block_size,
            "cached_blocks": cached,
            "cached_tokens": cached_tokens,
        }

    def detokenize(self, tokens: list[int]) -> str:
        try:
            return self.engine.loaded.tokenizer.decode(tokens)
        except ValueError as error:
            raise ApiError(str(error), "tokens") from None

    def max_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """The request's max_tokens, or (chat's default) all the context the prompt leaves."""
        limit = self.engine.loaded.max_positions
        left = MAX_TOKENS_LIMIT if limit is None else limit - prompt_tokens
        if request.max_tokens is None:
            return max(1, left)
        if request.max_tokens > left:  # OpenAI's answer, rather than a silently shorter reply
            raise ApiError(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_tokens} and max_tokens asks for {request.max_tokens} more",
                "max_tokens",
            )
        return request.max_tokens

    def _check_ids(self, request: GenerationRequest) -> None:
        for param, ids in (("logit_bias", request.sampling.logit_bias), ("stop_token_ids", request.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self._vocab), None)
            if bad is not None:
                raise ApiError(f"'{param}' names token {bad}, outside the model vocabulary [0, {self._vocab})", param)

    def _decoded(self, entry: TokenLogprob) -> Logprob:
        tokenizer = self.engine.loaded.tokenizer
        token_bytes = getattr(tokenizer, "token_bytes", None)

        def piece(token: int) -> tuple[str, bytes]:
            text = tokenizer.decode([token])
            return text, token_bytes(token) if token_bytes is not None else text.encode()

        text, raw = piece(entry.token)
        return Logprob(text, raw, entry.logprob, tuple((*piece(t), lp) for t, lp in entry.top))

    def generate(self, request: GenerationRequest, cancelled: threading.Event) -> Iterator[Started | Piece | Finished]:
        started_at = time.perf_counter()
        tokens = self.prompt_tokens(request)
        max_tokens = self.max_tokens(request, len(tokens))
        self._check_ids(request)
        hit, prefix_kv, prefix_tokens = None, None, 0  # the Hit is kept as is until its release below
        if self.cache is not None:
            hit, prefix_kv = self.cache.lookup(tokens, request.cache_salt)
            prefix_tokens = 0 if prefix_kv is None else len(prefix_kv) * self.cache.layout.block_size
        if self.stores is not None:
            self.stores.expect()  # matched by the submit in `finally` below
        generation, completed, finished = None, False, None
        try:
            try:
                stops = self.engine.loaded.stop_token_ids | request.stop_token_ids
                generation = self.engine.generate(
                    tokens,
                    prefix_kv,
                    max_tokens=max_tokens,
                    stop_token_ids=stops,
                    sampling=request.sampling,
                    seed=request.seed,
                    should_stop=cancelled.is_set,
                )
            except ValueError as error:
                raise ApiError(str(error), "prompt") from None
            if self.cache is not None:
                self.cache.observe(generation.prefill, prefix_kv)  # load-or-recompute estimates
            yield Started(len(tokens), prefix_tokens)
            self.metrics.prompt_tokens.inc(len(tokens))
            self.metrics.cached_tokens.inc(prefix_tokens)
            if request.echo:
                echoed = (
                    request.prompt if isinstance(request.prompt, str) else self.engine.loaded.tokenizer.decode(tokens)
                )
                yield Piece(echoed, (), echo=True)
            for event in self._stream(generation, request, started_at):
                if isinstance(event, Finished):  # decided before the client can cancel after its end
                    completed, finished = not cancelled.is_set(), event
                    self.metrics.requests.labels("ok" if completed else "cancelled").inc()
                yield event
        finally:
            # Resumed once the client has Finished (http.py ends the response on it): only the
            # copy of the new blocks out of the model's KV happens here; the RPCs run on the
            # store queue's thread once the response's end is written (`Finished.delivered`), so
            # neither this response nor the next request waits for them.
            if self.cache is not None:
                kv, start_block = None, hit.blocks if hit else 0
                count = self.cache.blocks_to_store(tokens, start_block, request.cache_max_tokens) if completed else 0
                if count and generation is not None:
                    try:
                        kv = self.engine.extract_blocks(
                            generation.cache, start_block, count, self.cache.layout.block_size
                        )
                    except Exception:  # noqa: BLE001 - the cache may only make a request faster
                        log.exception("copying the prompt's blocks for the cache failed")
                assert self.stores is not None  # built with the cache
                after = finished.delivered if completed and finished is not None else None
                self.stores.submit(
                    tokens, kv, start_block, request.cache_salt, hit, after=after, retention_s=request.cache_retention_s
                )

    def _stream(self, generation, request: GenerationRequest, started_at: float) -> Iterator[Piece | Finished]:
        text = TextStream(self.engine.loaded.tokenizer.decode, request.stop)
        count, first = 0, True
        logprobs: list[Logprob] = []  # of the tokens since the last piece sent
        for token in generation:
            count += 1
            piece = text.push(token)
            if generation.last_logprob is not None:
                logprobs.append(self._decoded(generation.last_logprob))
            if first:
                self.metrics.ttft.observe(time.perf_counter() - started_at)
                first = False
            if piece or (logprobs and text.stopped):
                yield Piece(piece, tuple(logprobs))
                logprobs = []
            if text.stopped:
                break
        tail = text.flush()
        if tail or logprobs:
            yield Piece(tail, tuple(logprobs))
        reason = (
            FinishReason.STOP if text.stopped or generation.finish_reason is FinishReason.STOP else FinishReason.LENGTH
        )
        yield Finished(reason, count)
