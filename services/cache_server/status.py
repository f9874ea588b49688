"""The service edge: typed errors -> gRPC status codes, and the wrappers every handler runs in.

Mapping (see cache.proto):
- `UnknownLease`                                -> NOT_FOUND (an expected race: it timed out)
- `InvalidArgument` and subclasses              -> INVALID_ARGUMENT, field named in the details
                                                   and in trailing metadata `prefixcache-field`,
                                                   spelled as in the request message (`renames`
                                                   maps the library's argument names to it)
- `LayoutMismatch`, `ServiceMisconfigured`      -> FAILED_PRECONDITION
- `ResourceExhausted`                           -> RESOURCE_EXHAUSTED, field as for INVALID_ARGUMENT
- `Draining`, `TierUnavailable`                 -> UNAVAILABLE
- `Unauthenticated` (normally caught earlier by the auth interceptor) -> UNAUTHENTICATED
- `NotPermitted` (a credential without the right for this call) -> PERMISSION_DENIED
- bytes that do not parse as the request type   -> INVALID_ARGUMENT (field `request`)
- anything else is a bug: logged with its traceback, answered INTERNAL (never
  UNKNOWN), and the server keeps serving.

At DEBUG every call is logged once when it ends: method, status code, duration and, for a
failure, the message the client gets. Those messages name fields and limits, never token
ids, prompt text, salts or credentials (tests/test_log_hygiene.py holds them to that).

`CallTracker` counts calls in flight so that a drain can wait for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from prefixcache.errors import (
    InvalidArgument,
    LayoutMismatch,
    PrefixCacheError,
    ResourceExhausted,
    TierUnavailable,
    UnknownLease,
)
from prefixcache.wire import WireError

from .auth import NotPermitted, Unauthenticated
from .backend import Draining, ServiceMisconfigured

log = logging.getLogger(__name__)

FIELD_METADATA = "prefixcache-field"
Observer = Callable[[str, grpc.StatusCode, float], None]

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownLease, grpc.StatusCode.NOT_FOUND),  # before its base class InvalidArgument
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (ServiceMisconfigured, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (TierUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (NotPermitted, grpc.StatusCode.PERMISSION_DENIED),
)


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    details: str
    field: str | None = None


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request whose bytes did not parse (so the handler can say so)."""

    type_name: str


def failure_of(error: PrefixCacheError) -> Failure:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return Failure(code, str(error), getattr(error, "field", None))
    return Failure(grpc.StatusCode.INTERNAL, f"unexpected {type(error).__name__}")


def parser(message_type, decode: Callable[[bytes], object] | None = None) -> Callable[[bytes], object]:
    """A request deserializer that never raises: junk becomes `Malformed`."""
    name = message_type.DESCRIPTOR.full_name
    decode = decode or message_type.FromString

    def parse(data: bytes):
        try:
            return decode(data)
        except (DecodeError, WireError):
            return Malformed(name)

    return parse


def check_parsed(request):
    if isinstance(request, Malformed):
        raise InvalidArgument("request", f"cannot be parsed as {request.type_name}")
    return request


class CallTracker:
    """Calls in flight; `wait_idle` returns when none are left or the deadline passes."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    def __enter__(self) -> CallTracker:
        with self._idle:
            self._count += 1
        return self

    def __exit__(self, *_exc) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    @property
    def in_flight(self) -> int:
        return self._count

    def wait_idle(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout=timeout_s)


def in_proto_terms(failure: Failure, renames: dict[str, str]) -> Failure:
    """The failure with its field named as the request message spells it."""
    field = failure.field
    if field is None or field not in renames:
        return failure
    details = failure.details
    if details.startswith(f"{field}:"):
        details = renames[field] + details[len(field) :]
    return Failure(failure.code, details, renames[field])


def _fail(context: grpc.ServicerContext, failure: Failure) -> None:
    if failure.field:
        context.set_trailing_metadata(((FIELD_METADATA, failure.field),))
    context.abort(failure.code, failure.details)


def _failure_from(error: BaseException, method: str) -> Failure:
    if isinstance(error, PrefixCacheError):
        return failure_of(error)
    if isinstance(error, grpc.RpcError):  # reading a request stream the client cancelled
        log.debug("%s: the client went away", method)
        return Failure(grpc.StatusCode.CANCELLED, "the call was cancelled")
    log.error("bug in %s: %s", method, type(error).__name__, exc_info=error)
    return Failure(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the service log")


def _done(observe: Observer, method: str, code: grpc.StatusCode, started: float, details: str = "") -> None:
    seconds = time.perf_counter() - started
    observe(method, code, seconds)
    log.debug("%s %s in %.3f ms%s%s", method, code.name, seconds * 1e3, ": " if details else "", details)


def unary(
    method: str, handler: Callable, tracker: CallTracker, observe: Observer, renames: dict[str, str] | None = None
) -> Callable:
    """Wrap a unary-response handler: map typed errors, count it in flight, time it."""
    renames = renames or {}

    def wrapped(request, context):
        started = time.perf_counter()
        with tracker:
            try:
                response = handler(request, context)
            except Exception as error:  # noqa: BLE001 - the edge: typed errors mapped, bugs logged
                failure = in_proto_terms(_failure_from(error, method), renames)
            else:
                _done(observe, method, grpc.StatusCode.OK, started)
                return response
        _done(observe, method, failure.code, started, failure.details)
        _fail(context, failure)

    return wrapped


def streaming(
    method: str, handler: Callable, tracker: CallTracker, observe: Observer, renames: dict[str, str] | None = None
) -> Callable:
    """Wrap a response-streaming handler (a generator) the same way."""
    renames = renames or {}

    def wrapped(request, context) -> Iterator:
        started = time.perf_counter()
        with tracker:
            try:
                yield from handler(request, context)
            except Exception as error:  # noqa: BLE001 - the edge, as in `unary`
                failure = in_proto_terms(_failure_from(error, method), renames)
            else:
                _done(observe, method, grpc.StatusCode.OK, started)
                return
        _done(observe, method, failure.code, started, failure.details)
        _fail(context, failure)

    return wrapped
