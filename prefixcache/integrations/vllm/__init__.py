"""prefixcache as a vLLM KV connector (vLLM >= 0.32, `KVConnectorBase_V1`).

    vllm serve MODEL --block-size 32 --kv-transfer-config '{"kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "prefixcache.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache": "127.0.0.1:50051"}}'

Modules: `config` (extra-config keys, namespace), `link` (fail-open client), `scheduler`
and `worker` (the two roles), `paged` (vLLM's paged KV layouts), `metadata`, `stats`,
`connector` (the class vLLM loads). docs/vllm.md is the user guide. Importing this package
imports vLLM; `import prefixcache` does not.
"""

from .connector import PrefixCacheConnector

__all__ = ["PrefixCacheConnector"]
