"""The worker half: copy leased cache blocks into vLLM's paged KV, and new prompt blocks out.

Loads: an in-step `LoadOp` (mapped memory, cheaper than a step: scheduler.py) is copied in
`start_load_kv` before the forward, and a failed one reports its blocks through
`invalid_blocks` (vLLM recomputes them). The others are asynchronous: `start_load_kv` hands
them to a loader thread and returns; vLLM keeps the loading requests parked
(WAITING_FOR_REMOTE_KVS, their blocks allocated and unused by any forward) and steps the
others meanwhile, and `finished_loads` reports each request once its copy is done or failed
(vLLM then recomputes it). Saves copy the
blocks out of vLLM's cache in `wait_for_save` (after the forward wrote them, before the
scheduler can free them; on CUDA the step only queues that copy, paged.py `HostCopy`) and hand
the copy to one background thread that waits for it and stores it, so neither the copy to host
memory nor a slow service stalls a step. On CPU, where the client holds a spare reservation of
the service's mapped slots large enough (each Commit asks for one as large as the largest of
the last 8 stores), the step copies the blocks straight into those slots and the thread only
commits them: one copy of the blocks instead of two.

Tensor parallelism: each rank stores and loads its own shard of every block under its own
namespace (`tp=<rank>/<size>`). The scheduler's Lookup and lease are rank 0's; every other rank
looks its shard up itself (the `LoadOp` carries the tokens) and fails the load when its shard
is shorter, so a hit is used only when every rank holds its part.

Models with state layers (Mamba, GDN): a load also copies the state at its end into each state
group's block there, and fails unless it ends exactly at the state's boundary; the states the
scheduler names (`StateSaveOp`) are copied out with the step's blocks and stored in the state
namespace (states.py).

Data paths (chosen per load):
- co-located (the service's host tier mapped here, the slots all in it): on CPU each run of
  mapped slots straight into vLLM's blocks (`read_into`, one copy); on CUDA shared memory ->
  staging tensor -> vLLM's blocks; only the Release goes to the service (over its control
  socket, client/control_socket.py).
- otherwise: the lease's blocks over the Fetch stream, then into vLLM's blocks.
Saves go through `CacheClient.store` (Reserve + copy into shared memory + Commit when mapped,
else the Store stream), or `reserve_mapped` + `commit_reserved` when copied in place.

Invariants:
- A load whose shared-memory segment differs from this worker's attachment (the service
  restarted between Lookup and load; a stream load's lease is unknown to a restarted service),
  whose lease expired before the copy finished, or that failed in any way is reported as a
  failed receive (vLLM recomputes the request: with several KV cache groups vLLM cannot map
  block ids back to requests); wrong KV is never kept.
- The worker releases every lease it received or took, whatever happened to the load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ...client.api import CacheClient, Hit, Reservation
from ...client.link import CacheLink, service_level
from ...errors import PrefixCacheError
from ...results import CommitResult
from ...threads import name_os_thread
from . import states
from .layers import LayerLoads
from .link import LOGGER
from .metadata import LoadOp, PrefixCacheMetadata, SaveOp, StateSaveOp
from .paged import HostCopy, PagedCache, StatePages
from .stats import StatsBox

log = logging.getLogger(LOGGER)

SAVE_QUEUE_BLOCKS = 4096  # blocks copied out and waiting for the service; more are dropped


@dataclass(frozen=True)
class Written:
    """A save copied into slots the service reserved (`CacheClient.reserve_mapped`), to commit on
    the client holding the reservation."""

    client: CacheClient
    reservation: Reservation


class WorkerSide:
    def __init__(self, link: CacheLink, stats: StatsBox, tp_rank: int = 0, state_link: CacheLink | None = None) -> None:
        self.link = link
        self.state_link = state_link
        self.stats = stats
        self.tp_rank = tp_rank
        self.paged: PagedCache | None = None
        self.states: StatePages | None = None
        self.layers: LayerLoads | None = None  # in-step loads copied layer by layer (layers.py)
        # asynchronous loads, and the leases of in-step ones (a Release never runs inside a step)
        self._loads: queue.Queue[LoadOp | tuple[Hit, CacheLink] | None] = queue.Queue()
        self._loaded: set[str] = set()  # requests whose load ended since vLLM last asked
        self._load_failed: set[str] = set()
        self._invalid_blocks: set[int] = set()  # in-step loads that failed, for vLLM to recompute
        self._loaded_lock = threading.Lock()
        # (save, its copy out of vLLM's cache or the slots it was copied into, its blocks in the queue's bound)
        self._queue: queue.Queue[tuple[SaveOp | StateSaveOp, HostCopy | Written, int] | None] = queue.Queue()
        self._queued_blocks = 0
        self._queued_lock = threading.Lock()
        self._loader = threading.Thread(target=self._load_loop, name="prefixcache-load", daemon=True)
        self._saver = threading.Thread(target=self._save_loop, name="prefixcache-save", daemon=True)
        self._loader.start()
        self._saver.start()

    # -- loads ------------------------------------------------------------------------------
    def load(self, meta: PrefixCacheMetadata) -> None:
        """The step's loads (start_load_kv): in-step ones now (with `layers`, read now and copied
        into vLLM's cache layer by layer behind the forward), the others on the loader thread."""
        for op in meta.loads:
            if op.in_step:
                if not self._load_counted(op, by_layer=self.layers is not None):
                    self.mark_invalid(set(op.block_ids[0]))
            else:
                self._loads.put(op)
        if self.layers is not None:
            self.layers.start()

    def wait_for_layer(self, layer_name: str) -> None:
        if self.layers is not None:
            self.layers.wait(layer_name)

    def finish_layers(self) -> None:
        """After the forward: every layer-by-layer copy of the step has landed."""
        if self.layers is not None:
            self.layers.finish()

    def mark_invalid(self, block_ids: set[int]) -> None:
        with self._loaded_lock:
            self._invalid_blocks.update(block_ids)

    def _load_loop(self) -> None:
        name_os_thread("pfx-load")
        with torch.inference_mode():  # as vLLM's own forward: tensors mapped there are inference tensors
            while (item := self._loads.get()) is not None:
                with self.stats.background():
                    if isinstance(item, LoadOp):
                        self._load_counted(item, report=True)
                    else:
                        self._release(*item)

    def _load_counted(self, op: LoadOp, report: bool = False, by_layer: bool = False) -> bool:
        """Copy one load, count it and release its leases; `report`: an asynchronous load, told
        to vLLM through `finished_loads` (else in-step: the Releases are left to the loader
        thread, so a slow service never holds up the step); `by_layer`: read it and leave the
        copies to `layers`. False when it failed."""
        started = time.perf_counter()
        failed = True
        try:
            copies = self._load_one(op, by_layer)
            failed = False
        except (PrefixCacheError, RuntimeError, ValueError) as error:
            self.stats.add(load_failures=1)
            log.debug(
                "prefixcache worker: load of %d blocks for %s failed (%s); vLLM recomputes it",
                op.blocks,
                op.request_id,
                error,
            )
        finally:
            if report:
                with self._loaded_lock:  # reported first: vLLM may schedule it while the Release travels
                    self._loaded.add(op.request_id)
                    if failed:
                        self._load_failed.add(op.request_id)
            if self.tp_rank == 0:
                leases = [(op.hit, self.link)]
                if op.state is not None and self.state_link is not None:
                    leases.append((op.state, self.state_link))
                for lease in leases:
                    if report:
                        self._release(*lease)
                    else:  # an in-step load: its Release (an RPC) goes to the loader thread
                        self._loads.put(lease)
        if not failed:
            self.stats.add(
                loaded_blocks=op.blocks,
                load_seconds=time.perf_counter() - started,
                loaded_tokens=op.blocks * self.link.layout.block_size,
                loaded_layer_blocks=copies,
            )
        return not failed

    def _load_one(self, op: LoadOp, by_layer: bool = False) -> int:
        if self.paged is None:
            raise PrefixCacheError("vLLM's KV caches were never registered")
        attached = self.link.client()
        if attached is None:
            raise PrefixCacheError("service unusable")
        client, attachment = attached
        end = op.first_block + op.blocks
        hit = op.hit
        if self.tp_rank:  # this rank's shard: its own Lookup and lease
            hit = client.lookup(list(op.tokens), cache_salt=op.cache_salt, take_lease=True)
            try:
                if hit.blocks < end:
                    raise PrefixCacheError(f"rank {self.tp_rank} holds {hit.blocks} of the {end} blocks rank 0 holds")
                self._load_state(op, end)
                return self._copy(client, hit, op, end, by_layer)
            finally:
                self._release(hit)
        if op.host_segment and attachment.shared_memory and attachment.host_segment != op.host_segment:
            self.link.failed(PrefixCacheError("the service restarted"), client)  # re-attach for later loads
            raise PrefixCacheError(f"lease {op.hit.lease_id} is from another attachment of the service")
        if end > hit.blocks:
            raise PrefixCacheError(f"load of blocks {op.first_block}..{end} beyond the {hit.blocks} leased")
        self._load_state(op, end)
        return self._copy(client, hit, op, end, by_layer)

    def _load_state(self, op: LoadOp, end: int) -> None:
        """A model with state layers: the state at the load's end into each state group's block there."""
        if self.state_link is None:
            return
        if self.states is None or end != op.state_blocks:
            raise PrefixCacheError(f"a load ending at block {end} has no state there (stored: {op.state_blocks})")
        attached = self.state_link.client()
        if attached is None:
            raise PrefixCacheError("state namespace unusable")
        client = attached[0]
        if self.tp_rank == 0 and op.state is not None:
            block = client.read(op.state)
        else:  # this rank's shard of the state
            found = states.lookup_state(client, op.tokens, end, self.link.layout.block_size, op.cache_salt)
            try:
                if not found.blocks:
                    raise PrefixCacheError(f"rank {self.tp_rank} holds no state at block {end}")
                block = client.read(found)
            finally:
                self._release(found, self.state_link)
        self.states.load(block, dict(op.state_block_ids))
        self.stats.add(loaded_states=1)

    def _copy(self, client: CacheClient, hit: Hit, op: LoadOp, end: int, by_layer: bool = False) -> int:
        """Copy blocks op.first_block..end of the lease into vLLM's; the layer-blocks copied."""
        paged = self.paged
        assert paged is not None
        copies = 0

        def load(first: int, blocks: torch.Tensor) -> None:
            nonlocal copies
            copies += paged.load(blocks, tuple(ids[first : first + len(blocks)] for ids in op.block_ids))

        try:  # mapped memory when the client has every block of the range mapped, else the stream
            if paged.device.type == "cpu" and not by_layer:
                # Straight from the mapped slots into vLLM's blocks: one copy, not two (on CUDA a
                # copy from the mapping would run after the lease's checks, so it is staged).
                client.read_into(hit, load, blocks=slice(op.first_block, end))
                return copies
            blocks = client.read(hit, blocks=slice(op.first_block, end))
        except PrefixCacheError as error:
            if service_level(error):  # an unreachable or restarted service, not an expired lease
                self.link.failed(error, client)
            raise
        if not by_layer:
            load(0, blocks)
            return copies
        assert self.layers is not None
        plan = paged.plan_load(blocks, op.block_ids, by_layer=True)
        self.layers.add(plan, op.block_ids[0])  # in-step loads: one KV cache group
        self.stats.add(layered_loads=1)
        return plan.copies

    def _release(self, hit: Hit, link: CacheLink | None = None) -> None:
        (link or self.link).release(hit)  # never raises; a service-level failure drops the client

    def invalid_blocks(self) -> set[int]:
        """Blocks of in-step loads that failed since the last call (vLLM recomputes them)."""
        with self._loaded_lock:
            blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose load ended, those of them that failed) since the last call."""
        with self._loaded_lock:
            done, failed = self._loaded, self._load_failed
            self._loaded, self._load_failed = set(), set()
        return done, failed

    # -- saves -------------------------------------------------------------------------------
    def save(self, meta: PrefixCacheMetadata) -> None:
        if self.paged is None:
            return
        for op in meta.saves:
            with self._queued_lock:
                if self._queued_blocks + op.blocks > SAVE_QUEUE_BLOCKS:
                    self.stats.add(saves_dropped=1)
                    continue
                self._queued_blocks += op.blocks
            started = time.perf_counter()
            copy = self._write_reserved(op) or self.paged.gather_later(op.block_ids)
            self.stats.add(save_seconds=time.perf_counter() - started)
            self._queue.put((op, copy, op.blocks))
        if self.states is not None and self.state_link is not None:
            for state_op in meta.state_saves:
                with self._queued_lock:
                    if self._queued_blocks + 1 > SAVE_QUEUE_BLOCKS:
                        self.stats.add(saves_dropped=1)
                        continue
                    self._queued_blocks += 1
                self._queue.put((state_op, self.states.gather_later(dict(state_op.block_ids)), 1))

    def _write_reserved(self, op: SaveOp) -> Written | None:
        """On CPU, copy the save's blocks straight into slots the service reserved in shared
        memory (the spare reservation of the last Commit, when it fits): one copy, and the save
        thread only commits. None where there is no such reservation (`gather_later` then)."""
        assert self.paged is not None
        client = self.link.attached() if self.paged.device.type == "cpu" else None
        reservation = client.reserve_mapped(op.blocks) if client is not None else None
        if client is None or reservation is None:
            return None
        try:
            for first, view in client.reserved_pieces(reservation):
                self.paged.gather_into(tuple(ids[first : first + len(view)] for ids in op.block_ids), view)
        except RuntimeError as error:  # a ValueError (a block vLLM freed) goes up, as from `gather_later`
            # the reservation lapses on the service
            log.info("prefixcache worker: save for %s not copied into shared memory: %s", op.request_id, error)
            return None
        self.stats.add(saves_in_place=1)
        return Written(client, reservation)

    def _save_loop(self) -> None:
        name_os_thread("pfx-save")
        # vLLM runs the model (and so the first attach, which maps shared memory) under inference
        # mode; tensors made there may only be written in inference mode.
        with torch.inference_mode():
            self._save_items()

    def _save_items(self) -> None:
        while (item := self._queue.get()) is not None:
            op, copy, blocks = item
            try:
                with self.stats.background():
                    if isinstance(op, StateSaveOp):
                        assert isinstance(copy, HostCopy)  # a state is never written into slots
                        self._store_state(op, copy.wait())
                    elif isinstance(copy, Written):
                        self._commit(op, copy)
                    else:
                        self._store(op, copy.wait())  # CUDA: the copy out, queued in the step, completes here
            finally:
                with self._queued_lock:
                    self._queued_blocks -= blocks
                self._queue.task_done()
        self._queue.task_done()

    def _store(self, op: SaveOp, kv: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            answer = self.link.call(
                lambda client, _: client.store(
                    list(op.tokens),
                    kv,
                    start_block=op.start_block,
                    cache_salt=op.cache_salt,
                    retention_s=op.retention_s,
                )
            )
        except PrefixCacheError as error:
            self.stats.add(save_failures=1)
            if not service_level(error):  # the link already dropped a client that failed as a service
                log.info("prefixcache worker: save for %s refused: %s", op.request_id, error)
            return
        if answer is None:
            self.stats.add(save_failures=1)
            return
        self._saved(answer[0], started)

    def _commit(self, op: SaveOp, written: Written) -> None:
        """Publish blocks copied into reserved slots, on the client that holds the reservation
        (another one, after a re-attach, does not know it: the save is then lost, not retried)."""
        started = time.perf_counter()
        try:
            result = written.client.commit_reserved(
                written.reservation,
                list(op.tokens),
                start_block=op.start_block,
                cache_salt=op.cache_salt,
                retention_s=op.retention_s,
            )
        except PrefixCacheError as error:
            self.stats.add(save_failures=1)
            if service_level(error):
                self.link.failed(error, written.client)
            else:
                log.info("prefixcache worker: save for %s refused: %s", op.request_id, error)
            return
        self._saved(result, started)

    def _saved(self, result: CommitResult, started: float) -> None:
        self.stats.add(
            saved_blocks=result.stored,
            save_deduplicated=result.deduplicated,
            save_rejected=result.rejected,
            save_seconds=time.perf_counter() - started,
        )

    def _store_state(self, op: StateSaveOp, pages: torch.Tensor) -> None:
        """Store one state block: the pages `[1, layers, page_bytes]` as the state namespace's block."""
        assert self.state_link is not None
        layout = self.state_link.layout
        kv = pages.view(layout.dtype.torch).reshape(
            1, layout.layers, 2, layout.kv_heads, layout.block_size, layout.head_dim
        )
        tokens = states.state_tokens(op.tokens, self.link.layout.block_size)
        try:
            answer = self.state_link.call(lambda client, _: client.store(tokens, kv, cache_salt=op.cache_salt))
        except PrefixCacheError as error:
            self.stats.add(save_failures=1)
            if not service_level(error):
                log.info("prefixcache worker: state save for %s refused: %s", op.request_id, error)
            return
        if answer is None:
            self.stats.add(save_failures=1)
            return
        self.stats.add(saved_states=answer[0].stored)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued saves are stored (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._queued_lock:
                if self._queued_blocks == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        if self.layers is not None:
            self.layers.close()
        self.flush(5.0)
        totals = self.stats.totals
        log.info("prefixcache worker totals: %s", ", ".join(f"{k}={v:.6g}" for k, v in sorted(totals.items())))
        self._queue.put(None)
        self._loads.put(None)
        self._saver.join(timeout=5.0)
        self._loader.join(timeout=5.0)
        self.link.close()
        if self.state_link is not None:
            self.state_link.close()
