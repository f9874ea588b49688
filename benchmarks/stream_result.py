"""What one streamed chat completion measured: first-token time, gaps between chunks, usage.

The fleet benchmarks (fleet_bench.py, vllm_fleet_bench.py) read OpenAI-style SSE streams with
different clients; both feed each decoded event to `StreamResult.observe`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    started: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None
    _last: float | None = field(default=None, repr=False)

    def observe(self, event: dict) -> None:
        """One `chat.completion.chunk`: a token's chunk times it, a usage chunk counts. A token's
        chunk has `content`, empty when the token's text is held back or none (vLLM sends one per
        token); vLLM's opening chunk (role, empty content) is not a token."""
        if any(_is_token(choice.get("delta") or {}) for choice in event.get("choices", [])):
            now = time.perf_counter()
            if self._last is None:
                self.ttft_s = now - self.started
            else:
                self.gaps_s.append(now - self._last)
            self._last = now
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or 0
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def finish(self) -> None:
        """A stream that ended without content is an error."""
        if self.error is None and self.ttft_s is None:
            self.error = "no content streamed"


def _is_token(delta: dict) -> bool:
    return "content" in delta and (bool(delta["content"]) or "role" not in delta)
