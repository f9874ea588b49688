"""One engine process's fail-open link to the cache service (the reference worker and the vLLM
connector both use it; an engine adds only what is its own: settings, metrics, its namespace).

`CacheLink` owns a `CacheClient` attached to one namespace and turns every service failure
into "no cache right now": `client()` and `call()` answer None and the caller prefills (or
skips its save) normally. `service_level` is the one classification of errors: a failure that
makes the service unusable (unreachable, too slow, overloaded, restarted and forgot the
namespace, a broken reply) drops the client; any other `InvalidArgument` (a bad token, an
expired lease) is about that one call, which the caller handles, and leaves the link up.

Invariants:
- A state change (up -> down, down -> up) is logged once; steady failures are not logged again.
- The first service-level failure of a working client re-attaches at once, on a fresh client,
  and `call` tries once more: a restarted service answers the second call, so a restart costs
  no request its hit or its save. After that, while down, an attach is tried at most once per
  backoff (1-2 s, jittered so a fleet of engines does not come back in lock step), so a dead
  service costs a request nothing but a clock read.
- Every attach uses a fresh client (gRPC channel): the old one may sit in gRPC's exponential
  reconnect backoff (up to minutes), failing every call fast after the service is back.
- Thread-safe: an engine's threads (request, lookup, load and save threads) share one link. A
  failure drops only the client the failing call used: a call that fails on a client another
  thread already replaced leaves the new one alone (else concurrent calls failing on a
  restarted service would drop each other's fresh clients). A dropped client is not closed
  under a thread still using it (a load copying from its mapped memory): it is released when
  its last caller is done; `close` (shutdown) closes the current one.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..breaker import Backoff
from ..config import KVLayout, Namespace
from ..errors import InvalidArgument, PrefixCacheError, UnknownNamespace
from ..threads import name_os_thread
from .api import Attachment, CacheClient, Hit, TokenInput

log = logging.getLogger(__name__)

# Re-attach backoff while the service is down: 1-2 s (a longer cap kept workers off a recovered
# service past the chaos soak's recovery window).
RETRY = Backoff(2.0, 2.0)
RELEASE_HOLD_S = 0.5  # a lease to hand back waits this long for a Lookup to carry it (`LeaseReturns`)
T = TypeVar("T")


def service_level(error: PrefixCacheError) -> bool:
    """True when the error means the service (not this one call) is unusable: drop the client."""
    return (
        not isinstance(error, InvalidArgument)
        or isinstance(error, UnknownNamespace)
        or error.field in ("namespace", "namespace_id")  # the service forgot us: it restarted
    )


class CacheLink:
    def __init__(
        self,
        address: str,
        namespace: Namespace,
        *,
        same_host: bool = True,
        auth_token: str | None = None,
        timeout_s: float = 5.0,
        attach_timeout_s: float | None = None,
        tls_root_cert_file: str | None = None,
        name: str = "cache link",
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """`namespace`: what to attach as (its model, revision, layout, kv_scale and salt; the
        service sets the tenant from the credential). `timeout_s`: every call's deadline (the
        client's); `attach_timeout_s`: Attach's (default `timeout_s`). `name` and `logger` are what
        its state changes are logged as and through."""
        self.address = address
        self.namespace = namespace
        self.same_host = same_host
        self.timeout_s, self.attach_timeout_s = timeout_s, attach_timeout_s
        self._auth_token, self._tls_root_cert_file = auth_token, tls_root_cert_file
        self.name, self._log = name, logger
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._client: CacheClient | None = None
        self._attachment: Attachment | None = None
        self._up: bool | None = None  # None: never tried
        self._next_try = 0.0

    @property
    def layout(self) -> KVLayout:
        return self.namespace.layout

    @property
    def up(self) -> bool | None:
        """True: attached; False: failed (re-attaching after a backoff); None: never tried yet."""
        return self._up

    @property
    def skipping(self) -> bool:
        """Down and inside its backoff: `client()` answers None without trying."""
        return self._client is None and self._clock() < self._next_try

    def client(self) -> tuple[CacheClient, Attachment] | None:
        """The attached client, attaching (again) when due; None while the service is unusable."""
        with self._lock:
            if self._client is not None and self._attachment is not None:
                return self._client, self._attachment
            if self._clock() < self._next_try:
                return None
            self._next_try = self._clock() + RETRY.delay(0, self._rng)
            client = CacheClient(
                self.address,
                auth_token=self._auth_token,
                timeout_s=self.timeout_s,
                tls_root_cert_file=self._tls_root_cert_file,
            )
            try:
                ns = self.namespace
                attachment = client.attach(
                    ns.model,
                    ns.layout,
                    ns.revision,
                    cache_salt=ns.cache_salt or None,
                    same_host=self.same_host,
                    timeout_s=self.attach_timeout_s,
                    kv_scale=ns.kv_scale,
                )
                if attachment.layout != self.layout:
                    raise PrefixCacheError(
                        f"service answered layout {attachment.layout}, the engine needs {self.layout}"
                    )
            except PrefixCacheError as error:
                client.close()
                self._set_state(False, error)
                return None
            self._client, self._attachment = client, attachment
            self._set_state(True, None)
            return client, attachment

    def attached(self) -> CacheClient | None:
        """The attached client, or None; never attaches (for a thread that must not wait)."""
        return self._client

    def held_tokens(self, tokens: TokenInput, salt: str | None = None) -> int | None:
        """Leading tokens of `tokens` the service's presence table shows held
        (`CacheClient.held_tokens`: shared memory, no call; never attaches). None while not
        attached, where the service publishes no table (Redis or a disk tier: a Lookup also finds
        blocks its index lacks) and for a salt the table cannot answer."""
        client = self._client
        return None if client is None else client.held_tokens(tokens, salt)

    def call(self, operation: Callable[[CacheClient, Attachment], T]) -> tuple[T, Attachment] | None:
        """`operation` on the attached client (None while unusable). An error that is not
        `service_level` is the caller's (raised, the link stays up). A service-level failure drops
        the client; on a working one, re-attach and try once more (see the module docstring); the
        second failure is raised."""
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

    def release(self, hit: Hit | None, client: CacheClient | None = None) -> None:
        """Release `hit`'s lease on `client` (default: the current one, if attached); a failure
        never raises (the service's lease timeout reclaims the lease)."""
        if hit is None or not hit.lease_id:
            return
        if client is None:
            attached = self.client()
            if attached is None:
                return
            client = attached[0]
        try:
            client.release(hit)
        except PrefixCacheError as error:
            if service_level(error):
                self.failed(error, client)

    def failed(self, error: BaseException, client: CacheClient | None = None) -> None:
        """A call on `client` (default: the current one) failed at the service level: drop it; the
        next `client()` re-attaches at once if it had worked, else after the backoff. A client
        already replaced is not the current one's business."""
        with self._lock:
            if client is not None and client is not self._client:
                return
            # Dropped, not closed: another thread may be mid-call on it (closing unmaps the shared
            # memory under its copy); it closes (channel, mappings) once the last caller lets go.
            self._client, self._attachment = None, None
            if isinstance(error, PrefixCacheError) and self._up:
                self._next_try = 0.0
            else:
                self._next_try = self._clock() + RETRY.delay(0, self._rng)
            self._set_state(False, error)

    def _set_state(self, up: bool, error: BaseException | None) -> None:
        if up == self._up:
            return
        self._up = up
        if up:
            a = self._attachment
            self._log.info(
                "%s up: attached to %s as namespace %s (%s)",
                self.name,
                self.address,
                a.namespace_id if a else "?",
                "shared memory" if a and a.shared_memory else "gRPC streams",
            )
        else:
            self._log.warning(
                "%s down: service %s unusable (%s); prefilling without the cache until it returns",
                self.name,
                self.address,
                error,
            )

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client, self._attachment = None, None


class LeaseReturns:
    """Leases an engine no longer needs, handed back with its next Lookup (`take`, then
    `CacheClient.lookup(release=...)`: one call fewer per lease) or, when no Lookup comes within
    `hold_s`, released on a thread of its own, so an idle engine pins nothing for long. Each lease
    goes back to the client it came from (a re-attached link's old leases are released on the old
    client, which fails harmlessly where the service forgot them). Thread-safe."""

    def __init__(self, link: CacheLink, hold_s: float | None = None, name: str = "prefixcache-returns") -> None:
        """`hold_s`: default `RELEASE_HOLD_S`."""
        self._link = link
        self._hold_s = RELEASE_HOLD_S if hold_s is None else hold_s
        self._waiting: list[tuple[float, CacheClient, Hit]] = []  # (due, client, hit), oldest first
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, hit: Hit, client: CacheClient) -> None:
        """Hand `hit`'s lease back to `client`'s service with the next Lookup, or by itself."""
        if not hit.lease_id:
            return
        with self._changed:
            if not self._closed:
                self._waiting.append((time.monotonic() + self._hold_s, client, hit))
                self._changed.notify()
                return
        self._link.release(hit, client)  # closed: no thread left to do it

    def take(self, client: CacheClient) -> list[Hit]:
        """The leases waiting to go back through `client`: the caller's Lookup carries them and, if
        that Lookup fails, the caller releases them (`release`)."""
        with self._changed:
            taken = [hit for _, owner, hit in self._waiting if owner is client]
            if taken:
                self._waiting = [entry for entry in self._waiting if entry[1] is not client]
            return taken

    def release(self, hits: list[Hit], client: CacheClient) -> None:
        """Release now, each by itself (never raises)."""
        for hit in hits:
            self._link.release(hit, client)

    def _run(self) -> None:
        name_os_thread("pfx-returns")
        while True:
            with self._changed:
                while not self._closed and (not self._waiting or self._waiting[0][0] > time.monotonic()):
                    self._changed.wait(self._waiting[0][0] - time.monotonic() if self._waiting else None)
                closed, now = self._closed, time.monotonic()
                due = [entry for entry in self._waiting if closed or entry[0] <= now]
                self._waiting = self._waiting[len(due) :]  # due first: the list is in order of due time
            for _, client, hit in due:
                self._link.release(hit, client)
            if closed:
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Release every waiting lease now and stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(timeout_s)
