"""What one generation yields to the HTTP layer, in order: `Started`, `Piece`s, `Finished`.

Owned here so that the backend (which produces them) and http.py (which serialises them)
both depend on this module, never on each other. The closed sets are enums whose values
are the strings the OpenAI API and /health put on the wire.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why generation ended. Only STOP and LENGTH reach a client (a cancelled one has none left)."""

    STOP = "stop"  # a stop token was sampled (it is not yielded) or a stop string was reached
    LENGTH = "length"  # max_tokens reached, or the model's position limit
    CANCELLED = "cancelled"  # should_stop() returned True


class RequestKind(enum.StrEnum):
    CHAT = "chat"  # /v1/chat/completions: messages rendered by the chat template
    COMPLETION = "completion"  # /v1/completions: a prompt string or token ids


class LinkState(enum.StrEnum):
    """The worker's cache link as /health reports it."""

    UP = "up"  # attached: lookups and stores go to the service
    DOWN = "down"  # failed: requests prefill in full until the breaker's next probe succeeds
    PENDING = "pending"  # not attached yet
    OFF = "off"  # the worker runs without a cache service


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple = ()  # openai_api.Logprob of each token the text came from (if asked for)
    echo: bool = False  # the prompt's own text (completions' echo), not generated


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason  # STOP or LENGTH
    completion_tokens: int
    # Set by the HTTP layer once the response's end is written ([DONE] for a stream): the
    # request's background store starts only then, so it never competes with that tail.
    delivered: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
