"""What the scheduler-side connector tells the worker-side one each step (pickled by vLLM).

Invariants:
- A `LoadOp` carries the client's `Hit` as the Lookup answered it (service-issued ids and
  slots only) and the shared-memory segment it was answered for; the worker copies hit block
  `first_block + i` into vLLM block `block_ids[i]`.
- A `SaveOp` covers the prompt's full blocks `start_block..start_block+len(block_ids)` and
  carries the tokens up to their end: the service derives every block hash from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...client.api import Hit


@dataclass(frozen=True)
class LoadOp:
    request_id: str
    hit: Hit  # the scheduler's Lookup answer as is: its lease is the worker's to release
    host_segment: str  # the segment the slots live in ("" when read by stream)
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
