"""`CacheClient`: what an inference worker calls to use the prefix-cache service.

    client = CacheClient("127.0.0.1:50051", auth_token=token, timeout_s=0.2)
    client.attach("my-model", layout, revision="abc123")     # once; maps shared memory if co-located
    hit = client.lookup(tokens, take_lease=True)
    try:
        kv = client.read(hit)                                  # [hit blocks, *layout.block_shape]
    finally:
        client.release(hit)
    client.store(tokens, new_kv, start_block=hit.hit_tokens // layout.block_size)

The data plane is chosen at attach: a co-located worker maps the host tier's
shared memory (and on CUDA the device pool by IPC) and reads or writes slots
directly, gRPC carrying only slot numbers; otherwise KV travels in bounded
chunks over the Fetch and Store streams.

Invariants:
- Bytes read from shared memory are returned only if the lease was still
  live when the copy finished, judged by a local deadline measured from the
  moment the Lookup was sent (never later than the service's own expiry).
- The client sends back only ids the service issued (namespace, lease,
  reservation) and never a hash or a slot it chose.
- Every failure is a `PrefixCacheError` subclass (see client/errors.py);
  `CacheUnavailable` means "prefill without the cache".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .. import wire
from ..config import HashAlgorithm, KVLayout
from ..errors import ConfigError, InvalidArgument, UnknownLease
from ..hashing import Hasher
from ..kinds import MissReason
from ..presence import PresenceView
from ..results import BlockLocations, CommitResult
from ..retention import check_priority, check_retention
from ..rpc import cache_pb2 as pb
from ..rpc import cache_pb2_grpc as pb_grpc
from .control_socket import ControlSocket
from .dataplane import LocalPools, map_device_pool, map_host_segment
from .errors import error_from_rpc, retry_after_s

TokenInput = Sequence[int] | np.ndarray | torch.Tensor  # token ids, as callers hold them

log = logging.getLogger(__name__)

SERVICE_NAME = "prefixcache.v1.PrefixCache"
_RESPONSES = {
    "Lookup": pb.LookupResponse,
    "Reserve": pb.ReserveResponse,
    "Commit": pb.CommitResponse,
    "Release": pb.ReleaseResponse,
}  # the control socket's methods (control_frames.METHODS)
LEASE_MARGIN_S = 0.05  # read from shared memory only this long before the lease ends
RELEASE_ATTEMPTS = 5  # Release refused for load (older services) is retried after the hint
MIN_STREAM_BYTES_PER_S = 100e6  # a Fetch/Store deadline grows with its size at this rate
STORE_CHUNK_BYTES = 1 << 20  # data per Store message (the service may allow up to 4 MiB)
RECENT_STORES = 8  # the spare reservation a Commit asks for fits the largest of this many stores


@dataclass(frozen=True)
class Attachment:
    namespace_id: str
    layout: KVLayout  # the engine's blocks, as attached: what `read` returns and `store` takes
    lease_ttl_s: float
    max_prompt_tokens: int
    max_chunk_bytes: int
    shared_memory: bool  # the host tier is mapped into this process
    device_ipc: bool  # the device pool is mapped by CUDA IPC
    host_segment: str = ""  # the mapped host tier's shm name: changes when the service restarts
    stored_layout: KVLayout | None = None  # the service's blocks (None: the same as `layout`)

    @property
    def split(self) -> int:
        """Service blocks per engine block (the service's block size divides the engine's)."""
        return 1 if self.stored_layout is None else self.layout.block_size // self.stored_layout.block_size


@dataclass(frozen=True)
class Hit:
    """A lookup's answer: the first `hit_tokens` tokens' KV is at `locations`.

    The one type a worker keeps from the Lookup to the prefill: its hit policy decides on it,
    `read` copies from it and `release` drops its lease (it pickles, for vLLM's scheduler to
    hand it to its workers).
    """

    namespace_id: str
    prompt_tokens: int
    hit_tokens: int  # blocks x block_size
    locations: BlockLocations
    miss_reason: MissReason | None
    lease_id: int | None
    lease_deadline: float | None  # time.monotonic() before which the lease is surely live
    remote_blocks_declined: int = 0  # past the hit, not fetched from Redis: slower than recomputing
    mapped_blocks: int = 0  # leading blocks the looking-up client copies from mapped memory (no stream)
    split: int = 1  # service blocks per block (`locations` has one entry per service block)

    @property
    def blocks(self) -> int:
        """Whole blocks of the engine that looked it up."""
        return len(self.locations) // self.split

    @property
    def usable_blocks(self) -> int:
        """Blocks an engine may load: it computes at least the last prompt token (for its logits)."""
        if not self.blocks:
            return 0
        return min(self.blocks, (self.prompt_tokens - 1) // (self.hit_tokens // self.blocks))


@dataclass(frozen=True)
class Reservation:
    """Host-tier slots reserved for one store, in this client's mapping (`reserve_mapped`): the
    caller writes block i into `slots[i]` (`reserved_pieces`), then `commit_reserved` publishes
    them. One unused lapses on the service at its TTL."""

    reservation_id: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class BlockInfo:
    block: int
    tier: str
    slot: int
    ttl_left_s: float
    last_access_age_s: float
    leased: bool


@dataclass(frozen=True)
class PinInfo:
    """An operator pin (Pin, ListPins): `expires_in_s` None means until unpinned."""

    pin_id: int
    namespace_id: str
    pinned_tokens: int
    expires_in_s: float | None
    priority: int = 0  # 0..100: a pin needing room releases the tenant's lower ones first

    @classmethod
    def of(cls, message: pb.Pin) -> PinInfo:
        expires = message.expires_in_seconds if message.HasField("expires_in_seconds") else None
        return cls(message.pin_id, message.namespace_id, message.pinned_tokens, expires, message.priority)


@dataclass(frozen=True)
class InspectReport:
    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    blocks: tuple[BlockInfo, ...]
    miss_reason: MissReason | None
    disk_blocks: int = 0  # past the cached prefix, held by the service's disk tier in a row


@dataclass(frozen=True)
class MatchReport:
    """Match's answer: the longest cached prefix's blocks per local tier (labels), how many
    leading blocks the service believes Redis still holds, and how many past the local hit its
    disk tier holds in a row. Takes no lease, changes nothing."""

    namespace_id: str
    prompt_tokens: int
    hit_tokens: int
    blocks: dict[str, int]
    remote_blocks: int
    miss_reason: MissReason | None
    disk_blocks: int = 0


def _leading_in(tiers: np.ndarray, mapped: Iterable[int]) -> int:
    """How many leading blocks lie in the `mapped` tiers (at most two: compares, no np.isin)."""
    inside = np.zeros(len(tiers), dtype=bool)
    for kind in mapped:
        inside |= tiers == kind
    return len(tiers) if inside.all() else int(np.argmin(inside))


def _split_blocks(kv: torch.Tensor, k: int) -> torch.Tensor:
    """Engine blocks `[n, L, 2, H, k*b, D]` as the service's `[n*k, L, 2, H, b, D]` (a copy)."""
    n, layers, two, heads, tokens, dim = kv.shape
    parts = kv.reshape(n, layers, two, heads, k, tokens // k, dim).permute(0, 4, 1, 2, 3, 5, 6)
    return parts.reshape(n * k, layers, two, heads, tokens // k, dim)


def _join_blocks(stored: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """The service's blocks `[n*k, L, 2, H, b, D]` into engine blocks `out` `[n, L, 2, H, k*b, D]`."""
    count, layers, two, heads, tokens, dim = stored.shape
    view = out.view(count // k, layers, two, heads, k, tokens, dim)
    view.copy_(stored.reshape(count // k, k, layers, two, heads, tokens, dim).permute(0, 2, 3, 4, 1, 5, 6))
    return out


def _block_range(hit: Hit, blocks: slice | None) -> tuple[int, int]:
    """(start, stop) of a read's range of the hit's blocks (all of them when None)."""
    start, stop, step = (blocks or slice(None)).indices(hit.blocks)
    if step != 1:
        raise InvalidArgument("blocks", f"must be a contiguous range, got step {step}")
    return start, stop


def _token_list(tokens: TokenInput) -> list[int]:
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        return list(tokens.reshape(-1).tolist())
    return list(tokens)


class CacheClient:
    """One channel to the service; after `attach`, bound to one namespace. Thread-safe."""

    def __init__(
        self,
        address: str,
        auth_token: str | None = None,
        timeout_s: float = 5.0,
        tls: bool = False,
        tls_root_cert_file: str | None = None,
        control_socket: bool = True,
    ) -> None:
        """`control_socket` False: every call goes over gRPC, also where the service announces its
        same-host control socket (client/control_socket.py)."""
        self.address = address
        self._auth_token = auth_token
        self._use_control = control_socket
        self._control: ControlSocket | None = None
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 30000),
            ("grpc.keepalive_timeout_ms", 10000),
            # Its own connections: a new client to a restarted service must not inherit the
            # reconnect backoff of an older client's connection to the dead one.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls or tls_root_cert_file:
            root = Path(tls_root_cert_file).read_bytes() if tls_root_cert_file else None
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.PrefixCacheStub(self._channel)
        # The bulk calls skip protobuf objects for their payload (see prefixcache/wire.py): one copy per side.
        self._fetch_call = self._channel.unary_stream(f"/{SERVICE_NAME}/Fetch", pb.FetchRequest.SerializeToString, None)
        self._store_call = self._channel.stream_unary(f"/{SERVICE_NAME}/Store", None, pb.CommitResponse.FromString)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._attachment: Attachment | None = None
        self._pools = LocalPools(None, None)
        self._presence: PresenceView | None = None  # the service's indexed blocks (prefixcache/presence.py)
        # A reservation the last Commit asked for (`reserve_next`), for the next same-host store:
        # one call per store instead of Reserve + Commit. (reservation, monotonic time to stop using it)
        self._spare: tuple[pb.ReserveResponse, float] | None = None
        self._spare_lock = threading.Lock()
        self._recent_stores: deque[int] = deque(maxlen=RECENT_STORES)  # their sizes, for the next spare's

    # -- plumbing ---------------------------------------------------------------
    def _call(
        self, method: Callable[..., Any], request: object, timeout_s: float | None = None, lease_id: int | None = None
    ) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.address, lease_id) from None

    def _unary(self, method: str, request: Any, timeout_s: float | None = None, lease_id: int | None = None) -> Any:
        """A per-request call: over the control socket where the service announced one, else gRPC."""
        control = self._control
        if control is not None:
            reply = control.call(method, request, _RESPONSES[method], timeout_s or self.timeout_s, lease_id)
            if reply is not None:
                return reply
        return self._call(getattr(self._stub, method), request, timeout_s, lease_id)

    @property
    def attachment(self) -> Attachment:
        if self._attachment is None:
            raise InvalidArgument("namespace", "call attach() first")
        return self._attachment

    def _stream_timeout(self, nbytes: int, timeout_s: float | None) -> float:
        return (timeout_s or self.timeout_s) + nbytes / MIN_STREAM_BYTES_PER_S

    # -- namespace ----------------------------------------------------------------
    def attach(
        self,
        model: str,
        layout: KVLayout,
        revision: str = "",
        cache_salt: str | None = None,
        same_host: bool = True,
        timeout_s: float | None = None,
        kv_scale: str = "",
    ) -> Attachment:
        """Register this worker's namespace; maps shared memory (and CUDA IPC) when co-located.

        `layout.dtype` is the KV format blocks are stored in (e.g. DType.FLOAT8_E4M3FN for an
        fp8 cache, stored bit for bit); `kv_scale` names the engine's quantization settings
        (its k/v scales): namespaces differing in either never share a block.
        """
        request = pb.AttachRequest(
            model=model, revision=revision, layout=wire.layout_message(layout), same_host=same_host, kv_scale=kv_scale
        )
        if cache_salt is not None:
            request.cache_salt = cache_salt
        reply = self._call(self._stub.Attach, request, timeout_s)
        self._take_spare()  # a reservation of the last attachment is not this one's
        stored = wire.layout_of(reply.layout)
        engine = stored if layout.block_size == stored.block_size else stored.with_block_size(layout.block_size)
        self._pools.close()
        host = map_host_segment(reply.host_segment, stored) if reply.HasField("host_segment") else None
        device = map_device_pool(reply.device_pool, stored) if reply.HasField("device_pool") else None
        self._pools = LocalPools(host, device)
        if self._control is not None:
            self._control.close()
        self._control = (
            ControlSocket(reply.control_socket, self._auth_token, self.address)
            if self._use_control and host is not None and reply.control_socket
            else None
        )
        self._presence = _map_presence(reply, stored.block_size) if host is not None else None
        self._attachment = Attachment(
            reply.namespace_id,
            engine,
            reply.lease_ttl_seconds,
            reply.max_prompt_tokens,
            reply.max_chunk_bytes,
            host is not None,
            device is not None,
            reply.host_segment.name if host is not None else "",
            None if engine == stored else stored,
        )
        return self._attachment

    # -- lookups and reads ------------------------------------------------------------
    def held_tokens(self, tokens: TokenInput, cache_salt: str | None = None) -> int | None:
        """How many leading tokens of `tokens` (salted `cache_salt`) the service's index holds, by
        the presence table it publishes to same-host clients (prefixcache/presence.py): advice,
        read from shared memory without a call, in whole blocks of the service's; None where it
        publishes none, or for a salt the table cannot answer (an invalid one: its Lookup says
        why). Only a Lookup says what is there; a Lookup for tokens beyond this count finds nothing."""
        presence = self._presence
        if presence is None:
            return None
        return presence.held_tokens(_token_list(tokens) if isinstance(tokens, torch.Tensor) else tokens, cache_salt)

    def lookup(
        self,
        tokens: TokenInput,
        cache_salt: str | None = None,
        take_lease: bool = True,
        timeout_s: float | None = None,
        recompute_s_per_token: float | None = None,
        namespace_id: str | None = None,
        release: Sequence[Hit] = (),
    ) -> Hit:
        """Longest cached prefix of `tokens`; with a lease its blocks stay put until `release`.

        `recompute_s_per_token` (1 / this worker's prefill rate) lets the service skip disk and
        Redis blocks that would arrive slower than recomputing them (`Hit.remote_blocks_declined`
        counts Redis's; the disk tier counts its own, `reads_declined`).
        `namespace_id` (default: the attached one) lets an operator tool look up, e.g. to warm,
        any namespace its token may act on. `release`: earlier hits whose leases the service
        releases first, as `release` would, without a call of their own (a lease already gone is
        skipped). If the Lookup fails they may not have been: release them as usual.
        """
        request = pb.LookupRequest(
            namespace_id=namespace_id or self.attachment.namespace_id,
            tokens=_token_list(tokens),
            take_lease=take_lease,
            release_lease_ids=[hit.lease_id for hit in release if hit.lease_id],
        )
        if cache_salt is not None:
            request.cache_salt = cache_salt
        if recompute_s_per_token is not None:
            request.recompute_seconds_per_token = recompute_s_per_token
        split = 1
        if namespace_id is None and self.attachment.split > 1:  # the hit in whole blocks of this engine
            request.block_size, split = self.attachment.layout.block_size, self.attachment.split
        sent = time.monotonic()
        reply = self._unary("Lookup", request, timeout_s)
        locations = BlockLocations(wire.tier_kinds(reply.tiers), np.asarray(reply.slots, dtype=np.int64))
        lease = reply.lease_id or None
        return Hit(
            reply.namespace_id,
            reply.prompt_tokens,
            reply.hit_tokens,
            locations,
            wire.MISS_REASON_OF.get(reply.miss_reason),
            lease,
            sent + reply.lease_ttl_seconds - LEASE_MARGIN_S if lease else None,
            reply.remote_blocks_declined,
            _leading_in(locations.tiers, self._pools.pools.keys()) // split,
            split,
        )

    def read(
        self, hit: Hit, out: torch.Tensor | None = None, timeout_s: float | None = None, blocks: slice | None = None
    ) -> torch.Tensor:
        """The hit's KV, `[n, *block_shape]`, of all its blocks or the contiguous range `blocks`.

        From mapped memory when every block of the range is mapped (only the range is copied),
        else by the Fetch stream, which moves the whole lease (the rest is dropped)."""
        stored = self.attachment.stored_layout or self.attachment.layout
        k = hit.split
        layout = stored if k == 1 else stored.with_block_size(stored.block_size * k)
        start, stop = _block_range(hit, blocks)
        count = max(0, stop - start)
        shape = (count, *layout.block_shape)
        if out is not None and (
            tuple(out.shape) != shape or out.dtype != layout.dtype.torch or not out.is_contiguous()
        ):
            raise InvalidArgument("out", f"must be a contiguous {layout.dtype.torch} tensor of shape {shape}")
        target = torch.empty(shape, dtype=layout.dtype.torch) if out is None else out
        if count == 0:
            return target
        if hit.lease_id is None:
            raise InvalidArgument("hit", "reading blocks needs a lease: lookup(..., take_lease=True)")
        first, end = start * k, stop * k  # in the service's blocks
        part = hit.locations if end - first == len(hit.locations) else hit.locations[first:end]
        if self._pools.covers(part):
            if k == 1:
                self._pools.gather(part, target)
            else:  # straight into the engine blocks' token ranges: a staging buffer's page faults cost 4x
                parts = target.view(count, *layout.block_shape[:3], k, stored.block_size, layout.head_dim)
                for j in range(k):
                    self._pools.gather(part[j::k], parts[:, :, :, :, j])
            self._check_read(hit.lease_id, hit.lease_deadline)
            return target
        if k == 1 and count == hit.blocks:
            return self._fetch(hit, target, timeout_s)
        whole = self._fetch(hit, torch.empty((len(hit.locations), *stored.block_shape), dtype=target.dtype), timeout_s)
        if k > 1:
            return _join_blocks(whole[first:end], k, target)
        return whole[start:stop] if out is None else out.copy_(whole[start:stop])  # a view: no copy

    def read_into(
        self,
        hit: Hit,
        sink: Callable[[int, torch.Tensor], None],
        blocks: slice | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """`read`, handing the blocks to `sink(i, kv)` instead of one tensor: `kv` `[n, *block_shape]`
        holds blocks i..i+n of the range. Where the range is mapped (and the hit's blocks are the
        engine's), each run of slots is a view of the service's memory, valid only during the call:
        the sink's copy is the only one. Else one piece, `read`'s tensor.

        Raises UnknownLease after the sink ran if the lease may have ended while it copied (or the
        service's memory was replaced): whatever it wrote from these views is not to be kept."""
        start, stop = _block_range(hit, blocks)
        part = hit.locations if stop - start == len(hit.locations) else hit.locations[start:stop]
        if hit.split != 1 or stop <= start or not self._pools.covers(part):
            sink(0, self.read(hit, timeout_s=timeout_s, blocks=blocks))
            return
        if hit.lease_id is None:
            raise InvalidArgument("hit", "reading blocks needs a lease: lookup(..., take_lease=True)")
        for first, view in self._pools.pieces(part):
            sink(first, view)
        self._check_read(hit.lease_id, hit.lease_deadline)

    def _check_read(self, lease_id: int, deadline: float | None) -> None:
        """After a copy out of mapped memory: were those still the lease's bytes throughout?"""
        self._pools.check_current()  # slots of a restarted service's new segment: not these bytes
        if deadline is None or time.monotonic() >= deadline:
            raise UnknownLease(lease_id)  # the slots may have been reused while we copied

    def _fetch(self, hit: Hit, out: torch.Tensor, timeout_s: float | None) -> torch.Tensor:
        target = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        flat = target.view(torch.uint8).reshape(-1).numpy()
        total, received = flat.nbytes, 0
        stream = self._fetch_call(
            pb.FetchRequest(lease_id=hit.lease_id),
            timeout=self._stream_timeout(total, timeout_s),
            metadata=self._metadata,
        )
        try:
            for raw in stream:
                chunk = wire.decode_fetch_chunk(raw)
                end = received + len(chunk.data)
                if chunk.offset != received or chunk.total_bytes != total or end > total:
                    raise InvalidArgument(
                        "fetch",
                        f"chunk at {chunk.offset} of {chunk.total_bytes} bytes does not "
                        f"continue {received} of the {total} expected",
                    )
                flat[received:end] = np.frombuffer(chunk.data, dtype=np.uint8)
                received = end
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.address, hit.lease_id) from None
        except wire.WireError as error:
            raise InvalidArgument("fetch", f"malformed chunk from the service: {error}") from None
        finally:
            stream.cancel()  # no-op when complete; frees the server promptly on an error
        if received != total:
            raise InvalidArgument("fetch", f"stream ended after {received} of {total} bytes")
        if target is not out:
            out.copy_(target)
        return out

    def release(self, hit: Hit | int, timeout_s: float | None = None) -> bool:
        """Drop a lease; False when it had already expired (harmless). A hit without a lease is a no-op."""
        lease_id = hit.lease_id if isinstance(hit, Hit) else hit
        if not lease_id:
            return False
        request = pb.ReleaseRequest(lease_id=lease_id)
        control = self._control
        if control is not None:  # never refused for load there: no retry hints to follow
            try:
                reply = control.call("Release", request, pb.ReleaseResponse, timeout_s or self.timeout_s, lease_id)
            except UnknownLease:
                return False
            if reply is not None:
                return True
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                self._stub.Release(request, timeout=max(0.001, deadline - time.monotonic()), metadata=self._metadata)
                return True
            except grpc.RpcError as error:
                # A service from before Release was exempt from its load limit may refuse it:
                # retry after its hint, since a lease left to expire pins blocks for its TTL.
                pause = retry_after_s(error)
                if pause is None or attempt == RELEASE_ATTEMPTS - 1 or time.monotonic() + pause >= deadline:
                    try:
                        raise error_from_rpc(error, self.address, lease_id) from None
                    except UnknownLease:
                        return False
                time.sleep(pause)
        return False

    # -- writes ---------------------------------------------------------------------------
    def store(
        self,
        tokens: TokenInput,
        kv: torch.Tensor,
        start_block: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        retention_s: float | None = None,
    ) -> CommitResult:
        """Publish `kv[i]` as block `start_block + i` of `tokens` (shared memory if mapped, else the stream).

        Blocks the service had no free slot for are counted in `rejected`. The counts are the
        service's blocks (`Attachment.split` of them per block of this engine). `retention_s` (a
        retention hint, e.g. `parse_retention("24h")`): keep these blocks at least that long since
        their last use, within the tenant's bound (the result says what was applied).
        """
        attachment = self.attachment
        token_list = _token_list(tokens)
        self._check_kv(kv, attachment.layout, start_block, len(token_list))
        check_retention(retention_s)
        if len(kv) == 0:
            return CommitResult(0, 0, 0)
        if attachment.split > 1:  # stored as the service's blocks
            kv, start_block = _split_blocks(kv, attachment.split), start_block * attachment.split
        if self._pools.host is not None:
            return self._store_shared(token_list, kv, start_block, cache_salt, timeout_s, retention_s)
        return self._store_stream(token_list, kv, start_block, cache_salt, timeout_s, retention_s)

    @staticmethod
    def _check_kv(kv: torch.Tensor, layout: KVLayout, start_block: int, token_count: int) -> None:
        if kv.dtype != layout.dtype.torch:
            raise InvalidArgument("kv", f"dtype {kv.dtype} differs from the namespace's {layout.dtype.torch}")
        if kv.dim() != 6 or tuple(kv.shape[1:]) != layout.block_shape:
            raise InvalidArgument("kv", f"shape {tuple(kv.shape)} is not [blocks, *{layout.block_shape}]")
        if start_block < 0 or (start_block + len(kv)) * layout.block_size > token_count:
            raise InvalidArgument(
                "start_block",
                f"blocks {start_block}..{start_block + len(kv)} exceed the "
                f"{token_count // layout.block_size} full blocks of the tokens",
            )

    def _store_shared(
        self,
        tokens: list[int],
        kv: torch.Tensor,
        start_block: int,
        salt: str | None,
        timeout_s: float | None,
        retention_s: float | None = None,
    ) -> CommitResult:
        """Write the reserved slots, then Commit; the Commit reserves the next store's slots, so a
        store finding that spare reservation large enough makes one call, not two."""
        spare = self._take_spare()
        reservation = spare if spare is not None and len(spare.slots) >= len(kv) else None
        if reservation is None:
            ask = pb.ReserveRequest(namespace_id=self.attachment.namespace_id, block_count=len(kv))
            if spare is not None:  # too small: given back in the same call
                ask.replaces = spare.reservation_id
            reservation = self._unary("Reserve", ask, timeout_s)
        slots = list(reservation.slots)[: len(kv)]
        if not slots:
            return CommitResult(0, 0, len(kv))
        self._pools.check_current()  # a restarted service's slots are not in this mapping
        self._pools.scatter(slots, kv[: len(slots)])
        result = self._commit(
            tokens, reservation.reservation_id, start_block, len(slots), salt, timeout_s, retention_s, len(kv)
        )
        return replace(result, rejected=result.rejected + len(kv) - len(slots))

    def reserve_mapped(self, blocks: int) -> Reservation | None:
        """`blocks` reserved slots of the mapped host tier, without a call: the spare reservation
        the last shared-memory Commit asked for (`reserve_next`), while fresh, at least this large
        and its first `blocks` slots one run (one view, one copy). None otherwise, or where blocks
        are not written through a mapping (`store` then reserves as it goes, or uses the spare).
        For a caller that copies blocks straight into the slots, e.g. out of an engine's paged
        cache, then commits them off its hot path (`commit_reserved`): scattered slots would cost
        it a copy per run."""
        if blocks <= 0 or self._pools.host is None or self.attachment.split != 1:
            return None
        spare = self._take_spare(at_least=blocks, one_run=True)
        if spare is None:
            return None
        # Not checked against a restarted service here: writing this mapping's slots harms no one,
        # and `commit_reserved` refuses to publish what a replaced segment holds.
        return Reservation(spare.reservation_id, tuple(spare.slots[:blocks]))

    def reserved_pieces(self, reservation: Reservation) -> Iterator[tuple[int, torch.Tensor]]:
        """(i, view): views `[n, *block_shape]` of the slots for blocks i..i+n of `reservation`,
        one per run of adjacent slots, to write into (they alias the service's memory)."""
        return self._pools.host_pieces(reservation.slots)

    def commit_reserved(
        self,
        reservation: Reservation,
        tokens: TokenInput,
        start_block: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        retention_s: float | None = None,
    ) -> CommitResult:
        """Publish the blocks written into `reservation`'s slots as blocks `start_block`.. of
        `tokens`: `store`'s Commit (its result and rules), without the copy."""
        token_list = _token_list(tokens)
        blocks = len(reservation.slots)
        if start_block < 0 or (start_block + blocks) * self.attachment.layout.block_size > len(token_list):
            raise InvalidArgument(
                "start_block",
                f"blocks {start_block}..{start_block + blocks} exceed the "
                f"{len(token_list) // self.attachment.layout.block_size} full blocks of the tokens",
            )
        check_retention(retention_s)
        self._pools.check_current()  # written into a replaced segment: the service never saw them
        return self._commit(
            token_list, reservation.reservation_id, start_block, blocks, cache_salt, timeout_s, retention_s, blocks
        )

    def _commit(
        self,
        tokens: list[int],
        reservation_id: int,
        start_block: int,
        blocks: int,
        salt: str | None,
        timeout_s: float | None,
        retention_s: float | None,
        size: int,
    ) -> CommitResult:
        """Commit the reservation's first `blocks` slots of a store of `size` blocks, reserving the
        next store's: as many as the largest of the last few stores, so that a store no larger
        finds them."""
        with self._spare_lock:
            self._recent_stores.append(size)
            ask = max(self._recent_stores)
        request = pb.CommitRequest(
            namespace_id=self.attachment.namespace_id,
            tokens=tokens,
            reservation_id=reservation_id,
            start_block=start_block,
            block_count=blocks,
            reserve_next=ask,
        )
        if salt is not None:
            request.cache_salt = salt
        if retention_s is not None:
            request.retention_seconds = retention_s
        sent = time.monotonic()
        reply = self._unary("Commit", request, timeout_s)
        if reply.HasField("next") and reply.next.slots:
            # Touched here, off the next store's path (which may be an engine's step).
            self._pools.prefault(reply.next.slots)
            # Used only while at least half its TTL is left: a store that finds it must still
            # write and commit before the service reclaims it.
            self._put_spare(reply.next, sent + reply.next.ttl_seconds / 2)
        return CommitResult(
            reply.stored, reply.deduplicated, reply.rejected, reply.retention_seconds, reply.retention_clamped
        )

    def _take_spare(self, at_least: int = 0, one_run: bool = False) -> pb.ReserveResponse | None:
        """The spare reservation while it is fresh (taken: one store uses it); a stale one is left
        to expire on the service. One of fewer than `at_least` slots stays for a store that
        reserves anew (and gives it back in that call); with `one_run`, so does one whose first
        `at_least` slots are not one run (for `store`, which copies run by run)."""
        with self._spare_lock:
            spare = self._spare
            if spare is not None and (
                len(spare[0].slots) < at_least or (one_run and not self._pools.one_run(spare[0].slots[:at_least]))
            ):
                return None
            self._spare = None
        if spare is None or time.monotonic() >= spare[1]:
            return None
        return spare[0]

    def _put_spare(self, reservation: pb.ReserveResponse, use_until: float) -> None:
        with self._spare_lock:
            self._spare = (reservation, use_until)

    def _store_stream(
        self,
        tokens: list[int],
        kv: torch.Tensor,
        start_block: int,
        salt: str | None,
        timeout_s: float | None,
        retention_s: float | None = None,
    ) -> CommitResult:
        attachment = self.attachment
        layout = attachment.stored_layout or attachment.layout
        header = pb.StoreHeader(
            namespace_id=attachment.namespace_id,
            tokens=tokens,
            start_block=start_block,
            block_count=len(kv),
            dtype=cast("pb.DType", layout.dtype.code),
            block_shape=layout.block_shape,
        )
        if salt is not None:
            header.cache_salt = salt
        if retention_s is not None:
            header.retention_seconds = retention_s
        payload = kv.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data
        chunk = min(STORE_CHUNK_BYTES, attachment.max_chunk_bytes)

        def messages() -> Iterator[bytes]:
            yield pb.StoreRequest(header=header).SerializeToString()
            for offset in range(0, len(payload), chunk):
                yield wire.encode_store_data([payload[offset : offset + chunk]])

        reply = self._call(self._store_call, messages(), self._stream_timeout(len(payload), timeout_s))
        return CommitResult(
            reply.stored, reply.deduplicated, reply.rejected, reply.retention_seconds, reply.retention_clamped
        )

    # -- operations -------------------------------------------------------------------------
    def stats(self, timeout_s: float | None = None) -> wire.ServiceStats:
        return wire.stats_of(self._call(self._stub.GetStats, pb.GetStatsRequest(), timeout_s))

    def namespaces(self, timeout_s: float | None = None) -> list[wire.NamespaceInfo]:
        """This credential's namespaces (an admin's: every tenant's) with their resident blocks."""
        return self.namespace_report(timeout_s)[0]

    def refused_attaches(self, timeout_s: float | None = None) -> list[wire.RefusedAttach]:
        """Attaches the service refused lately (newest first; a tenant's token: its own), with why."""
        return self.namespace_report(timeout_s)[1]

    def namespace_report(
        self, timeout_s: float | None = None
    ) -> tuple[list[wire.NamespaceInfo], list[wire.RefusedAttach]]:
        """`namespaces()` and `refused_attaches()` from one ListNamespaces call."""
        reply = self._call(self._stub.ListNamespaces, pb.ListNamespacesRequest(), timeout_s)
        return wire.namespaces_of(reply), wire.refused_of(reply)

    def inspect(
        self,
        tokens: TokenInput,
        cache_salt: str | None = None,
        namespace_id: str | None = None,
        timeout_s: float | None = None,
    ) -> InspectReport:
        request = pb.InspectRequest(
            namespace_id=namespace_id or self.attachment.namespace_id, tokens=_token_list(tokens)
        )
        if cache_salt is not None:
            request.cache_salt = cache_salt
        reply = self._call(self._stub.Inspect, request, timeout_s)
        blocks = tuple(
            BlockInfo(
                b.block, wire.TIER_OF[b.tier].label, b.slot, b.ttl_left_seconds, b.last_access_age_seconds, b.leased
            )
            for b in reply.blocks
        )
        return InspectReport(
            reply.namespace_id,
            reply.prompt_tokens,
            reply.hit_tokens,
            blocks,
            wire.MISS_REASON_OF.get(reply.miss_reason),
            reply.disk_blocks,
        )

    def match(
        self,
        tokens: TokenInput,
        cache_salt: str | None = None,
        namespace_id: str | None = None,
        timeout_s: float | None = None,
    ) -> MatchReport:
        """Where the prompt's cached prefix lives (a router's question): no lease, no TTL refresh."""
        request = pb.MatchRequest(namespace_id=namespace_id or self.attachment.namespace_id, tokens=_token_list(tokens))
        if cache_salt is not None:
            request.cache_salt = cache_salt
        reply = self._call(self._stub.Match, request, timeout_s)
        return MatchReport(
            reply.namespace_id,
            reply.prompt_tokens,
            reply.hit_tokens,
            {wire.TIER_OF[t.tier].label: t.blocks for t in reply.tiers if t.tier in wire.TIER_OF},
            reply.remote_blocks,
            wire.MISS_REASON_OF.get(reply.miss_reason),
            reply.disk_blocks,
        )

    def evict(
        self,
        namespace_id: str | None = None,
        older_than_s: float | None = None,
        prefix_tokens: TokenInput | None = None,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Blocks evicted by namespace, age or prefix (a prefix defaults to the attached namespace)."""
        if prefix_tokens is not None and namespace_id is None:
            namespace_id = self.attachment.namespace_id
        request = pb.EvictRequest(namespace_id=namespace_id or "")
        if cache_salt is not None:
            request.cache_salt = cache_salt
        if older_than_s is not None:
            request.older_than_seconds = older_than_s
        if prefix_tokens is not None:
            request.prefix.SetInParent()
            request.prefix.tokens.extend(_token_list(prefix_tokens))
        return int(self._call(self._stub.Evict, request, timeout_s).evicted)

    def pin(
        self,
        tokens: TokenInput,
        namespace_id: str | None = None,
        ttl_s: float | None = None,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        priority: int | None = None,
    ) -> PinInfo:
        """Pin the cached prefix of `tokens` (the attached namespace by default) until `unpin` or
        `ttl_s`; the service promotes it from Redis first. InvalidArgument when nothing holds it."""
        request = pb.PinRequest(namespace_id=namespace_id or self.attachment.namespace_id)
        request.prefix.tokens.extend(_token_list(tokens))
        if ttl_s is not None:
            request.ttl_seconds = ttl_s
        if cache_salt is not None:
            request.cache_salt = cache_salt
        if priority is not None:
            request.priority = check_priority(priority)
        return PinInfo.of(self._call(self._stub.Pin, request, timeout_s).pin)

    def unpin(self, pin_id: int, timeout_s: float | None = None) -> None:
        self._call(self._stub.Unpin, pb.UnpinRequest(pin_id=pin_id), timeout_s)

    def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        return [PinInfo.of(m) for m in self._call(self._stub.ListPins, pb.ListPinsRequest(), timeout_s).pins]

    def flush(self, timeout_s: float | None = None) -> int:
        return int(self._call(self._stub.Flush, pb.FlushRequest(), timeout_s).evicted)

    def health(self, service: str = SERVICE_NAME, timeout_s: float | None = None) -> bool:
        """True when the service reports SERVING."""
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        self._pools.close()
        if self._control is not None:
            self._control.close()
        self._channel.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _map_presence(reply: pb.AttachResponse, block_size: int) -> PresenceView | None:
    """The service's presence table (presence.py), where it publishes one that this client reads."""
    if not reply.HasField("presence"):
        return None
    table = reply.presence
    try:
        hasher = Hasher(HashAlgorithm.parse(table.hash_algorithm))
        gap = (table.salt_head, table.salt_tail) if table.salt_head else None  # (none from an older service)
        return PresenceView(table.name, table.namespace_root, hasher, block_size, gap)
    except (OSError, ConfigError) as error:
        log.info("prefixcache: presence table %r not read (%s); every prompt is looked up", table.name, error)
        return None
