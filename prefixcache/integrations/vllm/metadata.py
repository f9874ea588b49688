"""What the scheduler-side connector tells the worker-side one each step (pickled by vLLM).

Invariants:
- A `LoadOp` carries the client's `Hit` as the Lookup answered it (service-issued ids and
  slots only) and the shared-memory segment it was answered for; the worker copies hit block
  `first_block + i` into block `block_ids[g][i]` of every KV cache group g (null ids: nothing
  to copy for that group there). The Hit is rank 0's shard under tensor parallelism: other
  ranks look their own shard up from `tokens` and `cache_salt`.
- On a model with state layers (states.py) a `LoadOp` also carries the leased state at
  `state_blocks` (rank 0's; other ranks look theirs up) and, per state group, the vLLM block it
  goes to; the load is valid only when it ends exactly at `state_blocks`.
- A `StateSaveOp` names the state vLLM committed at a boundary of the prompt, per state group.
- A `SaveOp` covers the prompt's full blocks `start_block..start_block+n` and carries the
  tokens up to their end: the service derives every block hash from them. A request's saves
  come in prompt order, one per step that completed blocks, while vLLM still holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...client.api import Hit
from .paged import GroupBlockIds


@dataclass(frozen=True)
class LoadOp:
    request_id: str
    hit: Hit  # the scheduler's Lookup answer as is: its lease is the worker's to release
    host_segment: str  # the segment the slots live in ("" when read by stream)
    first_block: int  # the first leased block to load (vLLM computed those before it)
    block_ids: GroupBlockIds  # per group, vLLM blocks for leased blocks first_block.. in order
    tokens: tuple[int, ...]  # the prompt's tokens up to the loaded blocks' end (other TP ranks)
    cache_salt: str | None
    state: Hit | None = None  # models with state layers: the state at state_blocks, leased
    state_blocks: int = 0
    state_block_ids: tuple[tuple[int, int], ...] = ()  # (state group, vLLM block at state_blocks - 1)
    in_step: bool = False  # copied in start_load_kv before the forward (else by the loader thread)

    @property
    def blocks(self) -> int:
        return len(self.block_ids[0])


@dataclass(frozen=True)
class SaveOp:
    request_id: str
    tokens: tuple[int, ...]  # the prompt up to the end of the last saved block
    start_block: int
    block_ids: GroupBlockIds
    cache_salt: str | None
    retention_s: float | None = None  # the request's prompt_cache_retention (kv_transfer_params)

    @property
    def blocks(self) -> int:
        return len(self.block_ids[0])


@dataclass(frozen=True)
class StateSaveOp:
    request_id: str
    tokens: tuple[int, ...]  # the prompt up to the boundary
    block_ids: tuple[tuple[int, int], ...]  # (state group, vLLM block holding the state there)
    cache_salt: str | None


@dataclass
class PrefixCacheMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    state_saves: list[StateSaveOp] = field(default_factory=list)
