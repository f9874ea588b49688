"""A request body's prompt as the token ids the engine will compute, for Match.

Owns `PromptTokenizer`: `--tokenizer tiny` is the reference worker's cl100k with its ChatML
template (services/worker/chat.py), a directory is a Hugging Face checkpoint's tokenizer and chat
template, exactly as the worker loads them. A prompt the router cannot tokenize (a malformed
body, a batch of prompts, a role the template lacks) gives None: the request is scored as a miss
everywhere and the engine answers it, with its own error if it is bad.

Also owns the conversation key of the sticky tie-break: the `X-Conversation-Id` header, else the
body's `user`, else a digest of the salt and the conversation's first two messages (a
conversation resends them every turn).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

TINY = "tiny"
CONVERSATION_HEADER = "X-Conversation-Id"


class PromptTokenizer:
    def __init__(self, spec: str) -> None:
        from ..worker.chat import ChatMLTemplate, HFChatTemplate
        from ..worker.tokenizer import HFTokenizer, TiktokenTokenizer

        self.spec = spec
        self._render: Callable | None
        if spec == TINY:
            tiktoken = TiktokenTokenizer()
            self._encode: Callable[[str], list[int]] = tiktoken.encode
            self._render = ChatMLTemplate(tiktoken).render
        else:
            if not Path(spec).is_dir():
                raise ValueError(f"--tokenizer {spec!r} is neither {TINY!r} nor a local checkpoint directory")
            hf = HFTokenizer(spec)
            self._encode = hf.encode
            self._render = HFChatTemplate(hf).render if hf.hf.chat_template else None

    def tokens(self, path: str, body: Mapping) -> list[int] | None:
        """The prompt's token ids, or None when the router cannot say (scored as a miss)."""
        from ..worker.chat import ChatMessage

        try:
            if path.endswith("/chat/completions"):
                messages = body.get("messages")
                if self._render is None or not isinstance(messages, list) or not messages:
                    return None
                parsed = []
                for message in messages:
                    if not isinstance(message, Mapping):
                        return None
                    if message.get("role") == "developer":
                        message = {**message, "role": "system"}
                    parsed.append(ChatMessage.from_mapping(message))
                return self._render(parsed)
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                return self._encode(prompt)
            if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
                return list(prompt)
        except (ValueError, TypeError, KeyError):
            return None
        return None


def conversation_key(headers: Mapping[str, str], body: Mapping) -> str | None:
    given = headers.get(CONVERSATION_HEADER)
    if given:
        return "h:" + given
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head = json.dumps([body.get("cache_salt"), messages[:2]], sort_keys=True, default=str)
        return "m:" + hashlib.blake2b(head.encode(), digest_size=12).hexdigest()
    return None
