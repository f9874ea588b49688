"""`PrefixCacheConnector`: vLLM's KV connector API (`KVConnectorBase_V1`) over prefixcache.

vLLM builds one instance in the scheduler process (role SCHEDULER: lookups, planning) and
one per worker (role WORKER: copies); this class only validates the configuration, derives
the namespace and delegates to `SchedulerSide` / `WorkerSide`.

Invariants:
- Supported: every KV cache group of full, sliding-window, chunked-local or MLA attention
  with one geometry across layers, and Mamba / linear-attention state groups in vLLM's align
  mode (groups.py; their states live in a second namespace, states.py), vLLM's hybrid KV
  cache manager on
  (`SupportsHMA`), any tensor_parallel_size (a shard per rank), pipeline_parallel_size 1,
  backends CPU_ATTN, FLASH_ATTN, FLASHINFER and the MLA ones (paged.py). Anything else fails
  at start-up with an error that names the model class and what is unsupported.
- The cache is best effort: the connector sets `kv_load_failure_policy="recompute"` so a
  failed load makes vLLM recompute, never fail the request, and `requires_kv_delivery` is
  False (a dropped save is a future miss). Loads are copied within the step when cheap,
  asynchronously otherwise (scheduler.py, worker.py).
- vLLM's `kv_role` holds: a `kv_producer` sends no Lookup and loads nothing, a `kv_consumer`
  saves nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ...errors import ConfigError
from .config import ConnectorSettings, check_layer_scales, describe, namespace_of
from .groups import KVGroups
from .layers import LayerLoads, layer_by_layer
from .link import LOGGER, ConnectorLink
from .metadata import PrefixCacheMetadata
from .paged import KVPacking, PagedCache, PagedLayer, StatePages, packing_of_backend
from .scheduler import SchedulerSide
from .stats import PrefixCachePromMetrics, PrefixCacheStats, StatsBox
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)


def _model_class(vllm_config: VllmConfig) -> str:
    architectures = getattr(vllm_config.model_config.hf_config, "architectures", None) or ["this model"]
    return str(architectures[0])


def _reference_cpu_mla(vllm_config: VllmConfig) -> bool:
    """Whether an MLA engine runs vLLM's reference CPU MLA backend (CPU_MLA), which cannot prefill
    on top of cached KV (vLLM turns its own prefix caching off for it). vLLM picks it on a CPU
    without AMX tiles or when asked for it; otherwise its AMX backend (AMX_MLA), which can."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not current_platform.is_cpu():
        return False
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return not torch.cpu._is_amx_tile_supported() or chosen == AttentionBackendEnum.CPU_MLA


def _tp_rank(role: KVConnectorRole) -> int:
    """This worker's tensor-parallel rank (the scheduler looks up rank 0's shard)."""
    if role == KVConnectorRole.SCHEDULER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class PrefixCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        model_class = _model_class(vllm_config)
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "pipeline_parallel_size",
                f"{model_class}: PrefixCacheConnector stores every layer of a block together, so it needs "
                "pipeline_parallel_size=1 (tensor parallelism is supported)",
            )
        if getattr(parallel, "decode_context_parallel_size", 1) != 1:
            raise ConfigError(
                "decode_context_parallel_size", f"{model_class}: decode context parallelism is not supported"
            )
        self.groups = KVGroups.of(kv_cache_config, model_class)
        self.block_size = self.groups.block_size
        self.layer_names = list(self.groups.layer_names)
        tp_rank = _tp_rank(role)
        geometry = (self.groups.kv_heads, self.groups.head_size, self.block_size, tp_rank)
        namespace = namespace_of(
            vllm_config, self.settings, len(self.layer_names), *geometry, kind="mla" if self.groups.latent else ""
        )
        self.stats = StatsBox()
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else f"worker (tp rank {tp_rank})"
        self.link = ConnectorLink(self.settings, namespace, role_name)
        self.state_link: ConnectorLink | None = None
        if self.groups.has_state:  # an attention page holds a state page: same geometry, one slot per layer
            states = namespace_of(
                vllm_config, self.settings, len(self.groups.state_names), *geometry, kind=self.groups.state_kind
            )
            self.state_link = ConnectorLink(self.settings, states, f"{role_name}, states")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Loads copied within the step: one KV cache group (vLLM maps block-level load errors back
        # to requests only then) and one rank (other ranks' own Lookups would run inside the step).
        self._in_step_loads = self.groups.group_count == 1 and parallel.tensor_parallel_size == 1
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                transfer.kv_load_failure_policy = "recompute"  # read by the scheduler right after this
            # MLA on vLLM's reference CPU backend (CPU_MLA) cannot prefill on top of cached KV: the
            # connector only saves there. Its AMX backend (AMX_MLA) loads exactly (docs/vllm.md).
            reference_mla = self.groups.latent and _reference_cpu_mla(vllm_config)
            if reference_mla:
                log.warning(
                    "prefixcache: %s on vLLM's reference CPU MLA backend (CPU_MLA), which cannot prefill "
                    "on top of cached KV: the connector saves blocks (for MLA engines elsewhere sharing "
                    "this service) and loads none",
                    model_class,
                )
            self._scheduler = SchedulerSide(
                self.link,
                self.stats,
                self.block_size,
                transfer.is_kv_consumer and not reference_mla,  # kv_role: a producer only saves...
                self.state_link,
                self.groups.state_groups,
                in_step_loads=self._in_step_loads,
                saves=transfer.is_kv_producer,  # ...and a consumer only loads
            )
            log.info(
                "prefixcache: connector %s, kv_role %s, namespace %s/%s %s%s; KV cache groups: %s",
                describe(self.settings),
                transfer.kv_role,
                namespace.model,
                namespace.revision,
                namespace.layout,
                f" kv_scale={namespace.kv_scale}" if namespace.kv_scale else "",
                self.groups.describe(),
            )
        else:
            self._worker = WorkerSide(self.link, self.stats, tp_rank, self.state_link)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker role --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend = self._backend_name()
        packing = packing_of_backend(backend)
        if (packing is KVPacking.LATENT) != self.groups.latent:
            raise ConfigError(
                "attention_backend", f"backend {backend} does not match the layers' {self.groups.describe()}"
            )
        head_size = self.link.layout.head_dim
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV tensor for layer {missing[0]}")
        layers = [
            PagedLayer.of(kv_caches[name], packing, head_size, group)
            for name, group in zip(self.layer_names, self.groups.layer_groups, strict=True)
        ]
        check_layer_scales(self.link.namespace.kv_scale, self._layer_scales())
        assert self._worker is not None
        self._worker.paged = PagedCache(layers, self.link.layout.dtype.torch)
        device = layers[0].keys.device
        if self._in_step_loads and layer_by_layer(self.settings.layer_loads, device):
            self._worker.layers = LayerLoads(self._worker.paged, self.layer_names, self._worker.mark_invalid)
            log.info("prefixcache worker: in-step loads copied layer by layer on %s", device)
        if self.groups.has_state:
            self._worker.states = StatePages.of(
                kv_caches, self._kv_cache_config, self.groups.state_names, self.groups.state_groups
            )
        first = kv_caches[self.layer_names[0]]
        log.info(
            "prefixcache worker: %d layers of %s paged KV (%s, %s %s, stored as %s) on %s",
            len(layers),
            backend,
            packing.value,
            tuple(first.shape),
            first.dtype,
            self.link.layout.dtype.value,
            first.device,
        )

    def _attention_layers(self) -> dict[str, Any]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        # The base class (abstract) so MLA layers are found too: the lookup is an isinstance test.
        layers = get_layers_from_vllm_config(
            self._vllm_config,
            AttentionLayerBase,  # type: ignore[type-abstract, unused-ignore]
            self.layer_names,
        )
        return dict(layers)

    def _backend_name(self) -> str:
        return str(self._attention_layers()[self.layer_names[0]].get_attn_backend().get_name())

    def _layer_scales(self) -> dict[str, tuple[float, float]]:
        """Each layer's (k_scale, v_scale) as vLLM quantizes KV with them (host copies, after weight loading)."""
        return {
            name: (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
            for name, layer in self._attention_layers().items()
        }

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, PrefixCacheMetadata) and meta.loads:
            with self.stats.engine_thread():
                self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # In-step loads copied layer by layer (layers.py); a parked (asynchronous) one is not in the forward.
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied out after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        self._worker.finish_layers()  # the forward is over: every layer's loaded blocks are in place
        meta = self._connector_metadata
        if isinstance(meta, PrefixCacheMetadata) and (meta.saves or meta.state_saves):
            with self.stats.engine_thread():
                self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended since the last step; a failed one makes vLLM recompute its request."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of in-step loads that failed (one KV cache group only; asynchronous loads report
        failures per request through get_transfer_results)."""
        return self._worker.invalid_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            if self._scheduler is not None:
                self._scheduler.prefill.log()
                self._scheduler.close()
            self.link.close()
            if self.state_link is not None:
                self.state_link.close()

    # -- scheduler role -----------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            with self.stats.engine_thread():
                self._scheduler.started(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        with self.stats.engine_thread():
            return self._scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        with self.stats.engine_thread():
            self._scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixCacheMetadata:
        assert self._scheduler is not None
        with self.stats.engine_thread():
            return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None and connector_output.failed_recving:
            self._scheduler.receives_failed(set(connector_output.failed_recving))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        with self.stats.engine_thread():
            self._scheduler.finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves copy blocks out in the step that computed them, so nothing waits on the blocks."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- stats --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> PrefixCacheStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixCacheStats | None:
        return PrefixCacheStats(dict(data)) if data is not None else PrefixCacheStats()

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> PrefixCachePromMetrics:
        return PrefixCachePromMetrics(*args, **kwargs)  # vLLM's arguments, as PrefixCachePromMetrics types them
