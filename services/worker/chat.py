"""Chat and completion prompts as token ids.

Owns the chat template of the built-in tiny model, and the bridge to a local checkpoint's own
chat template.

Tiny-model template (ChatML on cl100k; `enc(s)` = cl100k encoding of the string `s` alone,
control tokens written as single ids):

    message(role, content) = [<|im_start|>] + enc(role) + enc("\\n")
                             + enc(content) + [<|im_end|>] + enc("\\n")
    header(role)           = [<|im_start|>] + enc(role) + enc("\\n")
    prompt(messages)       = message(m_1) + ... + message(m_n) + header("assistant")

Every piece is tokenized on its own and the id lists are concatenated; BPE never merges
across a piece boundary. That makes the template PREFIX-STABLE, which is what the prefix
cache needs:
- the generation prompt `header("assistant")` is exactly the first tokens of
  `message("assistant", reply)`;
- so the prompt of turn k (history + the previous assistant reply + a new user message +
  header) is an exact token-list extension of the prompt of turn k-1.
(Had the whole conversation been rendered to one string and encoded at once, BPE merges
at the seams, e.g. "\\n" + "Hello", could differ between turns and break the prefix.)

Generation stops on `<|im_end|>` or `<|endoftext|>` (see `ChatMLTemplate.stop_token_ids`).

Checkpoints loaded from a path use their tokenizer's own chat template
(`apply_chat_template(..., tokenize=True)`). Those templates render a whole string and
re-tokenize it, and many rewrite history (e.g. strip reasoning from past assistant turns),
so prefix stability is NOT guaranteed there; a broken prefix only costs cache hits, never
correctness, because blocks are keyed by the exact token ids.

Completion prompts are the plain encoding of the text (`completion_prompt`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str

    @classmethod
    def from_mapping(cls, message: Mapping[str, object]) -> ChatMessage:
        """Validate an OpenAI-style `{"role": ..., "content": ...}` message."""
        role, content = message.get("role"), message.get("content")
        try:
            parsed = Role(role)
        except ValueError:
            allowed = ", ".join(r.value for r in Role)
            raise ValueError(f"message role {role!r} is not one of: {allowed}") from None
        if not isinstance(content, str):
            raise ValueError(f"message content must be a string, got {type(content).__name__}")
        return cls(parsed, content)


ChatRenderer = Callable[[Sequence[ChatMessage]], list[int]]
"""Renders a conversation, ending with the assistant generation prompt, to token ids."""


def _require_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ValueError("a chat prompt needs at least one message")


class ChatMLTemplate:
    """The prefix-stable template of the module docstring, for the cl100k tokenizer."""

    def __init__(self, tokenizer: TiktokenTokenizer) -> None:
        self._tok = tokenizer
        self._newline = tokenizer.encode("\n")
        self._role_ids = {role: tokenizer.encode(role.value) for role in Role}

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self._tok.im_end_id, self._tok.eos_token_id})

    def header(self, role: Role) -> list[int]:
        return [self._tok.im_start_id, *self._role_ids[role], *self._newline]

    def message(self, message: ChatMessage) -> list[int]:
        return [
            *self.header(message.role),
            *self._tok.encode(message.content),
            self._tok.im_end_id,
            *self._newline,
        ]

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        _require_messages(messages)
        ids: list[int] = []
        for message in messages:
            ids.extend(self.message(message))
        ids.extend(self.header(Role.ASSISTANT))
        return ids


class HFChatTemplate:
    """A local checkpoint's own chat template (no prefix-stability guarantee)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        if not tokenizer.hf.chat_template:
            raise ValueError("the checkpoint's tokenizer has no chat_template; use completions")
        self._tok = tokenizer

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        _require_messages(messages)
        conversation = [{"role": m.role.value, "content": m.content} for m in messages]
        ids = self._tok.hf.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)


def completion_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a completions-API prompt: the plain encoding of the text."""
    return tokenizer.encode(text)
