"""The worker half: copy leased cache blocks into vLLM's paged KV, and new prompt blocks out.

Loads run synchronously in `start_load_kv`, before the step's forward reads them; saves copy
the blocks out of vLLM's cache in `wait_for_save` (after the forward wrote them, before the
scheduler can free them) and hand the copy to one background thread that stores it, so a slow
service never stalls a step.

Data paths (chosen per load):
- co-located (the service's host tier mapped here, the slots all in it): shared memory ->
  staging tensor -> vLLM's blocks; gRPC carries only the Release.
- otherwise: the lease's blocks over the Fetch stream, then into vLLM's blocks.
Saves go through `CacheClient.store`: Reserve + copy into shared memory + Commit when mapped,
else the Store stream.

Invariants:
- A load whose shared-memory segment differs from this worker's attachment (the service
  restarted between Lookup and load; a stream load's lease is unknown to a restarted service), whose lease expired before the copy finished,
  or that failed in any way is reported by vLLM block id through
  `get_block_ids_with_load_errors`, so vLLM recomputes those blocks; wrong KV is never kept.
- The worker releases every lease it received, whatever happened to the load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ...client.api import Hit
from ...errors import PrefixCacheError
from .link import LOGGER, CacheLink, service_level
from .metadata import LoadOp, PrefixCacheMetadata, SaveOp
from .paged import PagedCache
from .stats import StatsBox

log = logging.getLogger(LOGGER)

SAVE_QUEUE_BLOCKS = 4096  # blocks copied out and waiting for the service; more are dropped


class WorkerSide:
    def __init__(self, link: CacheLink, stats: StatsBox) -> None:
        self.link = link
        self.stats = stats
        self.paged: PagedCache | None = None
        self._load_errors: set[int] = set()
        self._queue: queue.Queue[tuple[SaveOp, torch.Tensor] | None] = queue.Queue()
        self._queued_blocks = 0
        self._queued_lock = threading.Lock()
        self._saver = threading.Thread(target=self._save_loop, name="prefixcache-save", daemon=True)
        self._saver.start()

    # -- loads ------------------------------------------------------------------------------
    def load(self, meta: PrefixCacheMetadata) -> None:
        for op in meta.loads:
            started = time.perf_counter()
            try:
                self._load_one(op)
            except (PrefixCacheError, RuntimeError, ValueError) as error:
                self._load_errors.update(op.block_ids)
                self.stats.add(load_failures=1)
                log.debug(
                    "prefixcache worker: load of %d blocks for %s failed (%s); vLLM recomputes them",
                    len(op.block_ids),
                    op.request_id,
                    error,
                )
                continue
            finally:
                self._release(op.hit)
            self.stats.add(
                loaded_blocks=len(op.block_ids),
                load_seconds=time.perf_counter() - started,
                loaded_tokens=len(op.block_ids) * self.link.layout.block_size,
            )

    def _load_one(self, op: LoadOp) -> None:
        if self.paged is None:
            raise PrefixCacheError("vLLM's KV caches were never registered")
        attached = self.link.client()
        if attached is None:
            raise PrefixCacheError("service unusable")
        client, attachment = attached
        if op.host_segment and attachment.shared_memory and attachment.host_segment != op.host_segment:
            self.link.failed(PrefixCacheError("the service restarted"))  # re-attach for later loads
            raise PrefixCacheError(f"lease {op.hit.lease_id} is from another attachment of the service")
        end = op.first_block + len(op.block_ids)
        if end > op.hit.blocks:
            raise PrefixCacheError(f"load of blocks {op.first_block}..{end} beyond the {op.hit.blocks} leased")
        try:  # mapped memory when the client has every block of the range mapped, else the stream
            blocks = client.read(op.hit, blocks=slice(op.first_block, end))
        except PrefixCacheError as error:
            if service_level(error):  # an unreachable or restarted service, not an expired lease
                self.link.failed(error)
            raise
        self.paged.load(blocks, list(op.block_ids))

    def _release(self, hit: Hit) -> None:
        attached = self.link.client()
        if attached is None:
            return
        try:
            attached[0].release(hit)
        except PrefixCacheError as error:
            self.link.failed(error)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------
    def save(self, meta: PrefixCacheMetadata) -> None:
        if self.paged is None:
            return
        for op in meta.saves:
            with self._queued_lock:
                if self._queued_blocks + len(op.block_ids) > SAVE_QUEUE_BLOCKS:
                    self.stats.add(saves_dropped=1)
                    continue
                self._queued_blocks += len(op.block_ids)
            started = time.perf_counter()
            kv = self.paged.gather(list(op.block_ids))
            self.stats.add(save_seconds=time.perf_counter() - started)
            self._queue.put((op, kv))

    def _save_loop(self) -> None:
        # vLLM runs the model (and so the first attach, which maps shared memory) under inference
        # mode; tensors made there may only be written in inference mode.
        with torch.inference_mode():
            self._save_items()

    def _save_items(self) -> None:
        while (item := self._queue.get()) is not None:
            op, kv = item
            try:
                self._store(op, kv)
            finally:
                with self._queued_lock:
                    self._queued_blocks -= len(op.block_ids)
                self._queue.task_done()
        self._queue.task_done()

    def _store(self, op: SaveOp, kv: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            answer = self.link.call(
                lambda client, _: client.store(
                    list(op.tokens), kv, start_block=op.start_block, cache_salt=op.cache_salt
                )
            )
        except PrefixCacheError as error:
            self.stats.add(save_failures=1)
            if service_level(error):
                self.link.failed(error)
            else:
                log.info("prefixcache worker: save for %s refused: %s", op.request_id, error)
            return
        if answer is None:
            self.stats.add(save_failures=1)
            return
        result = answer[0]
        self.stats.add(
            saved_blocks=result.stored,
            save_deduplicated=result.deduplicated,
            save_rejected=result.rejected,
            save_seconds=time.perf_counter() - started,
        )

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
        self.flush(5.0)
        totals = self.stats.totals
        log.info("prefixcache worker totals: %s", ", ".join(f"{k}={v:.6g}" for k, v in sorted(totals.items())))
        self._queue.put(None)
        self._saver.join(timeout=5.0)
        self.link.close()
