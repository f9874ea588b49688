"""Recurrent state (Mamba, Gated DeltaNet) at block boundaries: how the connector names and finds it.

vLLM's "align" mode keeps a state layer's state at block boundaries it chooses (the prompt's
last one, shared-prefix junctions; `prefix_cache_retention_interval` adds periodic ones) and
offers each to a connector as it commits it (`boundary_state_offloads`). A hit on a hybrid
model needs the attention blocks up to a boundary *and* the state at exactly that boundary.

A state is stored as one block of the state namespace (groups.py: every state layer's page),
under a content address of the prefix it summarises: its token block is the SHA-256 of the
prefix's token ids (16 16-bit values, then zeros), the way vLLM's own prefix cache names
blocks. So the states of every boundary of every prompt live side by side in one namespace
(no namespace per prefix), a Lookup of that one block finds one, and the service verifies the
digest as it verifies tokens. `probe` asks for the last few boundaries of an attention hit,
longest first: the hit is cut to the first boundary whose state is stored, or is a miss.

Invariants: a state is looked up and stored under the request's cache salt, like its KV; a
state is never loaded at any position but its own boundary (the LoadOp's end, worker.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ...client.api import CacheClient, Hit
from ...errors import ConfigError

DIGEST_TOKENS = 16  # SHA-256 as 16 16-bit "tokens"
PROBES = 4  # boundaries looked up per request, from the attention hit's end down


def state_tokens(prefix: Sequence[int], block_size: int) -> list[int]:
    """The token block that names the state after `prefix` (a whole number of blocks)."""
    if block_size < DIGEST_TOKENS:
        raise ConfigError("block_size", f"state blocks need >= {DIGEST_TOKENS}-token blocks, vLLM has {block_size}")
    digest = hashlib.sha256(np.asarray(prefix, dtype="<u4").tobytes()).digest()
    words: list[int] = np.frombuffer(digest, dtype="<u2").tolist()
    return words + [0] * (block_size - DIGEST_TOKENS)


def lookup_state(client: CacheClient, prompt: Sequence[int], blocks: int, block_size: int, salt: str | None) -> Hit:
    """The state after the prompt's first `blocks` blocks, with a lease (`blocks` 0 in the hit: not stored)."""
    return client.lookup(state_tokens(prompt[: blocks * block_size], block_size), cache_salt=salt, take_lease=True)


def probe(
    client: CacheClient, prompt: Sequence[int], hit_blocks: int, block_size: int, salt: str | None
) -> tuple[int, Hit | None]:
    """(boundary in blocks, its leased state) for the longest of the last PROBES boundaries up to
    `hit_blocks` whose state is stored; (0, None) when none is."""
    for blocks in range(hit_blocks, max(0, hit_blocks - PROBES), -1):
        found = lookup_state(client, prompt, blocks, block_size, salt)
        if found.blocks:
            return blocks, found
        if found.lease_id:
            client.release(found)
    return 0, None
