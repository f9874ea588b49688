"""The namespaces a cache knows, their KV layouts, and prompts resolved against them.

Owns the mapping namespace id -> (row, namespace, root hash) and the layouts the namespaces
use. A row is the small integer the index stores per block; rows are never reused, so a row
names one namespace for the cache's lifetime. Layouts are numbered in the order they first
attach (the number every tier's arena uses, tiers/arena.py); `layout_of_row` and `bytes_of_row`
are tables by row for vectorised lookups. Every layout has the cache's block size in tokens (the
index stores a block's token ids). Not thread-safe on its own: the cache registers under its lock.
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
    layout: int = 0  # the number of its KV layout


@dataclass(frozen=True)
class Prompt:
    """Tokens checked and hashed for one namespace (only full blocks are hashed)."""

    entry: NamespaceEntry
    tokens: np.ndarray  # u32
    blocks: np.ndarray  # [full blocks, block_size] u32
    hashes: list[BlockHash]
    multiple: int = 1  # blocks per block of the asking engine: a hit is a whole number of them


class NamespaceRegistry:
    def __init__(self, block_size: int, hasher: Hasher, max_prompt_tokens: int) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.max_prompt_tokens = max_prompt_tokens
        self._by_id: dict[str, NamespaceEntry] = {}
        self._by_row: list[NamespaceEntry] = []
        self.layouts: list[KVLayout] = []
        self.layout_of_row = np.zeros(MAX_NAMESPACES + 1, dtype=np.int16)
        self.bytes_of_row = np.zeros(MAX_NAMESPACES + 1, dtype=np.int64)

    def layout_id(self, layout: KVLayout) -> int | None:
        """The number of a known layout, None for a new one (which must have this block size)."""
        if layout.block_size != self.block_size:
            raise LayoutMismatch(
                f"namespace layout block_size {layout.block_size} differs from this cache's {self.block_size}"
            )
        return self.layouts.index(layout) if layout in self.layouts else None

    def add_layout(self, layout: KVLayout) -> int:
        self.layouts.append(layout)
        return len(self.layouts) - 1

    def register(self, namespace: Namespace) -> tuple[NamespaceEntry, bool]:
        """The namespace's entry, and whether it is new (idempotent); its layout is known already."""
        layout = self.layout_id(namespace.layout)
        if layout is None:
            raise LayoutMismatch(f"namespace layout {namespace.layout} is not one of this cache's")
        root = self.hasher.root(namespace)
        ns_id = namespace_id(root)
        known = self._by_id.get(ns_id)
        if known is not None:
            if known.namespace != namespace:
                raise InvalidArgument("namespace", f"id {ns_id} already names a different namespace (hash collision)")
            return known, False
        if len(self._by_row) >= MAX_NAMESPACES:
            raise ResourceExhausted("namespace: too many namespaces", "namespace")
        entry = NamespaceEntry(len(self._by_row), namespace, root, ns_id, layout)
        self._by_id[ns_id] = entry
        self._by_row.append(entry)
        self.layout_of_row[entry.index] = layout
        self.bytes_of_row[entry.index] = namespace.layout.block_bytes
        return entry, True

    def get(self, ns_id: str) -> NamespaceEntry:
        entry = self._by_id.get(ns_id)
        if entry is None:
            raise UnknownNamespace(ns_id)
        return entry

    def by_row(self, row: int) -> NamespaceEntry:
        return self._by_row[row]

    def prompt(self, ns_id: str, tokens: Tokens, multiple: int = 1) -> Prompt:
        """Only whole groups of `multiple` blocks are hashed (an engine's blocks, KVLayout.blocks_per)."""
        entry = self.get(ns_id)
        array = token_array(tokens)
        if len(array) > self.max_prompt_tokens:
            raise ResourceExhausted(
                f"tokens: {len(array)} tokens exceed the limit of {self.max_prompt_tokens}", "tokens"
            )
        size = self.block_size
        full = len(array) // (size * multiple) * multiple
        whole = array[: full * size]
        return Prompt(
            entry, array, whole.reshape(full, size), self.hasher.block_hashes(entry.root, whole, size), multiple
        )
