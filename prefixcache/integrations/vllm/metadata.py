"""What the scheduler-side connector tells the worker-side one each step (pickled by vLLM).

Invariants:
- A `LoadOp` names only service-issued ids (lease, namespace, shared-memory segment) and the
  slots the Lookup answered; the worker copies `slots[i]` into vLLM block `block_ids[i]`.
- A `SaveOp` covers the prompt's full blocks `start_block..start_block+len(block_ids)` and
  carries the tokens up to their end: the service derives every block hash from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadOp:
    request_id: str
    namespace_id: str
    host_segment: str  # the segment the slots live in ("" when read by stream)
    lease_id: int
    lease_deadline: float  # time.monotonic() (system-wide clock) before which the lease is live
    prompt_tokens: int
    hit_tokens: int  # the whole leased hit (a Fetch stream moves all of it)
    tiers: tuple[int, ...]  # of every leased block, root first
    slots: tuple[int, ...]
    first_block: int  # the first leased block to load (vLLM computed those before it)
    block_ids: tuple[int, ...]  # vLLM blocks for leased blocks first_block.. in order


@dataclass(frozen=True)
class SaveOp:
    request_id: str
    tokens: tuple[int, ...]  # the prompt up to the end of the last saved block
    start_block: int
    block_ids: tuple[int, ...]
    cache_salt: str | None


@dataclass
class PrefixCacheMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
