"""Turn construction: the prompts a chat app would send while replaying one conversation.

Owns: cutting a `Conversation` into per-turn prompts. Turn k's prompt is every transcript
message before the k-th user message plus that user message, i.e. the transcript's OWN
assistant replies are the history (prompts never depend on what the server generates, so a
cache-on and a cache-off run send byte-identical prompts).

Invariants of the turns of one conversation:
- `turns[k].messages` is a strict prefix of `turns[k+1].messages` (append-only history, which
  is exactly what makes prefix caching pay off);
- every turn's last message is a user message;
- `len(turns) <= max_turns`, and every `prompt_tokens <= max_prompt_tokens`: the list stops
  at the first turn over the token cap (later turns only grow).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .transcripts import Conversation, Message, Role

TokenCounter = Callable[[Sequence[Message]], int]


@dataclass(frozen=True)
class Turn:
    """One request of a replayed conversation (see module invariants)."""

    conversation_id: str
    index: int
    messages: tuple[Message, ...]
    prompt_tokens: int

    def openai_messages(self) -> list[dict[str, str]]:
        """The messages in the OpenAI chat-completions request shape."""
        return [{"role": role.value, "content": content} for role, content in self.messages]


def approx_token_count(messages: Sequence[Message]) -> int:
    """Tokenizer-free estimate: ~4 characters per token plus 4 tokens of chat framing per message.

    Only for caps when no tokenizer is at hand; pass the worker's tokenizer for exact caps.
    """
    return sum(len(content) // 4 + 4 for _, content in messages)


def conversation_turns(
    conversation: Conversation,
    count_tokens: TokenCounter = approx_token_count,
    *,
    max_turns: int | None = None,
    max_prompt_tokens: int | None = None,
) -> list[Turn]:
    """The per-turn prompts of `conversation`, capped in count and prompt tokens."""
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    turns: list[Turn] = []
    for end, (role, _) in enumerate(conversation.messages, start=1):
        if role is not Role.USER:
            continue
        if max_turns is not None and len(turns) >= max_turns:
            break
        prompt = conversation.messages[:end]
        tokens = count_tokens(prompt)
        if max_prompt_tokens is not None and tokens > max_prompt_tokens:
            break
        turns.append(Turn(conversation.id, len(turns), prompt, tokens))
    return turns
