"""Operator commands of the `prefixcache` CLI: stats, top, inspect, evict, flush.

`commands.register` adds them to the CLI; each talks to a running cache service
through `prefixcache.client.CacheClient` only (never its internals), so what an
operator sees is exactly what the gRPC contract exposes.
"""
