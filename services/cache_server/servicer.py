"""The gRPC servicer: validated messages in, library calls, messages out. Nothing else.

Every method authenticates the caller (the tenant comes from the token, see
auth.py), refuses new calls while draining, validates each field through
convert.py and calls the backend. Errors are typed and mapped to status
codes by status.py, which also wraps each method (timing, calls in flight).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from prefixcache import wire
from prefixcache.errors import InvalidArgument, PrefixCacheError, ResourceExhausted, UnknownLease
from prefixcache.kinds import TierKind
from prefixcache.leases import Lease
from prefixcache.rpc import cache_pb2 as pb

from . import convert, status
from .auth import OPEN, Authenticator, NotPermitted, Principal
from .backend import CacheBackend, Draining
from .pools import ByteBudget, StreamWatch, TenantShares, Watched
from .refusals import AttachRefusals

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefixCache"].full_name
MAX_CHUNK_BYTES = (4 << 20) - 1024  # a whole FetchChunk message stays <= 4 MiB
DEFAULT_CHUNK_BYTES = 1 << 20  # measured fastest through gRPC Python (benchmarks/service_bench.py)

# method -> (request type, response type)
UNARY_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Attach": (pb.AttachRequest, pb.AttachResponse),
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "Reserve": (pb.ReserveRequest, pb.ReserveResponse),
    "Commit": (pb.CommitRequest, pb.CommitResponse),
    "Release": (pb.ReleaseRequest, pb.ReleaseResponse),
    "GetStats": (pb.GetStatsRequest, pb.Stats),
    "Inspect": (pb.InspectRequest, pb.InspectResponse),
    "ListNamespaces": (pb.ListNamespacesRequest, pb.ListNamespacesResponse),
    "Evict": (pb.EvictRequest, pb.EvictResponse),
    "Flush": (pb.FlushRequest, pb.FlushResponse),
    "Match": (pb.MatchRequest, pb.MatchResponse),
    "Pin": (pb.PinRequest, pb.PinResponse),
    "Unpin": (pb.UnpinRequest, pb.UnpinResponse),
    "ListPins": (pb.ListPinsRequest, pb.ListPinsResponse),
}
METHODS = (*UNARY_METHODS, "Fetch", "Store")
REQUEST_TYPES = {
    **{name: request for name, (request, _) in UNARY_METHODS.items()},
    "Fetch": pb.FetchRequest,
    "Store": pb.StoreRequest,
}

# The library names its arguments as its Python API does (`count`, `older_than_s`); an error
# names the field as the method's request message spells it (tests/test_field_names.py).
PROTO_FIELDS: dict[str, dict[str, str]] = {
    "Attach": {"namespace": "model"},
    "Reserve": {"count": "block_count"},
    "Store": {
        "namespace_id": "header.namespace_id",
        "cache_salt": "header.cache_salt",
        "tokens": "header.tokens",
        "start_block": "header.start_block",
        "count": "header.block_count",
        "kv": "data",
        "retention_seconds": "header.retention_seconds",
    },
    "Evict": {"namespace": "namespace_id", "older_than_s": "older_than_seconds", "tokens": "prefix.tokens"},
    "Pin": {"namespace": "namespace_id", "ttl_s": "ttl_seconds", "tokens": "prefix.tokens"},
}


UnaryHandler = tuple[Callable, Callable[[bytes], object], Callable]  # wrapped handler, parser, serializer


@dataclass(frozen=True)
class Limits:
    block_size: int
    max_prompt_tokens: int
    max_chunk_bytes: int = MAX_CHUNK_BYTES  # largest data payload per Fetch/Store message
    default_chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Fetch chunk when the request names none


def byte_chunks(views: Iterable[memoryview], limit: int) -> Iterator[tuple[int, list[memoryview]]]:
    """(offset, pieces) of the concatenated `views`, each chunk at most `limit` bytes (no copy)."""
    pending: list[memoryview] = []
    size = offset = 0
    for view in views:
        position = 0
        while position < len(view):
            take = min(limit - size, len(view) - position)
            pending.append(view[position : position + take])
            size += take
            position += take
            if size == limit:
                yield offset, pending
                offset, pending, size = offset + size, [], 0
    if pending:
        yield offset, pending


class PrefixCacheServicer:
    def __init__(
        self,
        backend: CacheBackend,
        authenticator: Authenticator,
        limits: Limits,
        streams: StreamWatch,
        store_buffers: ByteBudget,
        shares: TenantShares | None = None,
        refusals: AttachRefusals | None = None,
    ) -> None:
        self._backend = backend
        self._auth = authenticator
        self._limits = limits
        self._streams = streams  # cancels a Fetch/Store whose peer stalls
        self._store_buffers = store_buffers  # what Store streams buffer at once
        self._shares = shares  # multi-tenant mode: each tenant's share of calls and stream threads
        self._refusals = refusals or AttachRefusals()
        self.control_socket = ""  # announced to same-host callers once it listens (CacheServer.start)

    def _begin(self, request, context: grpc.ServicerContext, kind: str | None = "calls") -> Principal:
        """The caller, once the request parsed and the service is open; counted in its tenant's
        share of `kind` ("calls", "streams"; None: never refused, e.g. Release)."""
        status.check_parsed(request)
        self._backend.check_open()
        if not self._auth.enabled:
            return OPEN
        principal = self._auth.authenticate(context.invocation_metadata())
        if self._shares is not None and kind is not None:
            self._shares.enter(kind, principal.tenant, context, functools.partial(_share_refusal, kind))
        return principal

    def _tokens(self, values, field: str = "tokens") -> np.ndarray:
        return convert.tokens(values, self._limits.max_prompt_tokens, field)

    def Attach(self, request: pb.AttachRequest, context) -> pb.AttachResponse:
        principal = self._begin(request, context)
        try:
            return self._attach(request, principal)
        except Draining:  # the service is going away: no fault of the engine's to show
            raise
        except PrefixCacheError as error:  # kept where the operator looks, not only in the engine's log
            field = getattr(error, "field", None) or "layout"
            reason = str(error).removeprefix(f"{field}: ")
            self._refusals.record(principal.tenant, request.model, request.revision, field, reason)
            raise

    def _attach(self, request: pb.AttachRequest, principal: Principal) -> pb.AttachResponse:
        model = convert.text(request.model, "model")
        revision = convert.text(request.revision, "revision", required=False)
        if not request.HasField("layout"):
            raise InvalidArgument("layout", "is required")
        layout, engine_block_size = convert.layout(request.layout, self._limits.block_size)
        kv_scale = convert.text(request.kv_scale, "kv_scale", required=False)
        ns_id = self._backend.attach(
            principal, model, revision, layout, convert.salt(request), kv_scale, engine_block_size
        )
        response = pb.AttachResponse(
            namespace_id=ns_id,
            layout=wire.layout_message(layout),
            lease_ttl_seconds=self._backend.options.cache.lease_ttl_s,
            max_prompt_tokens=self._limits.max_prompt_tokens,
            max_chunk_bytes=self._limits.max_chunk_bytes,
        )
        if request.same_host and principal.same_host:  # the pools hold every tenant's KV (SECURITY.md)
            host = self._backend.share_handle(TierKind.HOST, ns_id)
            assert host is not None  # the host tier is always a shared-memory segment
            response.host_segment.CopyFrom(
                pb.SharedMemorySegment(
                    name=host.segment,
                    num_slots=host.num_slots,
                    slot_bytes=host.slot_bytes,
                    chunk_bytes=host.chunk_bytes,
                    slots_per_chunk=host.slots_per_chunk,
                )
            )
            self._add_device_pool(response, ns_id)
            response.control_socket = self.control_socket
            self._add_presence(response, ns_id)
        return response

    def _add_presence(self, response: pb.AttachResponse, ns_id: str) -> None:
        presence = self._backend.presence_of(ns_id)
        if presence is not None:
            name, root, algorithm, (head, tail) = presence
            response.presence.CopyFrom(
                pb.PresenceTable(
                    name=name, namespace_root=root, hash_algorithm=algorithm, salt_head=head, salt_tail=tail
                )
            )

    def _add_device_pool(self, response: pb.AttachResponse, ns_id: str) -> None:
        shared = self._backend.share_handle(TierKind.DEVICE, ns_id)
        if shared is None or shared.cuda_ipc is None:
            return
        (device, handle, size, offset, ref_handle, ref_offset, event, sync), num_slots = (
            shared.cuda_ipc,
            shared.num_slots,
        )
        response.device_pool.CopyFrom(
            pb.CudaIpcPool(
                device_index=device,
                handle=handle,
                storage_size_bytes=size,
                storage_offset_bytes=offset,
                ref_counter_handle=ref_handle,
                ref_counter_offset=ref_offset,
                event_handle=event or b"",
                event_sync_required=sync,
                num_slots=num_slots,
                chunk_bytes=shared.chunk_bytes,
                slots_per_chunk=shared.slots_per_chunk,
            )
        )

    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        principal = self._begin(request, context)
        ns_id = convert.namespace_id(request.namespace_id)
        salt = convert.salt(request)
        released = self._release_all(principal, request.release_lease_ids)
        result = self._backend.lookup(
            principal,
            ns_id,
            salt,
            self._tokens(request.tokens),
            request.take_lease,
            convert.recompute_cost(request),
            request.block_size,
        )
        response = convert.lookup_response(result, self._backend.remaining_s(result.lease_expires_at))
        response.leases_released = released
        return response

    def _release_all(self, principal: Principal, lease_ids: Iterable[int]) -> int:
        """Release each lease (a Lookup's `release_lease_ids`); one already gone (expired, released,
        or another tenant's) is skipped. Returns how many were released."""
        ids = [convert.positive_id(lease_id, "release_lease_ids") for lease_id in lease_ids]
        released = 0
        for lease_id in ids:
            try:
                self._backend.release(principal, lease_id)
            except UnknownLease:
                continue
            released += 1
        return released

    def Fetch(self, request: pb.FetchRequest, context) -> Iterator[bytes]:
        with self._streams.watching(context) as watched:
            yield from self._fetch(request, context, watched)

    def _fetch(self, request: pb.FetchRequest, context, watched: Watched) -> Iterator[bytes]:
        principal = self._begin(request, context, "streams")
        lease_id = convert.positive_id(request.lease_id, "lease_id")
        limit = convert.chunk_bytes(
            request.max_chunk_bytes, self._limits.default_chunk_bytes, self._limits.max_chunk_bytes
        )
        lease = self._backend.lease(principal, lease_id)
        count = len(lease.locations)
        total = count * self._backend.layout_of(lease.namespace_id).block_bytes
        views = (self._backend.block_bytes(lease.namespace_id, location) for location in lease.locations)
        chunks = byte_chunks(views, limit)
        while True:
            # The views point into the host tier's mapping: every step that touches them runs
            # inside the backend's fence, which the shutdown closes before it unmaps the tier.
            with self._backend.reading():
                step = next(chunks, None)
                if step is None:
                    return
                message = wire.encode_fetch_chunk(step[0], step[1], total, count)  # the one copy of the bytes
            # Checked after the copy: if the lease is still live, the slots were pinned while
            # they were read, so these bytes are the leased blocks and nothing else.
            self._backend.lease(principal, lease_id)
            yield message
            watched.moved()  # gRPC asks for the next one once this one is sent

    @staticmethod
    def _require_same_host(principal: Principal, method: str) -> None:
        # Reserved slots are written through the mapped pool; a caller that cannot map it must
        # not commit whatever bytes a freed slot still holds (another tenant's old KV).
        if not principal.same_host:
            raise NotPermitted(
                f"{method} is the same-host data plane, which this credential may not use "
                "(mark it 'local' in the credentials file); send KV with Store"
            )

    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        principal = self._begin(request, context)
        self._require_same_host(principal, "Reserve")
        ns_id = convert.namespace_id(request.namespace_id)
        if request.block_count == 0:
            raise InvalidArgument("block_count", "must be at least 1")
        return self._reserve(principal, ns_id, request.block_count, replaces=request.replaces or None)

    def _reserve(
        self, principal: Principal, ns_id: str, count: int, spare: bool = False, replaces: int | None = None
    ) -> pb.ReserveResponse:
        reservation = self._backend.reserve(principal, ns_id, count, spare, replaces)
        return pb.ReserveResponse(
            reservation_id=reservation.id,
            tier=wire.TIERS[reservation.tier],
            slots=reservation.slots,
            ttl_seconds=self._backend.remaining_s(reservation.expires_at),
        )

    def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        principal = self._begin(request, context)
        self._require_same_host(principal, "Commit")
        ns_id = convert.namespace_id(request.namespace_id)
        salt = convert.salt(request)
        reservation_id = convert.positive_id(request.reservation_id, "reservation_id")
        result = self._backend.commit(
            principal,
            ns_id,
            salt,
            self._tokens(request.tokens),
            reservation_id,
            request.start_block,
            request.retention_seconds if request.HasField("retention_seconds") else None,
            request.block_count or None,
        )
        response = convert.commit_response(result)
        if request.reserve_next:
            try:  # the commit stands whatever happens here: no spare reservation is no error
                response.next.CopyFrom(self._reserve(principal, ns_id, request.reserve_next, spare=True))
            except ResourceExhausted:
                pass
        return response

    def Store(self, requests: Iterator[wire.StorePart], context) -> pb.CommitResponse:
        with self._streams.watching(context) as watched:
            return self._store(requests, context, watched)

    def _store(self, requests: Iterator[wire.StorePart], context, watched: Watched) -> pb.CommitResponse:
        first = next(requests, None)
        watched.moved()
        if first is None:
            raise InvalidArgument("header", "the stream is empty; the first message must carry the header")
        principal = self._begin(first, context, "streams")
        if first.header is None:
            raise InvalidArgument("header", "the first message must carry the header")
        header = first.header
        ns_id = convert.namespace_id(header.namespace_id, "header.namespace_id")
        salt = convert.salt(header)
        tokens = self._tokens(header.tokens, "header.tokens")
        resolved = self._backend.resolve(principal, ns_id, salt)  # an unknown one fails before any bytes are read
        assert resolved is not None  # created when missing
        layout = self._backend.layout_of(resolved)
        convert.store_header(header, layout)
        total = header.block_count * layout.block_bytes
        capacity = self._backend.options.cache.host_capacity
        if total > capacity:
            raise ResourceExhausted(
                f"header.block_count: {header.block_count} blocks ({total} bytes) exceed "
                f"the host tier's {capacity} bytes",
                "header.block_count",
            )
        with self._store_buffers.holding(total, _store_refusal):
            buffer = torch.empty(total, dtype=torch.uint8)
            received = _receive(requests, buffer.numpy(), watched)
            if received != total:
                raise InvalidArgument("data", f"{received} bytes received; header.block_count announced {total}")
            kv = buffer.view(layout.dtype.torch).view(header.block_count, *layout.block_shape)
            retention_s = header.retention_seconds if header.HasField("retention_seconds") else None
            result = self._backend.store(principal, ns_id, salt, tokens, kv, header.start_block, retention_s)
            return convert.commit_response(result)

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        principal = self._begin(request, context, None)  # frees what a lease pins: never refused
        self._backend.release(principal, convert.positive_id(request.lease_id, "lease_id"))
        return pb.ReleaseResponse()

    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.Stats:
        principal = self._begin(request, context)
        cache = self._backend.cache
        message = wire.stats_message(self._backend.stats_for(principal), cache.layout if cache is not None else None)
        if principal.admin:  # counts of every tenant's refusals
            message.attach_refusals.update(self._refusals.by_field())
        return message

    def Inspect(self, request: pb.InspectRequest, context) -> pb.InspectResponse:
        principal = self._begin(request, context)
        ns_id = convert.namespace_id(request.namespace_id)
        salt = convert.salt(request)
        resolved, report = self._backend.inspect(principal, ns_id, salt, self._tokens(request.tokens))
        return convert.inspect_response(resolved, report)

    def Match(self, request: pb.MatchRequest, context) -> pb.MatchResponse:
        principal = self._begin(request, context)
        ns_id = convert.namespace_id(request.namespace_id)
        result, block_bytes = self._backend.match(principal, ns_id, convert.salt(request), self._tokens(request.tokens))
        return convert.match_response(result, block_bytes)

    def ListNamespaces(self, request: pb.ListNamespacesRequest, context) -> pb.ListNamespacesResponse:
        principal = self._begin(request, context)
        cache = self._backend.cache
        message = wire.namespaces_message(
            self._backend.namespaces(principal), cache.layout.block_bytes if cache is not None else 0
        )
        seen_by = None if principal.admin else principal.tenant
        message.refused.extend(wire.refused_message(r) for r in self._refusals.recent(seen_by))
        return message

    def Evict(self, request: pb.EvictRequest, context) -> pb.EvictResponse:
        principal = self._begin(request, context)
        ns_id = convert.optional_namespace_id(request.namespace_id)
        prefix = self._tokens(request.prefix.tokens, "prefix.tokens") if request.HasField("prefix") else None
        evicted = self._backend.evict(principal, ns_id, convert.salt(request), convert.older_than(request), prefix)
        return pb.EvictResponse(evicted=evicted)

    def Flush(self, request: pb.FlushRequest, context) -> pb.FlushResponse:
        principal = self._begin(request, context)
        return pb.FlushResponse(evicted=self._backend.flush(principal))

    def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        principal = self._begin(request, context)
        ns_id = convert.namespace_id(request.namespace_id)
        tokens = self._tokens(request.prefix.tokens, "prefix.tokens")
        ttl_s = request.ttl_seconds if request.HasField("ttl_seconds") else None
        priority = request.priority if request.HasField("priority") else 0
        pin = self._backend.pin(principal, ns_id, convert.salt(request), tokens, ttl_s, priority)
        cache = self._backend.cache
        assert cache is not None  # a pin exists, so the cache does
        return pb.PinResponse(pin=self._pin_message(cache.namespaces.by_row(pin.namespace).id, pin))

    def Unpin(self, request: pb.UnpinRequest, context) -> pb.UnpinResponse:
        principal = self._begin(request, context)
        self._backend.unpin(principal, convert.positive_id(request.pin_id, "pin_id"))
        return pb.UnpinResponse()

    def ListPins(self, request: pb.ListPinsRequest, context) -> pb.ListPinsResponse:
        principal = self._begin(request, context)
        return pb.ListPinsResponse(pins=[self._pin_message(ns_id, pin) for ns_id, pin in self._backend.pins(principal)])

    def _pin_message(self, ns_id: str, pin: Lease) -> pb.Pin:
        """A pin as the wire names it (its namespace: the salted one for a salted pin; a pin of the
        last run waiting for its namespace holds 0 tokens)."""
        cache = self._backend.cache
        assert cache is not None  # a pin exists, so the cache does
        message = pb.Pin(
            pin_id=pin.id,
            namespace_id=ns_id,
            pinned_tokens=len(pin.nodes) * cache.layout.block_size,
            priority=pin.priority,
        )
        if pin.expires_at != float("inf"):
            message.expires_in_seconds = self._backend.remaining_s(pin.expires_at)
        return message


def _share_refusal(kind: str, share: int) -> ResourceExhausted:
    what = "stream threads (--stream-workers)" if kind == "streams" else "calls (--max-concurrent-rpcs)"
    return ResourceExhausted(f"this tenant already holds its share of {what}: {share} (--tenant-share); retry shortly")


def _store_refusal(used: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"header.block_count: Store streams buffer {used} of {limit} bytes now (--max-store-buffer); "
        "retry shortly, or store fewer blocks per stream",
        "header.block_count",
    )


def _receive(requests: Iterator[wire.StorePart], out: np.ndarray, watched: Watched) -> int:
    """Copy the `data` messages into `out`; returns the bytes received."""
    offset = 0
    for part in requests:
        watched.moved()
        status.check_parsed(part)
        if part.header is not None:
            raise InvalidArgument("header", "only the first message may carry a header")
        if part.data is None:
            raise InvalidArgument("data", "a message after the header carries no data")
        end = offset + len(part.data)
        if end > len(out):
            raise InvalidArgument("data", f"more bytes than header.block_count announced ({len(out)})")
        out[offset:end] = np.frombuffer(part.data, dtype=np.uint8)
        offset = end
    return offset


def unary_handlers(
    servicer: PrefixCacheServicer, tracker: status.CallTracker, observe: status.Observer
) -> dict[str, UnaryHandler]:
    """name -> (the wrapped handler, its request parser, its response serializer): what gRPC and
    the control socket (control_socket.py) both run."""
    return {
        name: (
            status.unary(name, getattr(servicer, name), tracker, observe, PROTO_FIELDS.get(name)),
            status.parser(request),
            response.SerializeToString,
        )
        for name, (request, response) in UNARY_METHODS.items()
    }


def register(
    server: grpc.Server, servicer: PrefixCacheServicer, tracker: status.CallTracker, observe: status.Observer
) -> None:
    """Add the service's handlers, with parsers that turn junk into INVALID_ARGUMENT."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(handler, request_deserializer=parse, response_serializer=serialize)
        for name, (handler, parse, serialize) in unary_handlers(servicer, tracker, observe).items()
    }
    handlers["Fetch"] = grpc.unary_stream_rpc_method_handler(  # yields serialized FetchChunks (wire.py)
        status.streaming("Fetch", servicer.Fetch, tracker, observe, PROTO_FIELDS.get("Fetch")),
        request_deserializer=status.parser(pb.FetchRequest),
        response_serializer=None,
    )
    handlers["Store"] = grpc.stream_unary_rpc_method_handler(
        status.unary("Store", servicer.Store, tracker, observe, PROTO_FIELDS["Store"]),
        request_deserializer=status.parser(pb.StoreRequest, wire.decode_store_request),
        response_serializer=pb.CommitResponse.SerializeToString,
    )
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
