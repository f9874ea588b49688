"""Bearer-token authentication: who is calling, and which tenant they act for.

Three modes, chosen at start-up:
- open (no token configured): every caller is the default tenant "" with admin
  rights; the service listens on 127.0.0.1 by default for that reason;
- one shared token (`--auth-token`, `--auth-token-file`, env
  PREFIXCACHE_AUTH_TOKEN): its holder is the default tenant "", admin;
- a credentials file (`--credentials FILE`) mapping tokens to tenants, one per line:

      # token (or sha256:<hex of the token>)   tenant    [admin] [local] [host=SIZE] [device=SIZE] [retention=DURATION]
      0b7a1c...e4                              acme      local host=256MiB
      sha256:9f86d08188...                     globex
      5c1f2d...77                              ops       admin

  `admin` may act on every tenant's blocks. `local` may use the same-host data plane: map the
  host tier's shared memory and the device pool (which hold every tenant's KV) and write slots
  through Reserve/Commit; other credentials move KV through Fetch/Store only (SECURITY.md).
  `host=`/`device=` override `--tenant-quota` for that tenant ("unlimited" lifts it);
  `retention=` overrides `--max-retention`, the longest retention hint its stores may give; every
  line of one tenant must give the same quota.

The tenant is always derived here, server-side, from the token; a request can
never name it. A client's `cache_salt` only subdivides its own tenant.

Invariants:
- Tokens are compared as SHA-256 digests with `hmac.compare_digest` against
  every credential, so the time taken depends neither on how much of a guessed
  token is right nor on which credential matched.
- Neither tokens nor their digests are ever logged or put into an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from prefixcache.config import QUOTA_KEYS, TenantQuota
from prefixcache.errors import ConfigError, PrefixCacheError

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
UNAUTHENTICATED_PATHS = ("/grpc.health.v1.Health/",)  # probes carry no token
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_LINE = "TOKEN TENANT [admin] [local] [host=SIZE] [device=SIZE] [retention=DURATION]"


class Unauthenticated(PrefixCacheError):
    """No bearer token, or one that matches no credential."""


class NotPermitted(PrefixCacheError):
    """The credential is valid but not allowed this call (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the tenant it acts for and what it may do beyond its own blocks."""

    tenant: str
    admin: bool
    quota: str = ""  # "host=SIZE,device=SIZE" from its credential line (validated), "" for none
    local: bool = False  # may map the shared pools and write slots (the same-host data plane)

    @property
    def same_host(self) -> bool:
        return self.local or self.admin


OPEN = Principal(tenant="", admin=True)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def parse_credentials(text: str, source: str = "credentials") -> dict[bytes, Principal]:
    """Token digest -> principal from the credentials file format (see module docstring)."""
    table: dict[bytes, Principal] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {number}"
        if len(fields) < 2:
            raise ConfigError("credentials", f"{where}: expected '{_LINE}'")
        token, tenant = fields[0], fields[1]
        if not _TENANT.match(tenant):
            raise ConfigError("credentials", f"{where}: tenant must be 1-128 characters of [A-Za-z0-9_.-]")
        admin, local, quota = _options(fields[2:], where)
        hashed = _SHA256.match(token)
        digest = bytes.fromhex(hashed.group(1)) if hashed else _digest(token)
        if digest in table:
            raise ConfigError("credentials", f"{where}: the same token appears twice")
        table[digest] = Principal(tenant, admin=admin, quota=quota, local=local)
    if not table:
        raise ConfigError("credentials", f"{source} holds no credentials")
    return table


def _options(fields: list[str], where: str) -> tuple[bool, bool, str]:
    """(admin, local, quota spec) from the fields after TOKEN TENANT; the spec is validated here."""
    flags = [field for field in fields if field in ("admin", "local")]
    quota = [field for field in fields if field not in flags]
    if len(set(flags)) != len(flags) or any(f.partition("=")[0].lower() not in QUOTA_KEYS for f in quota):
        raise ConfigError("credentials", f"{where}: expected '{_LINE}'")  # never echo a field: it may be a token
    spec = ",".join(quota)
    try:
        TenantQuota.parse(spec)
    except ConfigError as error:
        raise ConfigError("credentials", f"{where}: {error}") from None
    return "admin" in flags, "local" in flags, spec


def quota_overrides(principals: Iterable[Principal]) -> dict[str, str]:
    """Tenant -> quota spec of the credentials that give one; a tenant's lines must agree."""
    specs: dict[str, str] = {}
    for principal in principals:
        known = specs.setdefault(principal.tenant, principal.quota)
        if known != principal.quota:
            raise ConfigError("credentials", f"tenant {principal.tenant!r} has credentials with different quotas")
    return {tenant: spec for tenant, spec in specs.items() if spec}


def load_credentials(path: str) -> dict[bytes, Principal]:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("credentials file %s is readable by group or others; chmod 600 it", path)
    with open(path, encoding="utf-8") as handle:
        return parse_credentials(handle.read(), source=path)


class Authenticator:
    """Maps request metadata to a `Principal`; `None` table means the open mode."""

    def __init__(self, table: dict[bytes, Principal] | None) -> None:
        self._table = table

    @classmethod
    def open(cls) -> Authenticator:
        return cls(None)

    @classmethod
    def shared_token(cls, token: str) -> Authenticator:
        if not token or token != token.strip() or any(c.isspace() for c in token):
            raise ConfigError("auth_token", "must be non-empty and contain no whitespace")
        if len(token) < 16:
            log.warning("the auth token is shorter than 16 characters; use a long random token")
        return cls({_digest(token): OPEN})

    @property
    def enabled(self) -> bool:
        return self._table is not None

    @property
    def principals(self) -> tuple[Principal, ...]:
        """Every credential's principal (never the token digests)."""
        return tuple(self._table.values()) if self._table is not None else (OPEN,)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        if self._table is None:
            return OPEN
        presented = _bearer(metadata)
        if presented is None:
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer TOKEN')")
        digest = _digest(presented)
        principal = None
        for known, candidate in self._table.items():  # every entry, so timing ignores which matched
            if hmac.compare_digest(digest, known):
                principal = candidate
        if principal is None:
            raise Unauthenticated("invalid bearer token")
        return principal


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key != METADATA_KEY:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


def _deny(context: grpc.ServicerContext, message: str) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that answers UNAUTHENTICATED."""

    def unary(_request, context):
        _deny(context, message)

    def streaming(_request, context):
        _deny(context, message)
        yield  # pragma: no cover - abort raises first

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class AuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls without a valid bearer token before any handler runs (health is exempt)."""

    def __init__(self, authenticator: Authenticator, on_denied: Callable[[str], None] | None = None) -> None:
        self._auth = authenticator
        self._on_denied = on_denied

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNAUTHENTICATED_PATHS):
            return handler
        try:
            self._auth.authenticate(handler_call_details.invocation_metadata)
        except Unauthenticated as error:
            log.debug("%s UNAUTHENTICATED: %s", method, error)  # the message never holds the token
            if self._on_denied is not None:
                self._on_denied(method)
            return _denying_handler(handler, str(error))
        return handler
