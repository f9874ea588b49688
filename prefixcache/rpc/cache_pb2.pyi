# Generated from proto/prefixcache/v1/cache.proto by scripts/gen_proto.sh. DO NOT EDIT.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_REDIS: _ClassVar[Tier]

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_SHORTER_THAN_BLOCK: _ClassVar[MissReason]
    MISS_REASON_NOT_CACHED: _ClassVar[MissReason]
    MISS_REASON_EXPIRED: _ClassVar[MissReason]
    MISS_REASON_VERIFICATION_FAILED: _ClassVar[MissReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_REDIS: Tier
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_SHORTER_THAN_BLOCK: MissReason
MISS_REASON_NOT_CACHED: MissReason
MISS_REASON_EXPIRED: MissReason
MISS_REASON_VERIFICATION_FAILED: MissReason

class KVLayout(_message.Message):
    __slots__ = ("layers", "kv_heads", "head_dim", "block_size", "dtype")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: DType
    def __init__(self, layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model", "revision", "layout", "cache_salt", "same_host", "kv_scale")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    layout: KVLayout
    cache_salt: str
    same_host: bool
    kv_scale: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., cache_salt: _Optional[str] = ..., same_host: _Optional[bool] = ..., kv_scale: _Optional[str] = ...) -> None: ...

class SharedMemorySegment(_message.Message):
    __slots__ = ("name", "num_slots", "slot_bytes", "chunk_bytes", "slots_per_chunk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_slots: int
    slot_bytes: int
    chunk_bytes: int
    slots_per_chunk: int
    def __init__(self, name: _Optional[str] = ..., num_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., slots_per_chunk: _Optional[int] = ...) -> None: ...

class CudaIpcPool(_message.Message):
    __slots__ = ("device_index", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "num_slots", "chunk_bytes", "slots_per_chunk")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    num_slots: int
    chunk_bytes: int
    slots_per_chunk: int
    def __init__(self, device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., num_slots: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., slots_per_chunk: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("namespace_id", "layout", "host_segment", "device_pool", "lease_ttl_seconds", "max_prompt_tokens", "max_chunk_bytes", "control_socket", "presence")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    layout: KVLayout
    host_segment: SharedMemorySegment
    device_pool: CudaIpcPool
    lease_ttl_seconds: float
    max_prompt_tokens: int
    max_chunk_bytes: int
    control_socket: str
    presence: PresenceTable
    def __init__(self, namespace_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., host_segment: _Optional[_Union[SharedMemorySegment, _Mapping]] = ..., device_pool: _Optional[_Union[CudaIpcPool, _Mapping]] = ..., lease_ttl_seconds: _Optional[float] = ..., max_prompt_tokens: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., control_socket: _Optional[str] = ..., presence: _Optional[_Union[PresenceTable, _Mapping]] = ...) -> None: ...

class PresenceTable(_message.Message):
    __slots__ = ("name", "namespace_root", "hash_algorithm", "salt_head", "salt_tail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ROOT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SALT_HEAD_FIELD_NUMBER: _ClassVar[int]
    SALT_TAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace_root: bytes
    hash_algorithm: str
    salt_head: bytes
    salt_tail: bytes
    def __init__(self, name: _Optional[str] = ..., namespace_root: _Optional[bytes] = ..., hash_algorithm: _Optional[str] = ..., salt_head: _Optional[bytes] = ..., salt_tail: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "cache_salt", "take_lease", "recompute_seconds_per_token", "block_size", "release_lease_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TAKE_LEASE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    take_lease: bool
    recompute_seconds_per_token: float
    block_size: int
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., take_lease: _Optional[bool] = ..., recompute_seconds_per_token: _Optional[float] = ..., block_size: _Optional[int] = ..., release_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("namespace_id", "prompt_tokens", "hit_tokens", "tiers", "slots", "miss_reason", "lease_id", "lease_ttl_seconds", "remote_blocks_declined", "leases_released")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    slots: _containers.RepeatedScalarFieldContainer[int]
    miss_reason: MissReason
    lease_id: int
    lease_ttl_seconds: float
    remote_blocks_declined: int
    leases_released: int
    def __init__(self, namespace_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., slots: _Optional[_Iterable[int]] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., lease_id: _Optional[int] = ..., lease_ttl_seconds: _Optional[float] = ..., remote_blocks_declined: _Optional[int] = ..., leases_released: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("lease_id", "max_chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    max_chunk_bytes: int
    def __init__(self, lease_id: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("offset", "data", "total_bytes", "block_count")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_bytes: int
    block_count: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., block_count: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "block_count", "replaces")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_count: int
    replaces: int
    def __init__(self, namespace_id: _Optional[str] = ..., block_count: _Optional[int] = ..., replaces: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "tier", "slots", "ttl_seconds")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    tier: Tier
    slots: _containers.RepeatedScalarFieldContainer[int]
    ttl_seconds: float
    def __init__(self, reservation_id: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., slots: _Optional[_Iterable[int]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "cache_salt", "reservation_id", "start_block", "retention_seconds", "block_count", "reserve_next")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_NEXT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    reservation_id: int
    start_block: int
    retention_seconds: float
    block_count: int
    reserve_next: int
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., reservation_id: _Optional[int] = ..., start_block: _Optional[int] = ..., retention_seconds: _Optional[float] = ..., block_count: _Optional[int] = ..., reserve_next: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored", "deduplicated", "rejected", "retention_seconds", "retention_clamped", "next")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_CLAMPED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    stored: int
    deduplicated: int
    rejected: int
    retention_seconds: float
    retention_clamped: bool
    next: ReserveResponse
    def __init__(self, stored: _Optional[int] = ..., deduplicated: _Optional[int] = ..., rejected: _Optional[int] = ..., retention_seconds: _Optional[float] = ..., retention_clamped: _Optional[bool] = ..., next: _Optional[_Union[ReserveResponse, _Mapping]] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("namespace_id", "tokens", "cache_salt", "start_block", "block_count", "dtype", "block_shape", "retention_seconds")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    start_block: int
    block_count: int
    dtype: DType
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    retention_seconds: float
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., start_block: _Optional[int] = ..., block_count: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_shape: _Optional[_Iterable[int]] = ..., retention_seconds: _Optional[float] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "blocks", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace_id", "model", "revision", "salted", "tenant", "tiers", "kv_scale", "engine_block_sizes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SALTED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    model: str
    revision: str
    salted: bool
    tenant: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    kv_scale: str
    engine_block_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., salted: _Optional[bool] = ..., tenant: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., kv_scale: _Optional[str] = ..., engine_block_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class RefusedAttach(_message.Message):
    __slots__ = ("model", "revision", "tenant", "field", "reason", "count", "seconds_since_last")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_LAST_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    tenant: str
    field: str
    reason: str
    count: int
    seconds_since_last: float
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., tenant: _Optional[str] = ..., field: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ..., seconds_since_last: _Optional[float] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces", "refused")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    refused: _containers.RepeatedCompositeFieldContainer[RefusedAttach]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RefusedAttach, _Mapping]]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks", "bytes_used", "capacity_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    bytes_used: int
    capacity_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class ReasonCounts(_message.Message):
    __slots__ = ("by_reason",)
    class ByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BY_REASON_FIELD_NUMBER: _ClassVar[int]
    by_reason: _containers.ScalarMap[str, int]
    def __init__(self, by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("ready", "uptime_seconds", "lookups", "request_hits", "request_misses", "block_hits", "block_misses", "token_hits", "tokens_looked_up", "tokens_saved", "blocks_committed", "blocks_deduplicated", "active_leases", "tiers", "spills", "spills_dropped", "promotions", "evictions", "miss_reasons", "remote_up", "remote", "layout", "pins_displaced", "retention_clamped", "attach_refusals", "disk_up", "disk")
    class SpillsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PromotionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ReasonCounts
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ReasonCounts, _Mapping]] = ...) -> None: ...
    class MissReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RemoteEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AttachRefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DiskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    READY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HITS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_MISSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MISSES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HITS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASONS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_UP_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PINS_DISPLACED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_CLAMPED_FIELD_NUMBER: _ClassVar[int]
    ATTACH_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    DISK_UP_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    uptime_seconds: float
    lookups: int
    request_hits: int
    request_misses: int
    block_hits: int
    block_misses: int
    token_hits: int
    tokens_looked_up: int
    tokens_saved: int
    blocks_committed: int
    blocks_deduplicated: int
    active_leases: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    spills: _containers.ScalarMap[str, int]
    spills_dropped: int
    promotions: _containers.ScalarMap[str, int]
    evictions: _containers.MessageMap[str, ReasonCounts]
    miss_reasons: _containers.ScalarMap[str, int]
    remote_up: bool
    remote: _containers.ScalarMap[str, float]
    layout: KVLayout
    pins_displaced: int
    retention_clamped: int
    attach_refusals: _containers.ScalarMap[str, int]
    disk_up: bool
    disk: _containers.ScalarMap[str, float]
    def __init__(self, ready: _Optional[bool] = ..., uptime_seconds: _Optional[float] = ..., lookups: _Optional[int] = ..., request_hits: _Optional[int] = ..., request_misses: _Optional[int] = ..., block_hits: _Optional[int] = ..., block_misses: _Optional[int] = ..., token_hits: _Optional[int] = ..., tokens_looked_up: _Optional[int] = ..., tokens_saved: _Optional[int] = ..., blocks_committed: _Optional[int] = ..., blocks_deduplicated: _Optional[int] = ..., active_leases: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., spills: _Optional[_Mapping[str, int]] = ..., spills_dropped: _Optional[int] = ..., promotions: _Optional[_Mapping[str, int]] = ..., evictions: _Optional[_Mapping[str, ReasonCounts]] = ..., miss_reasons: _Optional[_Mapping[str, int]] = ..., remote_up: _Optional[bool] = ..., remote: _Optional[_Mapping[str, float]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., pins_displaced: _Optional[int] = ..., retention_clamped: _Optional[int] = ..., attach_refusals: _Optional[_Mapping[str, int]] = ..., disk_up: _Optional[bool] = ..., disk: _Optional[_Mapping[str, float]] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "cache_salt")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("block", "tier", "slot", "ttl_left_seconds", "last_access_age_seconds", "leased")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TTL_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    block: int
    tier: Tier
    slot: int
    ttl_left_seconds: float
    last_access_age_seconds: float
    leased: bool
    def __init__(self, block: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., slot: _Optional[int] = ..., ttl_left_seconds: _Optional[float] = ..., last_access_age_seconds: _Optional[float] = ..., leased: _Optional[bool] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("namespace_id", "prompt_tokens", "hit_tokens", "blocks", "miss_reason", "disk_blocks")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    miss_reason: MissReason
    disk_blocks: int
    def __init__(self, namespace_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class TokenPrefix(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace_id", "cache_salt", "older_than_seconds", "prefix")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OLDER_THAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    cache_salt: str
    older_than_seconds: float
    prefix: TokenPrefix
    def __init__(self, namespace_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., older_than_seconds: _Optional[float] = ..., prefix: _Optional[_Union[TokenPrefix, _Mapping]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("namespace_id", "tokens", "cache_salt")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, namespace_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("namespace_id", "prompt_tokens", "hit_tokens", "tiers", "remote_blocks", "miss_reason", "disk_blocks")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    remote_blocks: int
    miss_reason: MissReason
    disk_blocks: int
    def __init__(self, namespace_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., remote_blocks: _Optional[int] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace_id", "cache_salt", "prefix", "ttl_seconds", "priority")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    cache_salt: str
    prefix: TokenPrefix
    ttl_seconds: float
    priority: int
    def __init__(self, namespace_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prefix: _Optional[_Union[TokenPrefix, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class Pin(_message.Message):
    __slots__ = ("pin_id", "namespace_id", "pinned_tokens", "expires_in_seconds", "priority")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    namespace_id: str
    pinned_tokens: int
    expires_in_seconds: float
    priority: int
    def __init__(self, pin_id: _Optional[int] = ..., namespace_id: _Optional[str] = ..., pinned_tokens: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: Pin
    def __init__(self, pin: _Optional[_Union[Pin, _Mapping]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[Pin]
    def __init__(self, pins: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ...) -> None: ...
