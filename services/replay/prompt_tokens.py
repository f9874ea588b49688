"""Prompt token ids of replayed turns, exactly as the reference worker builds them.

Owns: turning a turn's transcript messages into the token ids the worker's built-in model
sees — the worker's offline cl100k tokenizer (`TiktokenTokenizer`) and its prefix-stable
ChatML template (`ChatMLTemplate`). The replay uses it for the `--max-prompt-tokens` cap
(so the cap matches the worker's `usage.prompt_tokens`) and for the cache-only mode's
lookups (so they hash the same blocks a worker would).

Invariants:
- `tokens(messages)` equals `ChatMLTemplate.render` of the same messages, id for id;
- turn k's ids are a prefix of turn k+1's ids: the trailing assistant header is exactly how
  the next (assistant) message begins (the template's prefix stability, services/worker/chat.py);
- the per-message memo lives in the instance (one per replay), never in the module.

For servers with another tokenizer the counts are an approximation of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..worker.chat import ChatMessage, ChatMLTemplate, Role
from ..worker.tokenizer import TiktokenTokenizer
from .transcripts import Message


class ChatTokens:
    """Token ids / counts of chat prompts with the worker's tokenizer and template."""

    def __init__(self) -> None:
        self._template = ChatMLTemplate(TiktokenTokenizer())
        # History messages are re-rendered for every later turn; encoding each once keeps a
        # conversation's token counting linear in its length.
        self._memo: dict[Message, tuple[int, ...]] = {}

    def _message(self, message: Message) -> tuple[int, ...]:
        ids = self._memo.get(message)
        if ids is None:
            role, content = message
            ids = tuple(self._template.message(ChatMessage(Role(role.value), content)))
            self._memo[message] = ids
        return ids

    def tokens(self, messages: Sequence[Message]) -> list[int]:
        """The prompt ids: every message, then the assistant generation header."""
        if not messages:
            raise ValueError("a chat prompt needs at least one message")
        ids: list[int] = []
        for message in messages:
            ids.extend(self._message(message))
        ids.extend(self._template.header(Role.ASSISTANT))
        return ids

    def message_count(self, message: Message) -> int:
        """Tokens of one message as the template frames it (no generation header)."""
        return len(self._message(message))

    def count(self, messages: Sequence[Message]) -> int:
        """`len(tokens(messages))`: a `TokenCounter` for `conversation_turns`."""
        return len(self.tokens(messages))

    def forget(self) -> None:
        """Drop the memo (after the turns are built it is only memory)."""
        self._memo.clear()
