"""The enum and value mappings between cache.proto and the library's types.

Shared by the client (prefixcache/client/) and the service (services/cache_server/), so both
ends agree by construction; it sits beside the generated code (prefixcache/rpc/) rather than
in either side's package. Not part of the core: it imports protobuf. Proto enums keep 0 for
"unspecified"; library enums are what the core uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .config import DType, KVLayout
from .errors import ConfigError, InvalidArgument
from .kinds import MissReason, TierKind
from .rpc import cache_pb2 as pb
from .stats import PER_TIER, STATS, TIER_STATS, StatsSnapshot, TierSnapshot

Chunk = bytes | memoryview  # a piece of a length-delimited field (1-d bytes: len() is its size)

TIERS = {TierKind.DEVICE: pb.TIER_DEVICE, TierKind.HOST: pb.TIER_HOST, TierKind.REDIS: pb.TIER_REDIS}
TIER_OF = {value: key for key, value in TIERS.items()}
TIER_TABLE = np.array([TIERS[kind] for kind in sorted(TierKind)], dtype=np.int32)  # TierKind -> enum
MISS_REASONS = {
    None: pb.MISS_REASON_UNSPECIFIED,
    MissReason.TOO_SHORT: pb.MISS_REASON_SHORTER_THAN_BLOCK,
    MissReason.NOT_CACHED: pb.MISS_REASON_NOT_CACHED,
    MissReason.EXPIRED: pb.MISS_REASON_EXPIRED,
    MissReason.VERIFICATION_FAILED: pb.MISS_REASON_VERIFICATION_FAILED,
}
MISS_REASON_OF = {value: key for key, value in MISS_REASONS.items()}


def dtype_of(value: int, field: str) -> DType:
    """The DType of a proto DType number: the proto numbers are `DType.code` (no table here)."""
    try:
        return DType.from_code(value)
    except ConfigError:
        names = ", ".join(pb.DType.Name(dtype.code) for dtype in DType)
        raise InvalidArgument(field, f"must be one of {names}, got {value}") from None


def layout_message(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        layers=layout.layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=cast("pb.DType", layout.dtype.code),
    )


def layout_of(message: pb.KVLayout) -> KVLayout:
    dtype = dtype_of(message.dtype, "layout.dtype")
    return KVLayout(message.layers, message.kv_heads, message.head_dim, message.block_size, dtype)


def tier_kinds(values: Iterable[int]) -> np.ndarray:
    """TierKind values (int8) of proto Tier enums; an unknown enum is an error."""
    table = np.full(max(TIER_OF) + 1, -1, dtype=np.int8)
    for enum_value, kind in TIER_OF.items():
        table[enum_value] = int(kind)
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= len(table) or (table[array] < 0).any()):
        raise InvalidArgument("tiers", "unknown tier in the service's reply")
    return table[array]


@dataclass(frozen=True)
class ServiceStats:
    """GetStats: `snapshot` and `layout` are None until the first Attach created the cache."""

    ready: bool
    layout: KVLayout | None
    snapshot: StatsSnapshot | None
    attach_refusals: dict[str, int] = dataclasses.field(default_factory=dict)  # refused Attach calls by field (admins)


def stats_of(message: pb.Stats) -> ServiceStats:
    """GetStats' answer as values; every field is read as `stats.STATS` spells it."""
    refusals = dict(message.attach_refusals)
    if not message.ready:
        return ServiceStats(False, None, None, refusals)
    values: dict[str, Any] = {}
    for stat in STATS:
        field = stat.proto_field
        if stat is PER_TIER:
            values[stat.name] = tuple(
                TierSnapshot(TIER_OF[t.tier], *(getattr(t, f.name) for f in TIER_STATS)) for t in message.tiers
            )
        elif len(stat.labels) == 2:
            values[stat.name] = {key: dict(inner.by_reason) for key, inner in getattr(message, field).items()}
        elif stat.labels:
            values[stat.name] = dict(getattr(message, field))
        elif stat.optional:
            values[stat.name] = getattr(message, field) if message.HasField(field) else None
        else:
            values[stat.name] = getattr(message, field)
    layout = layout_of(message.layout) if message.HasField("layout") else None
    return ServiceStats(True, layout, StatsSnapshot(**values), refusals)


def stats_message(snapshot: StatsSnapshot | None, layout: KVLayout | None) -> pb.Stats:
    """The GetStats answer of a snapshot (the inverse of `stats_of`)."""
    if snapshot is None:
        return pb.Stats(ready=False)
    message = pb.Stats(ready=True)
    for stat in STATS:
        field, value = stat.proto_field, getattr(snapshot, stat.name)
        if stat is PER_TIER:
            message.tiers.extend(
                pb.TierStats(tier=TIERS[t.kind], **{f.name: getattr(t, f.name) for f in TIER_STATS}) for t in value
            )
        elif len(stat.labels) == 2:
            for key, inner in value.items():
                getattr(message, field)[key].by_reason.update(inner)
        elif stat.labels:
            getattr(message, field).update(value)
        elif value is not None:
            setattr(message, field, value)
    if layout is not None:
        message.layout.CopyFrom(layout_message(layout))
    return message


@dataclass(frozen=True)
class NamespaceInfo:
    """One entry of ListNamespaces; `tenant` is "" unless an admin asked."""

    namespace_id: str
    model: str
    revision: str
    salted: bool
    tenant: str
    blocks: dict[TierKind, int]  # resident blocks per local tier (absent: none)
    kv_scale: str = ""  # the engine's KV quantization settings it was attached with
    block_bytes: int = 0  # its layout's block size (the service side; 0: not known here)
    engine_block_sizes: tuple[int, ...] = ()  # block sizes in tokens its engines attached with

    def resident_bytes(self, block_bytes: int) -> int:
        return sum(self.blocks.values()) * (self.block_bytes or block_bytes)


def namespaces_message(entries: list[NamespaceInfo], block_bytes: int) -> pb.ListNamespacesResponse:
    """`block_bytes`: the block size of entries that do not carry their own."""
    ordered = sorted(entries, key=lambda e: (e.tenant, e.model, e.revision, e.namespace_id))
    return pb.ListNamespacesResponse(
        namespaces=[
            pb.NamespaceInfo(
                namespace_id=e.namespace_id,
                model=e.model,
                revision=e.revision,
                salted=e.salted,
                tenant=e.tenant,
                kv_scale=e.kv_scale,
                engine_block_sizes=e.engine_block_sizes,
                tiers=[
                    pb.TierBlocks(tier=TIERS[kind], blocks=n, bytes=n * (e.block_bytes or block_bytes))
                    for kind, n in sorted(e.blocks.items())
                ],
            )
            for e in ordered
        ]
    )


def namespaces_of(message: pb.ListNamespacesResponse) -> list[NamespaceInfo]:
    return [
        NamespaceInfo(
            n.namespace_id,
            n.model,
            n.revision,
            n.salted,
            n.tenant,
            {TIER_OF[t.tier]: t.blocks for t in n.tiers if t.tier in TIER_OF},
            n.kv_scale,
            _block_bytes(n),
            tuple(n.engine_block_sizes),
        )
        for n in message.namespaces
    ]


@dataclass(frozen=True)
class RefusedAttach:
    """Attach calls refused alike (tenant, model, revision, field): how many, the last message, when."""

    model: str
    revision: str
    tenant: str  # "" unless an admin asked
    field: str
    reason: str
    count: int
    seconds_since_last: float


def refused_message(refused: RefusedAttach) -> pb.RefusedAttach:
    return pb.RefusedAttach(**dataclasses.asdict(refused))


def refused_of(message: pb.ListNamespacesResponse) -> list[RefusedAttach]:
    return [
        RefusedAttach(r.model, r.revision, r.tenant, r.field, r.reason, r.count, r.seconds_since_last)
        for r in message.refused
    ]


def _block_bytes(entry: pb.NamespaceInfo) -> int:
    """A namespace's block size from its tiers' figures (its own layout's; 0 when nothing is resident)."""
    return next((t.bytes // t.blocks for t in entry.tiers if t.blocks), 0)


# -- bulk messages without extra copies ------------------------------------------------
# FetchChunk and StoreRequest carry megabytes of KV. Going through protobuf objects
# costs two extra copies per side (into the message, then out of it as `bytes`), which
# halves stream bandwidth. These helpers write and read the same wire format directly:
# a message is its small fields, serialized by protobuf, followed by the length-delimited
# bytes field, so any generated client or grpcurl reads them as ordinary messages.
WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5
FETCH_DATA_FIELD = pb.FetchChunk.DESCRIPTOR.fields_by_name["data"].number
STORE_HEADER_FIELD = pb.StoreRequest.DESCRIPTOR.fields_by_name["header"].number
STORE_DATA_FIELD = pb.StoreRequest.DESCRIPTOR.fields_by_name["data"].number


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def bytes_field(number: int, parts: Sequence[Chunk]) -> list[Chunk]:
    """Wire pieces of one length-delimited field holding the concatenation of `parts`."""
    return [varint(number << 3 | WIRE_LEN), varint(sum(len(p) for p in parts)), *parts]


def _read_varint(raw: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    for offset in range(10):
        if position + offset >= len(raw):
            raise WireError("truncated varint")
        byte = raw[position + offset]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & (2**64 - 1), position + offset + 1
        shift += 7
    raise WireError("varint longer than 10 bytes")


def scan(raw: memoryview) -> Iterator[tuple[int, int, int | memoryview | None]]:
    """(field number, wire type, value) of each field: an int, or a memoryview for bytes fields."""
    position = 0
    while position < len(raw):
        key, position = _read_varint(raw, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        value: int | memoryview | None
        if wire_type == WIRE_VARINT:
            value, position = _read_varint(raw, position)
        elif wire_type == WIRE_LEN:
            length, position = _read_varint(raw, position)
            if position + length > len(raw):
                raise WireError("truncated bytes field")
            value, position = raw[position : position + length], position + length
        elif wire_type in (WIRE_I64, WIRE_I32):
            position += 8 if wire_type == WIRE_I64 else 4
            if position > len(raw):
                raise WireError("truncated fixed-width field")
            value = None
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        yield number, wire_type, value


@dataclass(frozen=True)
class FetchPiece:
    offset: int
    data: memoryview
    total_bytes: int
    block_count: int


def encode_fetch_chunk(offset: int, parts: Sequence[Chunk], total_bytes: int, block_count: int) -> bytes:
    """A serialized FetchChunk whose data is `parts` joined (the only copy of the bytes)."""
    head = pb.FetchChunk(offset=offset, total_bytes=total_bytes, block_count=block_count).SerializeToString()
    return b"".join([head, *bytes_field(FETCH_DATA_FIELD, parts)])


def decode_fetch_chunk(raw: bytes) -> FetchPiece:
    """Parse a serialized FetchChunk; `data` is a view of `raw` (no copy)."""
    fields = {"offset": 0, "total_bytes": 0, "block_count": 0}
    numbers = {pb.FetchChunk.DESCRIPTOR.fields_by_name[name].number: name for name in fields}
    data = memoryview(b"")
    for number, _wire_type, value in scan(memoryview(raw)):
        if number == FETCH_DATA_FIELD and isinstance(value, memoryview):
            data = value
        elif number in numbers and isinstance(value, int):
            fields[numbers[number]] = value
    return FetchPiece(fields["offset"], data, fields["total_bytes"], fields["block_count"])


def encode_store_data(parts: Sequence[Chunk]) -> bytes:
    """A serialized StoreRequest carrying `data` (the only copy of the bytes)."""
    return b"".join(bytes_field(STORE_DATA_FIELD, parts))


@dataclass(frozen=True)
class StorePart:
    """One parsed StoreRequest: the header, or a view of the data (the oneof's last field wins)."""

    header: pb.StoreHeader | None
    data: memoryview | None


def decode_store_request(raw: bytes) -> StorePart:
    part = StorePart(None, None)
    for number, wire_type, value in scan(memoryview(raw)):
        if wire_type != WIRE_LEN or not isinstance(value, memoryview):
            continue
        if number == STORE_HEADER_FIELD:
            part = StorePart(pb.StoreHeader.FromString(bytes(value)), None)
        elif number == STORE_DATA_FIELD:
            part = StorePart(None, value)
    return part
