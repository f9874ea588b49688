"""Typed errors that cross layers.

Each error maps to one outcome at the service edge: `InvalidArgument` (and its
subclasses) becomes INVALID_ARGUMENT with a message naming the field,
`LayoutMismatch` FAILED_PRECONDITION, `ResourceExhausted` RESOURCE_EXHAUSTED,
`TierUnavailable` UNAVAILABLE. `CorruptBlock` never reaches a caller of the
cache: the cache turns it into a miss and counts it. A Redis outage does not
raise at all: the Redis tier's circuit breaker answers misses (`fetch`) and
drops writes (`submit` returns False), counted in its stats.
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidArgument(PrefixCacheError, ValueError):
    """Bad input; `field` names the offending argument."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigError(InvalidArgument):
    """A configuration value is out of range or malformed."""


class UnknownNamespace(InvalidArgument):
    # The message never repeats the id (SECURITY.md: errors name the field, never the value).
    def __init__(self, namespace_id: str) -> None:
        super().__init__("namespace_id", "unknown namespace id; call Attach first")
        self.namespace_id = namespace_id


class UnknownLease(InvalidArgument):
    def __init__(self, lease_id: int) -> None:
        super().__init__("lease_id", "the lease is unknown or has expired")
        self.lease_id = lease_id


class LayoutMismatch(PrefixCacheError):
    """A tensor's shape or dtype does not match the namespace's KV layout."""


class ResourceExhausted(PrefixCacheError):
    """A request is larger than a configured limit or quota; `field` names the argument, if one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TierUnavailable(PrefixCacheError):
    """A tier cannot serve at all; the service answers UNAVAILABLE. (Redis being down is not
    this error: the Redis tier turns an outage into misses, see the module docstring.)"""


class CorruptBlock(PrefixCacheError):
    """A stored block failed verification (checksum, key binding, framing)."""
