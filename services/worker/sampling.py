"""Next-token choice from the logits: penalties, bias, temperature, top-k/top-p/min-p, logprobs.

Owns `SamplingParams` (one request's validated settings) and `Sampler` (their application to
one generation, with the per-token state the penalties need). The order and the meaning of each
step follow vLLM's sampler, so a request means the same here as there:

1. `repetition_penalty` (CTRL / vLLM): for every token seen in the prompt or the output, a
   positive logit is divided by it and a negative one multiplied;
2. `frequency_penalty` (minus penalty * count in the output) and `presence_penalty` (minus
   penalty once a token occurs in the output), OpenAI's definitions, output tokens only;
3. `logit_bias`, added to the logits;
4. greedy (`temperature` 0): argmax of those logits. Otherwise divide by `temperature`, keep the
   `top_k` best, the smallest set whose probability reaches `top_p`, and the tokens whose
   probability is at least `min_p` times the best one's; sample with the request's generator.

Invariants:
- With no penalty and no bias, greedy is `argmax(raw logits)`, untouched: the cache's exactness
  (cached == recomputed, bit for bit) carries over to every greedy request unchanged.
- Logprobs are those of the model's raw distribution (log_softmax of the unprocessed logits,
  vLLM's default `raw_logprobs`), so they do not depend on the sampling settings.
- `top_k`/`top_p`/`min_p` never remove the most probable token: some token always remains.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's, plus the k most likely

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0, "a finite number >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "-1, 0 (off) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0, "> 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "None or >= 0"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def touches_logits(self) -> bool:
        """Whether anything but temperature and truncation changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely (id, logprob), best first


class Sampler:
    """Applies one request's `SamplingParams`; fed every chosen token through `choose`."""

    def __init__(
        self, params: SamplingParams, prompt: Sequence[int], vocab: int, generator: torch.Generator | None
    ) -> None:
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias names token {bad}, outside the vocabulary [0, {vocab})")
        self.params = params
        self._generator = generator
        self._output: Counter[int] = Counter()
        self._seen = set(prompt) if params.repetition_penalty != 1.0 else set()
        self._bias = None
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self._bias = (ids, torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not p.touches_logits:
            return logits
        logits = logits.clone()
        if p.repetition_penalty != 1.0 and self._seen:
            ids = torch.tensor(sorted(self._seen), device=logits.device)
            picked = logits[ids]
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if self._output and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(list(self._output), device=logits.device)
            counts = torch.tensor(list(self._output.values()), dtype=logits.dtype, device=logits.device)
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if self._bias is not None:
            ids, values = self._bias
            logits[ids.to(logits.device)] += values.to(logits.device, logits.dtype)
        return logits

    def _truncated(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if p.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Drop a token once the tokens before it already reach top_p (the first always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            logits = logits.clone()
            logits[order[drop]] = -math.inf
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), -math.inf)
        return logits

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from `[vocab]` float32 logits; recorded for the penalties."""
        processed = self._processed(logits)
        if self.params.greedy:
            token = int(torch.argmax(processed))
        else:
            probs = torch.softmax(self._truncated(processed), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self._generator))
        self._output[token] += 1
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token)
        return token

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        k = self.params.logprobs or 0
        logprobs = torch.log_softmax(logits, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
            top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top)
