"""One process's fail-open connection to the prefixcache service.

`CacheLink` owns a `CacheClient` attached to the connector's namespace and turns every
failure into "no cache right now": the caller gets None / False and prefills normally.

Invariants:
- A state change (up -> down, down -> up) is logged once; steady failures are not logged again.
- While down, reconnecting is tried at most once per `RETRY_S`, so a dead service costs a
  request nothing but a clock read; a restarted service (new shared-memory segment, namespace
  unknown) is re-attached on the next try.
- Thread-safe: the scheduler's thread and its lookup threads, the worker's load and save
  threads all share one link. A failure drops only the client the failing call used: a call
  that fails on a client another thread already replaced leaves the new one alone (else
  concurrent calls failing on a restarted service would close each other's fresh clients).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ...client.api import Attachment, CacheClient
from ...config import KVLayout
from ...errors import InvalidArgument, PrefixCacheError, UnknownNamespace
from .config import ConnectorSettings, VllmNamespace

# A child of vLLM's "vllm" logger, so messages go out through vLLM's handler, format and level.
LOGGER = "vllm.prefixcache"
log = logging.getLogger(LOGGER)

RETRY_S = 1.0
T = TypeVar("T")


def service_level(error: PrefixCacheError) -> bool:
    """True when the error means the service (not this one request) is unusable: re-attach."""
    return (
        not isinstance(error, InvalidArgument)
        or isinstance(error, UnknownNamespace)
        or error.field in ("namespace", "namespace_id")
    )  # the service forgot us: it restarted


class CacheLink:
    def __init__(self, settings: ConnectorSettings, namespace: VllmNamespace, role: str) -> None:
        self.settings = settings
        self.namespace = namespace
        self.role = role
        self._lock = threading.Lock()
        self._client: CacheClient | None = None
        self._attachment: Attachment | None = None
        self._up: bool | None = None  # None: never tried
        self._next_try = 0.0

    @property
    def layout(self) -> KVLayout:
        return self.namespace.layout

    def client(self) -> tuple[CacheClient, Attachment] | None:
        """The attached client, attaching (again) when due; None while the service is unusable."""
        with self._lock:
            if self._client is not None and self._attachment is not None:
                return self._client, self._attachment
            if time.monotonic() < self._next_try:
                return None
            self._next_try = time.monotonic() + RETRY_S
            s = self.settings
            client = CacheClient(
                s.cache, auth_token=s.auth_token, timeout_s=s.timeout_s, tls_root_cert_file=s.tls_root_cert_file
            )
            try:
                attachment = client.attach(
                    self.namespace.model,
                    self.namespace.layout,
                    self.namespace.revision,
                    same_host=s.same_host,
                    kv_scale=self.namespace.kv_scale,
                )
                if attachment.layout != self.namespace.layout:
                    raise PrefixCacheError(
                        f"service answered layout {attachment.layout}, vLLM needs {self.namespace.layout}"
                    )
            except PrefixCacheError as error:
                client.close()
                self._set_state(False, error)
                return None
            self._client, self._attachment = client, attachment
            self._set_state(True, None)
            return client, attachment

    def call(self, operation: Callable[[CacheClient, Attachment], T]) -> tuple[T, Attachment] | None:
        """`operation` on the attached client (None while unusable). When a working client fails
        at the service level, re-attach and try once more: a restarted service answers the
        second call, so a restart costs no request its hit or its save."""
        for attempt in (0, 1):
            attached = self.client()
            if attached is None:
                return None
            try:
                return operation(*attached), attached[1]
            except PrefixCacheError as error:
                if not service_level(error):
                    raise
                self.failed(error, attached[0])
                if attempt:
                    raise
        return None

    def failed(self, error: BaseException, client: CacheClient | None = None) -> None:
        """A call on `client` (default: the current one) failed: drop it; the next `client()`
        re-attaches when due. A client already replaced is not the current one's business."""
        with self._lock:
            if client is not None and client is not self._client:
                return
            if self._client is not None:
                self._client.close()
            self._client, self._attachment = None, None
            self._next_try = 0.0 if isinstance(error, PrefixCacheError) and self._up else time.monotonic() + RETRY_S
            self._set_state(False, error)

    def _set_state(self, up: bool, error: BaseException | None) -> None:
        if up == self._up:
            return
        self._up = up
        if up:
            a = self._attachment
            log.info(
                "prefixcache %s: attached to %s as namespace %s (%s)",
                self.role,
                self.settings.cache,
                a.namespace_id if a else "?",
                "shared memory" if a and a.shared_memory else "gRPC streams",
            )
        else:
            log.warning(
                "prefixcache %s: service %s unusable (%s); prefilling without the cache until it returns",
                self.role,
                self.settings.cache,
                error,
            )

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client, self._attachment = None, None
