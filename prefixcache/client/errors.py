"""gRPC status -> typed error, so a worker catches `PrefixCacheError` subclasses, never `grpc.RpcError`.

| status                          | raised                                  |
| ------------------------------- | --------------------------------------- |
| INVALID_ARGUMENT                | `InvalidArgument` (field from metadata) |
| NOT_FOUND                       | `UnknownLease`                          |
| FAILED_PRECONDITION             | `LayoutMismatch`                        |
| RESOURCE_EXHAUSTED              | `ResourceExhausted`                     |
| UNAVAILABLE, DEADLINE_EXCEEDED  | `CacheUnavailable` (fall back to prefill) |
| UNAUTHENTICATED                 | `Unauthenticated`                       |
| PERMISSION_DENIED               | `PermissionDenied`                      |
| anything else                   | `ServiceError` (carries the code)       |
"""

from __future__ import annotations

import grpc

from ..errors import InvalidArgument, LayoutMismatch, PrefixCacheError, ResourceExhausted, UnknownLease

FIELD_METADATA = "prefixcache-field"
RETRY_METADATA = "prefixcache-retry-after-ms"  # on an overload refusal: when to try again


class CacheUnavailable(PrefixCacheError):
    """The service is down, draining, unreachable or slower than the deadline."""


class Unauthenticated(PrefixCacheError):
    """The service wants a (different) bearer token."""


class PermissionDenied(PrefixCacheError):
    """The operation needs the admin credential."""


class ServiceError(PrefixCacheError):
    """Any other failure status (a bug on the service side: INTERNAL, UNKNOWN, ...)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


def _field(error: grpc.RpcError) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == FIELD_METADATA:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The service's retry hint of an overload refusal (RESOURCE_EXHAUSTED with trailer
    `prefixcache-retry-after-ms`), in seconds; None for any other error."""
    if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_METADATA:
            try:
                return min(5.0, max(0.0, int(value) / 1000))
            except ValueError:
                return None
    return None


def error_from_rpc(error: grpc.RpcError, address: str, lease_id: int | None = None) -> PrefixCacheError:
    return error_from_status(error.code(), error.details() or "", _field(error), address, lease_id)


def error_from_status(
    code: grpc.StatusCode, details: str, field: str | None, address: str, lease_id: int | None = None
) -> PrefixCacheError:
    """The typed error of a failure status, its details and the field it names (from gRPC's
    trailing metadata or the control socket's error frame)."""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field = field or "request"
        return InvalidArgument(field, details.removeprefix(f"{field}: "))
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownLease(lease_id or 0)
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return LayoutMismatch(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return CacheUnavailable(f"cache service {address}: {code.name}: {details}")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(details)
    return ServiceError(code, details)
