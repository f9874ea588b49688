"""Streaming, truncation-tolerant reader for one large top-level JSON array.

Owns: turning a text stream that holds `[ {...}, {...}, ...` into complete decoded elements,
one at a time, without reading more of the file than the elements asked for.

Invariants:
- Only COMPLETE elements are yielded: an element is decoded with `json.JSONDecoder.raw_decode`
  once its closing brace/bracket is in the buffer, so a partial element is never half-yielded.
- A stream that ends in the middle of an element (or without the closing `]`) is not an error:
  the reader stops and records `truncated=True` and the character offset where the incomplete
  tail starts. Data that is malformed *before* the end raises `JsonArrayError`.
- Memory stays bounded by one element plus one read chunk (consumed text is dropped), and an
  element larger than `max_element_chars` raises instead of buffering the rest of the file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

log = logging.getLogger(__name__)

_WHITESPACE = " \t\r\n"
DEFAULT_CHUNK_CHARS = 1 << 20
DEFAULT_MAX_ELEMENT_CHARS = 64 << 20


class JsonArrayError(ValueError):
    """The stream is not a JSON array of values (malformed before its end)."""


@dataclass
class ArrayReadState:
    """Progress of one read; filled in while iterating (the reader's only mutable output).

    Invariant: `elements` counts yielded elements; `truncated` is final only once the
    iterator is exhausted.
    """

    elements: int = 0
    truncated: bool = False
    truncated_at_char: int | None = None
    complete: bool = False


class _Buffer:
    """A sliding text window over the stream: `text[pos:]` is the unconsumed part."""

    def __init__(self, stream: TextIO, chunk_chars: int) -> None:
        self._stream = stream
        self._chunk = chunk_chars
        self.text = ""
        self.pos = 0
        self.consumed_before = 0  # chars dropped from the front of `text`
        self.eof = False

    def offset(self) -> int:
        return self.consumed_before + self.pos

    def fill(self) -> bool:
        """Read one more chunk; False at end of stream."""
        if self.eof:
            return False
        chunk = self._stream.read(self._chunk)
        if not chunk:
            self.eof = True
            return False
        if self.pos > 0:  # drop consumed text so the buffer holds ~one element
            self.consumed_before += self.pos
            self.text = self.text[self.pos :]
            self.pos = 0
        self.text += chunk
        return True

    def skip_whitespace(self) -> bool:
        """Advance past whitespace; False if the stream ended first."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text):
                return True
            if not self.fill():
                return False

    def pending(self) -> int:
        return len(self.text) - self.pos


def iter_json_array(
    stream: TextIO,
    state: ArrayReadState,
    *,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    max_element_chars: int = DEFAULT_MAX_ELEMENT_CHARS,
) -> Iterator[Any]:
    """Yield the complete elements of the JSON array in `stream`, in order.

    Stops quietly (setting `state.truncated`) where the stream is cut off.
    """
    buf = _Buffer(stream, chunk_chars)
    decoder = json.JSONDecoder()
    if not buf.skip_whitespace():
        _mark_truncated(state, buf)
        return
    if buf.text[buf.pos] != "[":
        raise JsonArrayError(f"expected '[' at char {buf.offset()}, found {buf.text[buf.pos]!r}")
    buf.pos += 1
    first = True
    while True:
        if not buf.skip_whitespace():
            _mark_truncated(state, buf)
            return
        ch = buf.text[buf.pos]
        if ch == "]":
            state.complete = True
            return
        if not first:
            if ch != ",":
                raise JsonArrayError(f"expected ',' or ']' at char {buf.offset()}, found {ch!r}")
            buf.pos += 1
            if not buf.skip_whitespace():
                _mark_truncated(state, buf)
                return
        element = _decode_one(buf, decoder, max_element_chars)
        if element is _TRUNCATED:
            _mark_truncated(state, buf)
            return
        first = False
        state.elements += 1
        yield element


_TRUNCATED = object()


def _decode_one(buf: _Buffer, decoder: json.JSONDecoder, max_chars: int) -> Any:
    """Decode the element at `buf.pos`, reading more until it is complete or the stream ends."""
    while True:
        try:
            value, end = decoder.raw_decode(buf.text, buf.pos)
        except json.JSONDecodeError as exc:
            if buf.pending() > max_chars:
                raise JsonArrayError(
                    f"element at char {buf.offset()} is malformed or larger than {max_chars} chars: {exc.msg}"
                ) from exc
            if not buf.fill():
                return _TRUNCATED
            continue
        # A bare number at the buffer's edge could continue in the next chunk.
        if end == len(buf.text) and not buf.eof and not isinstance(value, (dict, list, str)):
            if buf.fill():
                continue
        buf.pos = end
        return value


def _mark_truncated(state: ArrayReadState, buf: _Buffer) -> None:
    state.truncated = True
    state.truncated_at_char = buf.offset()
    log.info(
        "JSON array ends without closing ']' after %d complete elements (tail from char %d)",
        state.elements,
        state.truncated_at_char,
    )
