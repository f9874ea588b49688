"""One vLLM process's fail-open link to the prefixcache service: the library's `CacheLink`
(prefixcache/client/link.py: attach with backoff, one classification of errors, drop a failed
client and re-attach) attached to this rank's namespace with the connector's settings.

What is the connector's own: the namespace (config.py's `namespace_of`: per model, weights,
tensor-parallel rank and KV format), the settings (address, token, TLS, `same_host`, every call's `timeout_s`),
the role it is logged as (scheduler, worker; a state namespace's link is a second one), and
vLLM's logger. The scheduler's thread and its lookup threads, the worker's load and save threads
share one link (it is thread-safe).
"""

from __future__ import annotations

import logging

from ...client.link import CacheLink
from ...config import Namespace
from .config import ConnectorSettings

# A child of vLLM's "vllm" logger, so messages go out through vLLM's handler, format and level.
LOGGER = "vllm.prefixcache"
log = logging.getLogger(LOGGER)


class ConnectorLink(CacheLink):
    def __init__(self, settings: ConnectorSettings, namespace: Namespace, role: str) -> None:
        super().__init__(
            settings.cache,
            namespace,
            same_host=settings.same_host,
            auth_token=settings.auth_token,
            timeout_s=settings.timeout_s,
            tls_root_cert_file=settings.tls_root_cert_file,
            name=f"prefixcache {role}",
            logger=log,
        )
        self.settings = settings
        self.role = role
