"""Adapters that plug prefixcache into serving engines.

Each submodule imports its engine itself; `import prefixcache` never imports one.
- `prefixcache.integrations.vllm`: `PrefixCacheConnector`, a vLLM v1 KV connector.
"""
