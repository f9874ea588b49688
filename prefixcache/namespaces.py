"""The namespaces a cache knows, and prompts resolved against them.

Owns the mapping namespace id -> (row, namespace, root hash). A row is the
small integer the index stores per block; rows are never reused, so a row
names one namespace for the cache's lifetime. Not thread-safe on its own:
the cache registers under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import KVLayout, Namespace
from .errors import InvalidArgument, LayoutMismatch, ResourceExhausted, UnknownNamespace
from .hashing import BlockHash, Hasher, Tokens, namespace_id, token_array

MAX_NAMESPACES = int(np.iinfo(np.int16).max)  # the index stores the row as int16


@dataclass(frozen=True)
class NamespaceEntry:
    index: int  # the row stored per block in the index
    namespace: Namespace
    root: BlockHash
    id: str


@dataclass(frozen=True)
class Prompt:
    """Tokens checked and hashed for one namespace (only full blocks are hashed)."""

    entry: NamespaceEntry
    tokens: np.ndarray  # u32
    blocks: np.ndarray  # [full blocks, block_size] u32
    hashes: list[BlockHash]


class NamespaceRegistry:
    def __init__(self, layout: KVLayout, hasher: Hasher, max_prompt_tokens: int) -> None:
        self.layout = layout
        self.hasher = hasher
        self.max_prompt_tokens = max_prompt_tokens
        self._by_id: dict[str, NamespaceEntry] = {}
        self._by_row: list[NamespaceEntry] = []

    def register(self, namespace: Namespace) -> tuple[NamespaceEntry, bool]:
        """The namespace's entry, and whether it is new (idempotent)."""
        if namespace.layout != self.layout:
            raise LayoutMismatch(f"namespace layout {namespace.layout} differs from this cache's {self.layout}")
        root = self.hasher.root(namespace)
        ns_id = namespace_id(root)
        known = self._by_id.get(ns_id)
        if known is not None:
            if known.namespace != namespace:
                raise InvalidArgument("namespace", f"id {ns_id} already names a different namespace (hash collision)")
            return known, False
        if len(self._by_row) >= MAX_NAMESPACES:
            raise ResourceExhausted("namespace: too many namespaces", "namespace")
        entry = NamespaceEntry(len(self._by_row), namespace, root, ns_id)
        self._by_id[ns_id] = entry
        self._by_row.append(entry)
        return entry, True

    def get(self, ns_id: str) -> NamespaceEntry:
        entry = self._by_id.get(ns_id)
        if entry is None:
            raise UnknownNamespace(ns_id)
        return entry

    def by_row(self, row: int) -> NamespaceEntry:
        return self._by_row[row]

    def prompt(self, ns_id: str, tokens: Tokens) -> Prompt:
        entry = self.get(ns_id)
        array = token_array(tokens)
        if len(array) > self.max_prompt_tokens:
            raise ResourceExhausted(
                f"tokens: {len(array)} tokens exceed the limit of {self.max_prompt_tokens}", "tokens"
            )
        size = self.layout.block_size
        full = len(array) // size
        blocks = array[: full * size].reshape(full, size)
        return Prompt(entry, array, blocks, self.hasher.block_hashes(entry.root, array, size))
