"""In-step loads copied layer by layer behind vLLM's forward (`wait_for_layer_load`).

An in-step load is read out of the cache (mapped memory, or the Fetch stream) in
`start_load_kv`, before the forward; what is left is copying each layer's blocks into vLLM's
paged cache, and layer i's attention needs only layer i's. `start` queues every layer's copies
in model order; `wait(layer)`, called by vLLM right before that layer's attention, orders the
attention after that layer's copies, so layer i+1 is copied while layer i computes:

- on CUDA the copies run on a side stream with one event per layer, and `wait` makes vLLM's
  stream wait for the layer's event: nothing blocks the host, the copy engine overlaps the
  kernels;
- on a CPU engine the copies run on a thread and `wait` blocks until the layer is done. The
  thread competes with the forward for the same cores, so `layer_loads: auto` (the default)
  copies layer by layer only on CUDA and a CPU engine copies whole loads in `start_load_kv`;
  `layer_loads: on` forces the thread (tests use it to check the ordering without a GPU).

Invariants:
- A layer's attention never reads a loaded block before it is copied: `wait(layer)` returns
  (CPU) or orders vLLM's stream (CUDA) after that layer's copies of every load of the step.
- `finish` (in `wait_for_save`, after the forward, and before a step's loads start) waits for
  every layer, so no copy outlives its step and a save never gathers a block being written.
- A failed layer copy marks its load's blocks invalid (`failed`): vLLM recomputes them, as for
  a failed in-step load; `wait` never raises into vLLM's forward.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from ...threads import name_os_thread
from .link import LOGGER
from .paged import LoadPlan, PagedCache

log = logging.getLogger(LOGGER)


def layer_by_layer(mode: str, device: torch.device) -> bool:
    """Copy in-step loads layer by layer? `auto`: where it pays, on a CUDA device."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


Load = tuple[LoadPlan, Sequence[int]]  # a planned load and the vLLM block ids it writes


class LayerLoads:
    def __init__(self, paged: PagedCache, layer_names: Sequence[str], failed: Callable[[set[int]], None]) -> None:
        """`layer_names`: vLLM's names of `paged.layers`, in the same order; `failed`: told the
        block ids of a load whose copy failed (vLLM recomputes them)."""
        if len(layer_names) != len(paged.layers):
            raise ValueError(f"{len(layer_names)} layer names for {len(paged.layers)} layers")
        self._paged = paged
        self._number = {name: number for number, name in enumerate(layer_names)}
        self._failed = failed
        self._pending: list[Load] = []
        self._cuda = paged.device.type == "cuda"
        self._stream = torch.cuda.Stream(paged.device) if self._cuda else None
        self._done: list[torch.cuda.Event] | list[threading.Event] = []  # per layer, of the step in flight
        self._in_flight: list[Load] = []  # ... and its loads (CUDA: read by copies the host does not wait for)
        self._steps: queue.Queue[tuple[list[Load], list[threading.Event]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if not self._cuda:
            self._thread = threading.Thread(target=self._copy_steps, name="prefixcache-layers", daemon=True)
            self._thread.start()

    def add(self, plan: LoadPlan, block_ids: Sequence[int]) -> None:
        """A load of this step, copied when `start` is called."""
        self._pending.append((plan, block_ids))

    def start(self) -> None:
        """Queue the step's loads, layer by layer (the forward follows; `wait` orders it)."""
        self.finish()
        loads, self._pending = self._pending, []
        if not loads:
            return
        if self._stream is None:
            done = [threading.Event() for _ in self._paged.layers]
            self._done = done
            self._steps.put((loads, done))
            return
        # The side stream starts after what vLLM's stream queued so far (blocks it just freed or wrote).
        self._stream.wait_stream(torch.cuda.current_stream(self._paged.device))
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(self._stream):
            for number in range(len(self._paged.layers)):
                for load in list(loads):
                    if not self._copy(load, number):
                        loads.remove(load)
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        self._done, self._in_flight = events, loads  # their host blocks stay alive until `finish`

    def wait(self, layer_name: str) -> None:
        """Before `layer_name`'s attention: its copies first (unknown names and steps without
        loads pass)."""
        number = self._number.get(layer_name)
        if number is None or number >= len(self._done):
            return
        self._wait(self._done[number])

    def finish(self) -> None:
        """Every layer's copies of the step in flight are done (on CUDA: ordered before what
        vLLM's stream runs next)."""
        done, self._done = self._done, []
        for event in done:
            self._wait(event)
        self._in_flight = []

    def close(self) -> None:
        self.finish()
        if self._thread is not None:
            self._steps.put(None)
            self._thread.join(timeout=10)

    def _wait(self, event: torch.cuda.Event | threading.Event) -> None:
        if isinstance(event, threading.Event):
            event.wait()
        else:
            torch.cuda.current_stream(self._paged.device).wait_event(event)

    def _copy(self, load: Load, number: int) -> bool:
        plan, block_ids = load
        try:
            self._paged.load_layer(plan, number)
            return True
        except (RuntimeError, ValueError, IndexError) as error:
            log.warning(
                "prefixcache worker: a layer copy failed (%s); vLLM recomputes %d blocks", error, len(block_ids)
            )
            self._failed(set(block_ids))
            return False

    def _copy_steps(self) -> None:
        name_os_thread("pfx-layers")
        # vLLM runs its forward under inference mode; the views written here alias its tensors.
        with torch.inference_mode():
            while (step := self._steps.get()) is not None:
                loads, done = step
                for number, layer_done in enumerate(done):
                    for load in list(loads):
                        if not self._copy(load, number):
                            loads.remove(load)
                    layer_done.set()
