"""The replay workload: which conversations are replayed, cut into turns under the caps.

Owns: picking the first N conversations of a source that still have at least one turn after
the caps (a conversation whose first prompt is over `max_prompt_tokens` has none), and saying
what was read (records, skips, the ShareGPT file's truncation).

Invariants:
- deterministic: same source, same caps, same N -> same conversations in file order;
- every selected conversation has >= 1 turn; fewer than N are returned only when the source
  runs out (`Workload.exhausted`);
- ShareGPT is read as a stream from the start of the file and only as far as needed: the read
  limit doubles until N conversations qualify or the file ends;
- with a `system_prompt`, the conversations `system_prompt_for` picks (by their position among
  the selected ones) start with it as a system message, and the caps count it: the shared
  prefix every such conversation's first turn sends (system_prompt.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .system_prompt import system_prompt_for
from .transcripts import Conversation, LoadResult, Role, load_jsonl, load_sharegpt
from .turns import TokenCounter, Turn, conversation_turns

log = logging.getLogger(__name__)

SHAREGPT = "sharegpt"


@dataclass(frozen=True)
class WorkloadSpec:
    """Source (`"sharegpt"` or a JSONL path) and the caps applied to it."""

    source: str = SHAREGPT
    conversations: int = 20
    max_turns: int | None = 8
    max_prompt_tokens: int | None = 4096
    lenient: bool = False
    system_prompt: str | None = None  # put in front of the conversations below, as a system message
    system_prompt_share: float = 1.0  # the fraction of conversations that get it (system_prompt_for)

    def __post_init__(self) -> None:
        if self.conversations < 1:
            raise ValueError(f"conversations must be >= 1, got {self.conversations}")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ValueError("system_prompt must not be empty (None for no system prompt)")
        if not 0.0 <= self.system_prompt_share <= 1.0:
            raise ValueError(f"system_prompt_share must be in [0, 1], got {self.system_prompt_share}")


@dataclass(frozen=True)
class Workload:
    turns: tuple[tuple[Turn, ...], ...]  # per selected conversation, in source order
    loaded: LoadResult  # the last read of the source
    exhausted: bool  # the source ran out before N conversations qualified

    @property
    def request_count(self) -> int:
        return sum(len(t) for t in self.turns)


def _with_system_prompt(conv: Conversation, spec: WorkloadSpec, position: int) -> Conversation:
    if spec.system_prompt is None or not system_prompt_for(position, spec.system_prompt_share):
        return conv
    return Conversation(conv.id, ((Role.SYSTEM, spec.system_prompt), *conv.messages))


def _select(loaded: LoadResult, spec: WorkloadSpec, count: TokenCounter) -> list[tuple[Turn, ...]]:
    picked: list[tuple[Turn, ...]] = []
    for source in loaded.conversations:
        conv = _with_system_prompt(source, spec, len(picked))
        turns = conversation_turns(conv, count, max_turns=spec.max_turns, max_prompt_tokens=spec.max_prompt_tokens)
        if turns:
            picked.append(tuple(turns))
            if len(picked) == spec.conversations:
                break
    return picked


def load_workload(spec: WorkloadSpec, count: TokenCounter) -> Workload:
    """The first `spec.conversations` conversations of the source that have a turn under the caps."""
    if spec.source != SHAREGPT:
        loaded = load_jsonl(Path(spec.source), lenient=spec.lenient)
        picked = _select(loaded, spec, count)
        return Workload(tuple(picked), loaded, len(picked) < spec.conversations)
    limit = max(2 * spec.conversations, 32)
    while True:
        loaded = load_sharegpt(limit=limit)
        picked = _select(loaded, spec, count)
        # Fewer kept than asked for means the reader hit the end of the file.
        exhausted = len(loaded.conversations) < limit
        if len(picked) == spec.conversations or exhausted:
            break
        limit *= 2
    if exhausted and len(picked) < spec.conversations:
        log.warning(
            "ShareGPT has only %d conversations with a turn under the caps (asked for %d)",
            len(picked),
            spec.conversations,
        )
    return Workload(tuple(picked), loaded, exhausted and len(picked) < spec.conversations)
