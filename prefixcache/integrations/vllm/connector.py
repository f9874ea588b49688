"""`PrefixCacheConnector`: vLLM's KV connector API (`KVConnectorBase_V1`) over prefixcache.

vLLM builds one instance in the scheduler process (role SCHEDULER: lookups, planning) and
one per worker (role WORKER: copies); this class only validates the configuration, derives
the namespace and delegates to `SchedulerSide` / `WorkerSide`.

Invariants:
- Supported: one full-attention KV cache group (every decoder-only model with plain
  attention), tensor_parallel_size 1, pipeline_parallel_size 1, backends CPU_ATTN,
  FLASH_ATTN, FLASHINFER. Anything else fails at start-up with an error that says so.
- The cache is best effort: the connector sets `kv_load_failure_policy="recompute"` so a
  failed load makes vLLM recompute, never fail the request, and `requires_kv_delivery` is
  False (a dropped save is a future miss).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...errors import ConfigError
from .config import ConnectorSettings, check_layer_scales, describe, namespace_of
from .link import LOGGER, CacheLink
from .metadata import PrefixCacheMetadata
from .paged import PagedCache, PagedLayer, packing_of_backend
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
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)


class PrefixCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "tensor_parallel_size",
                "PrefixCacheConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only",
            )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ConfigError(
                "kv_cache_groups", f"PrefixCacheConnector needs one full-attention KV cache group (got {len(groups)})"
            )
        spec = groups[0].kv_cache_spec
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise ConfigError("head_size_v", "keys and values of different head sizes are not supported")
        self.layer_names = list(groups[0].layer_names)
        self.block_size = vllm_config.cache_config.block_size
        namespace = namespace_of(
            vllm_config, self.settings, len(self.layer_names), spec.num_kv_heads, spec.head_size, tp_rank=0
        )
        self.stats = StatsBox()
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.link = CacheLink(self.settings, namespace, role_name)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                transfer.kv_load_failure_policy = "recompute"  # read by the scheduler right after this
            self._scheduler = SchedulerSide(self.link, self.stats, self.block_size)
            log.info(
                "prefixcache: connector %s, namespace %s/%s %s%s",
                describe(self.settings),
                namespace.model,
                namespace.revision,
                namespace.layout,
                f" kv_scale={namespace.kv_scale}" if namespace.kv_scale else "",
            )
        else:
            self._worker = WorkerSide(self.link, self.stats)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker role --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend = self._backend_name()
        packing = packing_of_backend(backend)
        head_size = self.link.layout.head_dim
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV tensor for layer {missing[0]}")
        layers = [PagedLayer.of(kv_caches[name], packing, head_size) for name in self.layer_names]
        check_layer_scales(self.link.namespace.kv_scale, self._layer_scales())
        assert self._worker is not None
        self._worker.paged = PagedCache(layers, self.link.layout.dtype.torch)
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
        from vllm.model_executor.layers.attention.attention import Attention

        return dict(get_layers_from_vllm_config(self._vllm_config, Attention, self.layer_names))

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
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish inside start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied out after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, PrefixCacheMetadata) and meta.saves:
            self._worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            if self._scheduler is not None:
                self._scheduler.prefill.log()
            self.link.close()

    # -- scheduler role -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixCacheMetadata:
        assert self._scheduler is not None
        return self._scheduler.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request)
        return False, None

    # -- stats --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> PrefixCacheStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixCacheStats | None:
        return PrefixCacheStats(dict(data)) if data is not None else PrefixCacheStats()

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> PrefixCachePromMetrics:
        return PrefixCachePromMetrics(*args, **kwargs)  # vLLM's arguments, as PrefixCachePromMetrics types them
