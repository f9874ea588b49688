"""Frozen, validated settings of one service process (the `serve` flags, parsed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prefixcache.errors import ConfigError

from .auth import Authenticator
from .backend import BackendOptions

MIB = 1 << 20
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]+)):(?P<port>\d{1,5})$")


def split_host_port(value: str, field_name: str = "listen") -> tuple[str, int]:
    """("127.0.0.1", 50051) from "127.0.0.1:50051"; IPv6 as "[::1]:50051"; port 0 picks a free one."""
    match = _HOST_PORT.match(value.strip())
    if not match or int(match.group("port")) > 65535:
        raise ConfigError(field_name, f"expected HOST:PORT (IPv6 as [::1]:PORT), got {value!r}")
    return match.group("v6") or match.group("host"), int(match.group("port"))


@dataclass(frozen=True)
class ServerOptions:
    backend: BackendOptions
    listen: str = "127.0.0.1:50051"
    authenticator: Authenticator = field(default_factory=Authenticator.open, compare=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    metrics_port: int | None = None  # None: no exporter; 0: any free port
    metrics_host: str | None = None  # default: loopback, whatever `listen` is (the figures are unauthenticated)
    max_receive_bytes: int = 16 * MIB  # a 1M-token Lookup is ~5 MiB of varints
    max_send_bytes: int = 16 * MIB
    max_chunk_bytes: int = 4 * MIB - 1024  # Fetch/Store data per message: whole messages stay <= 4 MiB,
    # which any gRPC client accepts with default settings
    max_concurrent_rpcs: int = 128  # calls held; beyond: RESOURCE_EXHAUSTED + retry hint (pools.Admission)
    workers: int = 2  # unary calls run at once (plus one per call waiting on Redis); pools.py
    stream_workers: int = 16  # threads for streams (Fetch, Store, reflection); one per open stream
    stream_idle_timeout_s: float = 10.0  # a Fetch/Store with no message through for this long is cancelled
    stream_timeout_s: float = 600.0  # ... and one open this long in all (pools.StreamWatch)
    max_store_buffer_bytes: int | None = None  # what Store streams buffer at once; None: the host capacity
    tenant_share: float = 0.5  # multi-tenant: one tenant's most of the calls and stream threads (pools.TenantShares)
    grace_s: float = 10.0
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    expire_interval_s: float = 1.0
    kv_events_endpoint: str | None = None  # ZMQ PUB address of the KV events (kv_events.py); None: off
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address answering replay requests
    control_socket: bool = True  # same-host calls without gRPC (control_socket.py; Linux only)

    def __post_init__(self) -> None:
        split_host_port(self.listen)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert", "give both --tls-cert and --tls-key, or neither")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        if not 4096 <= self.max_chunk_bytes <= self.max_send_bytes - 64 * 1024:
            raise ConfigError("max_chunk_bytes", "must be >= 4096 and leave 64 KiB of max_send_bytes for framing")
        if self.max_receive_bytes < self.max_chunk_bytes + 64 * 1024:
            raise ConfigError("max_receive_bytes", "must hold one data chunk plus 64 KiB")
        for name in ("max_concurrent_rpcs", "workers", "stream_workers"):
            if not 1 <= getattr(self, name) <= 65536:
                raise ConfigError(name, "must be in [1, 65536]")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(name, f"expected a ZMQ address such as tcp://0.0.0.0:5557, got {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("kv_events_replay_endpoint", "needs --kv-events-endpoint")
        if not 0 < self.tenant_share <= 1:
            raise ConfigError("tenant_share", f"must be in (0, 1], got {self.tenant_share}")
        if self.max_store_buffer_bytes is not None and self.max_store_buffer_bytes < 1:
            raise ConfigError("max_store_buffer", "must be at least 1 byte")
        for name in (
            "grace_s",
            "keepalive_time_s",
            "keepalive_timeout_s",
            "expire_interval_s",
            "stream_idle_timeout_s",
            "stream_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be > 0")

    @property
    def host(self) -> str:
        return split_host_port(self.listen)[0]

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ]
