"""The worker's inference engine: prefill from cached prefix blocks, then decode.

Owns running the model for one request at a time: building the KV cache from prefix blocks,
computing only the uncached suffix, streaming generated tokens, and copying the prompt's
KV back out as blocks (layout in `kv_blocks`).

Invariants:
- At least one prompt token is always computed: prefix blocks must cover fewer tokens than
  the prompt (else `ValueError`), so there are always last-position logits to sample from.
- The suffix runs at its absolute positions (`position_ids` = prefix_len ... len - 1, then any
  pads) and only the last real position's logits are produced (`logits_to_keep`).
- Prefill buckets (on by default for bfloat16 on CPU with oneDNN, `buckets_bound_memory`):
  the computed tokens are padded at the end with `PAD_TOKEN_ID` up to `bucket_length(k)`, so
  the model only ever sees a bounded set of sequence lengths. oneDNN keeps compiled kernels
  per matmul shape, ~2.6 MiB each, so without buckets RSS grows with every new prompt length
  (docs/benchmarks.md, chaos soak). Pads come after every real token, so causal attention
  keeps them out of every real row, and they are cropped off the KV cache after the forward
  pass. In bfloat16 with `attention.PREFIX_EXACT` the logits and the KV of real positions are
  bitwise those of an unpadded prefill: a row's result does not depend on how many rows share
  the pass, the same property that makes cached == recomputed (tested in
  tests/test_worker_engine.py). float32/float16 would differ by rounding (~1e-5), one more
  reason they run unpadded by default.
- Greedy decoding is a pure function of the prompt's KV: with `attention.PREFIX_EXACT` in
  bfloat16, prefilling from cached blocks gives bitwise the same logits and tokens as a full
  prefill (float32 agrees to ~1e-6, see `attention`).
- All model work runs under `torch.inference_mode()`; `extract_blocks` returns ordinary
  tensors the caller may write to.
- An `Engine` is driven by one thread: torch parallelises inside each forward pass.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .compat import UnsupportedModelError
from .events import FinishReason
from .kv_blocks import KVLayout, blocks_to_cache, extract_blocks, validate_blocks
from .model import LoadedModel
from .sampling import GREEDY, Sampler, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # any valid id: pads sit after the real tokens and are cropped off
BUCKET_STEP = 16  # = attention.Q_CHUNK: padded suffixes are whole q chunks, no odd-sized ones
BUCKET_LINEAR_UP_TO = 256  # every multiple of 16 up to here: at most 15 pads
BUCKET_RATIO = 1.125  # then ceil16(256 * 1.125**k): at most 12.5% + 16 pads, ~6% on average


def _round_up(n: int) -> int:
    return -(-n // BUCKET_STEP) * BUCKET_STEP


def bucket_length(n: int) -> int:
    """The padded length of a prefill of `n` new tokens: the smallest bucket >= n.

    Buckets: 16, 32, ..., 256, then 288, 336, 368, ..., ceil16(256 * 1.125**k): 33 lengths
    up to 2k tokens, 52 up to 16k. oneDNN spends ~2.6 MiB once per length; the ratio trades
    that against padded compute (measured in docs/benchmarks.md, chaos soak).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if _round_up(n) <= BUCKET_LINEAR_UP_TO:
        return _round_up(n)
    k = 1  # powers of the ratio, not compounded roundings: no drift
    while (bucket := _round_up(math.ceil(BUCKET_LINEAR_UP_TO * BUCKET_RATIO**k))) < n:
        k += 1
    return bucket


def buckets_bound_memory(loaded: LoadedModel) -> bool:
    """True where unbucketed prefills grow RSS per new length: bfloat16 on CPU with oneDNN
    enabled. float32 and float16 CPU matmuls (not oneDNN's per-shape kernels) and
    `--no-onednn` stay flat without buckets (measured), so they skip the padded compute."""
    model = loaded.model
    return (
        model.device.type == "cpu"
        and model.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)  # a ContextProp; reads as the flag
    )


def rows_invariant(loaded: LoadedModel) -> bool:
    """Whether the model's matmuls give a row the same bits however many rows share the call, the
    property a cached prefill's exactness rests on. A probe of each weight shape of its linear
    layers (the LM head aside: it only ever sees one row), with four draws of random rows: 64-, 144-
    and 257-row calls against the same rows in a 640-row one (a differing kernel changes a few of
    ~36k elements, seen in ~85% of draws). oneDNN's AMX bf16 kernels fail it
    (worker/model.py caps them off, `ONEDNN_MAX_CPU_ISA`)."""
    model = loaded.model
    head = model.get_output_embeddings()
    weights = {
        tuple(m.weight.shape): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    }
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (_, width), weight in sorted(weights.items()):
            for _ in range(4):  # a kernel's different summation shows in a few elements of a draw, not every draw
                rows = torch.randn(640, width, generator=generator).to(weight.dtype).to(weight.device)
                full = torch.nn.functional.linear(rows, weight)
                if any(not torch.equal(torch.nn.functional.linear(rows[:m], weight), full[:m]) for m in (64, 144, 257)):
                    return False
    return True


@dataclass(frozen=True)
class PrefillResult:
    cache: DynamicCache  # the prompt's KV (grows as a Generation decodes into it)
    logits: torch.Tensor  # [vocab] float32, at the last prompt position
    prompt_tokens: int
    prefix_tokens: int  # loaded from prefix blocks
    computed_tokens: int  # prompt_tokens - prefix_tokens, always >= 1
    load_seconds: float  # building the cache from blocks
    compute_seconds: float  # the forward pass over the suffix (pads included)
    padding_tokens: int = 0  # pads computed after the suffix (prefill buckets), then cropped


class Generation:
    """Iterator over generated token ids of one request; its prefill has already run.

    `prefill.cache` holds the prompt's KV for `Engine.extract_blocks` at any time: decoding
    appends after the prompt and never changes prompt positions.
    """

    def __init__(
        self,
        engine: Engine,
        prefill: PrefillResult,
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int],
        sampling: SamplingParams,
        seed: int | None,
        should_stop: Callable[[], bool] | None,
        prompt: Sequence[int] = (),
    ) -> None:
        self._engine = engine
        self.prefill = prefill
        self.seed = seed
        self._max_tokens = max_tokens
        self._stop = stop_token_ids
        self._should_stop = should_stop
        self._tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        generator = None
        if not sampling.greedy:
            if seed is None:
                raise ValueError("sampling (temperature > 0) needs a seed; Engine.generate draws one")
            generator = torch.Generator(device=engine.loaded.model.device).manual_seed(seed)
        self._sampler = Sampler(sampling, prompt, engine.vocab_size, generator)
        self._want_logprobs = sampling.logprobs is not None
        self.last_logprob: TokenLogprob | None = None  # of the token `next` returned last, if asked for

    @property
    def cache(self) -> DynamicCache:
        return self.prefill.cache

    @property
    def token_ids(self) -> list[int]:
        """Tokens yielded so far (stop tokens excluded)."""
        return list(self._tokens)

    def __iter__(self) -> Generation:
        return self

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        raise StopIteration

    def __next__(self) -> int:
        if self.finish_reason is not None:
            raise StopIteration
        if self._should_stop is not None and self._should_stop():
            self._finish(FinishReason.CANCELLED)
        if len(self._tokens) >= self._max_tokens:
            self._finish(FinishReason.LENGTH)
        if self._tokens:
            position = self.prefill.prompt_tokens + len(self._tokens) - 1
            if not self._engine.fits(position + 1):
                self._finish(FinishReason.LENGTH)
            logits = self._engine.decode_step(self._tokens[-1], position, self.cache)
        else:
            logits = self.prefill.logits
        token = self._sampler.choose(logits)
        if token in self._stop:
            self._finish(FinishReason.STOP)
        if self._want_logprobs:
            self.last_logprob = self._sampler.logprob(logits, token)
        self._tokens.append(token)
        return token


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefill_buckets: bool | None = None,
    ) -> None:
        """`prefill_buckets`: pad prefills to `bucket_length`; None (default) pads exactly
        where it bounds memory, see `buckets_bound_memory`."""
        self.loaded = loaded
        self.prefill_buckets = buckets_bound_memory(loaded) if prefill_buckets is None else prefill_buckets
        self._model = loaded.model
        vocab = self._model.get_input_embeddings().num_embeddings
        if not isinstance(vocab, int):  # nn.Module attributes type as Tensor | Module
            raise UnsupportedModelError(f"the input embeddings' num_embeddings is {vocab!r}, not a row count")
        self._vocab = vocab
        # bfloat16 is the exact dtype (float32 differs by ~1e-6 whatever the kernels, see `attention`)
        self.rows_invariant = self._model.dtype == torch.bfloat16 and rows_invariant(loaded)
        if self._model.dtype == torch.bfloat16 and not self.rows_invariant:
            logger.warning(
                "this machine's %s matmuls are not row-invariant: a prefill from cached blocks may differ in the "
                "last bits from a full one (start the process with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, which "
                "importing prefixcache_services.worker.model sets unless oneDNN ran before)",
                self._model.dtype,
            )

    @property
    def kv(self) -> KVLayout:
        return self.loaded.kv

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: the ids a prompt or a logit_bias may name."""
        return self._vocab

    def fits(self, n_positions: int) -> bool:
        limit = self.loaded.max_positions
        return limit is None or n_positions <= limit

    def _prompt_tensor(self, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise ValueError("the prompt has no tokens")
        if not self.fits(len(token_ids)):
            raise ValueError(
                f"prompt of {len(token_ids)} tokens exceeds the model's {self.loaded.max_positions} positions"
            )
        ids = torch.tensor(list(token_ids), device=self._model.device)
        if ids.dtype != torch.long:
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self._vocab:
            bad = next(i for i in token_ids if not 0 <= i < self._vocab)
            raise ValueError(f"token id {bad} is outside the model vocabulary [0, {self._vocab})")
        return ids.unsqueeze(0)

    def _initial_cache(self, prompt_len: int, prefix_blocks: torch.Tensor | None) -> tuple[DynamicCache, int]:
        if prefix_blocks is None:
            return DynamicCache(config=self._model.config), 0
        block_size = validate_blocks(prefix_blocks, self.kv, self._model.device)
        prefix = prefix_blocks.shape[0] * block_size
        if prefix >= prompt_len:
            raise ValueError(
                f"prefix blocks cover {prefix} tokens but the prompt has {prompt_len}: "
                "at least one prompt token must be computed"
            )
        with torch.inference_mode():
            return blocks_to_cache(prefix_blocks, self._model.config), prefix

    def _padded_length(self, prefix: int, n: int) -> int:
        """How many tokens to run for the suffix [prefix, n): its bucket, never past the
        model's position limit (learned position tables cannot index beyond it)."""
        computed = n - prefix
        if not self.prefill_buckets:
            return computed
        limit = self.loaded.max_positions
        bucket = bucket_length(computed)
        return bucket if limit is None else max(computed, min(bucket, limit - prefix))

    def prefill(self, token_ids: Sequence[int], prefix_blocks: torch.Tensor | None = None) -> PrefillResult:
        """Load `prefix_blocks` (covering the first n * block_size tokens) and compute the rest."""
        ids = self._prompt_tensor(token_ids)
        n = ids.shape[1]
        started = time.perf_counter()
        cache, prefix = self._initial_cache(n, prefix_blocks)
        loaded = time.perf_counter()
        run = self._padded_length(prefix, n)
        pad = run - (n - prefix)
        new = ids[:, prefix:]
        if pad:
            new = torch.cat([new, new.new_full((1, pad), PAD_TOKEN_ID)], dim=1)
        positions = torch.arange(prefix, prefix + run, device=ids.device).unsqueeze(0)
        with torch.inference_mode():
            out = self._model(
                input_ids=new,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                # The last real token's row. An index tensor, not an int: it yields a contiguous
                # [1, 1, hidden] row, whereas the int's strided slice sends bf16 CPU matmul down
                # a path that copies the whole lm_head weight (~90 ms per call at 100k vocab).
                logits_to_keep=torch.tensor([n - prefix - 1], device=ids.device),
            )
            logits = out.logits[0, -1].float()
            if pad:
                out.cache.crop(-pad)  # the pads' KV: decoding continues at position n
        if out.cache.get_seq_length() != n:
            raise RuntimeError(f"prefill left {out.cache.get_seq_length()} KV positions, expected {n}")
        done = time.perf_counter()
        logger.debug("prefill %d tokens (%d from prefix, %d pads) in %.3fs", n, prefix, pad, done - started)
        return PrefillResult(
            out.cache, logits, n, prefix, n - prefix, loaded - started, done - loaded, padding_tokens=pad
        )

    def decode_step(self, token: int, position: int, cache: DynamicCache) -> torch.Tensor:
        """Append `token` at `position` to `cache`; return the next-token logits [vocab] (fp32)."""
        with torch.inference_mode():
            out = self._model(
                input_ids=torch.tensor([[token]], device=self._model.device),
                position_ids=torch.tensor([[position]], device=self._model.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            return out.logits[0, -1].float()

    def generate(
        self,
        token_ids: Sequence[int],
        prefix_blocks: torch.Tensor | None = None,
        *,
        max_tokens: int = 256,
        stop_token_ids: Iterable[int] | None = None,
        temperature: float | None = None,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generation:
        """Prefill now; return an iterator that decodes one token per `next()`.

        `sampling` (see services/worker/sampling.py) or, as a shorthand, `temperature` alone:
        greedy when the temperature is 0 (the default), else sampling from a generator seeded
        with `seed` (random if None; kept on `Generation.seed`). Stops on a stop token (default:
        the model's EOS / end-of-turn ids), after `max_tokens`, or once `should_stop()` is True.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if sampling is not None and temperature is not None:
            raise ValueError("give temperature or sampling, not both")
        if sampling is None:
            sampling = GREEDY if temperature is None else SamplingParams(temperature=temperature)
        if not sampling.greedy and seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        stops = self.loaded.stop_token_ids if stop_token_ids is None else frozenset(stop_token_ids)
        prefill = self.prefill(token_ids, prefix_blocks)
        return Generation(
            self,
            prefill,
            max_tokens=max_tokens,
            stop_token_ids=stops,
            sampling=sampling,
            seed=seed,
            should_stop=should_stop,
            prompt=token_ids,
        )

    def extract_blocks(self, cache: DynamicCache, first_block: int, n_blocks: int, block_size: int) -> torch.Tensor:
        """Contiguous copy [n_blocks, layers, 2, kv_heads, block_size, head_dim] of the KV of
        tokens [first_block * block_size, (first_block + n_blocks) * block_size)."""
        return extract_blocks(cache, first_block, n_blocks, block_size)
