"""One request's life on the inference thread: the hit path.

tokenize -> lookup with a lease -> load the hit blocks -> prefill only the
suffix -> stream tokens -> commit the prompt's new full blocks -> release the
lease. Text is detokenised incrementally; stop strings end the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram

from .cache_link import CacheLink, Prefix
from .chat import ChatMessage, Role
from .engine import Engine
from .events import Finished, FinishReason, LinkState, RequestKind, Started
from .openai_api import ApiError, GenerationRequest

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("prefixcache_worker_requests", "Requests served", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("prefixcache_worker_prompt_tokens", "Prompt tokens received", registry=registry)
        self.cached_tokens = Counter("prefixcache_worker_cached_tokens", "Prompt tokens loaded from the cache",
                                     registry=registry)
        self.ttft = Histogram("prefixcache_worker_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS,
                              registry=registry)


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
        piece = text[self._sent:] if len(text) > self._sent else ""
        self._sent = max(self._sent, len(text))
        return piece


class InferenceBackend:
    """Implements `http.Backend` with an `Engine` and an optional `CacheLink`."""

    def __init__(self, engine: Engine, cache: CacheLink | None, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.cache = cache
        self.registry = registry
        self.metrics = WorkerMetrics(registry)
        self.model_name = engine.loaded.model_id
        self._vocab = engine.loaded.model.get_input_embeddings().num_embeddings

    @property
    def cache_state(self) -> LinkState:
        return LinkState.OFF if self.cache is None else self.cache.state

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        loaded = self.engine.loaded
        try:
            if request.kind is RequestKind.CHAT:
                tokens = loaded.render_chat([ChatMessage(Role(r), c) for r, c in request.messages])
            elif isinstance(request.prompt, tuple):
                tokens = list(request.prompt)
            else:
                tokens = loaded.tokenizer.encode(request.prompt)
        except ValueError as error:
            raise ApiError(str(error), "messages" if request.kind is RequestKind.CHAT else "prompt") from None
        if not tokens:
            raise ApiError("the prompt encodes to no tokens", "prompt")
        bad = next((t for t in tokens if not 0 <= t < self._vocab), None)
        if bad is not None:  # before the cache lookup: the service would reject it too
            raise ApiError(f"token id {bad} is outside the model vocabulary [0, {self._vocab})", "prompt")
        if not self.engine.fits(len(tokens) + 1):
            raise ApiError(f"the prompt has {len(tokens)} tokens; the model allows {loaded.max_positions}",
                           "messages" if request.kind is RequestKind.CHAT else "prompt")
        return tokens

    def generate(self, request: GenerationRequest, cancelled: threading.Event) -> Iterator[Started | str | Finished]:
        started_at = time.perf_counter()
        tokens = self.prompt_tokens(request)
        prefix = self.cache.lookup(tokens, request.cache_salt) if self.cache else Prefix(0, None, None)
        generation = None
        try:
            try:
                generation = self.engine.generate(tokens, prefix.blocks, max_tokens=request.max_tokens,
                                                  temperature=request.temperature, seed=request.seed,
                                                  should_stop=cancelled.is_set)
            except ValueError as error:
                raise ApiError(str(error), "prompt") from None
            if self.cache is not None:
                self.cache.observe(generation.prefill, prefix.blocks)  # load-or-recompute estimates
            yield Started(len(tokens), prefix.tokens)
            self.metrics.prompt_tokens.inc(len(tokens))
            self.metrics.cached_tokens.inc(prefix.tokens)
            yield from self._stream(generation, request, started_at)
            self.metrics.requests.labels("ok" if not cancelled.is_set() else "cancelled").inc()
        finally:
            if self.cache is not None:
                if generation is not None and not cancelled.is_set():
                    start_block = prefix.hit.blocks if prefix.hit else 0
                    count = self.cache.blocks_to_store(tokens, start_block)
                    if count:
                        kv = self.engine.extract_blocks(generation.cache, start_block, count, self.cache.layout.block_size)
                        self.cache.store(tokens, kv, start_block, request.cache_salt)
                self.cache.release(prefix.hit)

    def _stream(self, generation, request: GenerationRequest, started_at: float) -> Iterator[str | Finished]:
        text = TextStream(self.engine.loaded.tokenizer.decode, request.stop)
        count, first = 0, True
        for token in generation:
            count += 1
            piece = text.push(token)
            if first:
                self.metrics.ttft.observe(time.perf_counter() - started_at)
                first = False
            if piece:
                yield piece
            if text.stopped:
                break
        tail = text.flush()
        if tail:
            yield tail
        reason = FinishReason.STOP if text.stopped or generation.finish_reason is FinishReason.STOP \
            else FinishReason.LENGTH
        yield Finished(reason, count)
