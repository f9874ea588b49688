"""Redis tier options and the one factory that turns a URL into a redis-py client.

Every timeout, retry and pool bound is set here explicitly, because redis-py's
defaults have changed between releases (5 s socket timeouts, 3 then 10
retries with backoff): a cache read must give up in tens of milliseconds and
the tier owns its retries (see `prefixcache/breaker.py`), so library retries are off.

URL schemes: redis://, rediss:// (TLS), unix://, and redis+cluster:// or
rediss+cluster:// for Redis Cluster, whose seed list may name several nodes
(`redis+cluster://user:pass@h1:7000,h2:7001`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry as LibraryRetry

from ..codec import MIN_MAC_KEY_BYTES
from ..config import parse_duration, parse_size
from ..errors import ConfigError
from ..presence import PRESENCE_BLOCKS

STANDALONE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
TLS_SCHEMES = ("rediss", "rediss+cluster")
CLIENT_NAME = "prefixcache"
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:/-]{1,64}$")

RedisClient = redis.Redis | RedisCluster


def url_scheme(url: str) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in STANDALONE_SCHEMES + CLUSTER_SCHEMES:
        schemes = ", ".join(f"{s}://" for s in STANDALONE_SCHEMES + CLUSTER_SCHEMES)
        raise ConfigError("redis_url", f"unsupported URL {redact_url(url)!r} (use one of {schemes})")
    return scheme


def is_cluster_url(url: str) -> bool:
    return url_scheme(url) in CLUSTER_SCHEMES


def redact_url(url: str) -> str:
    """The URL with any password replaced, safe to log."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


@dataclass(frozen=True)
class RedisOptions:
    """How to reach Redis and how hard to try. Durations in seconds, sizes in bytes."""

    url: str
    key_prefix: str = "pfx"
    ttl_s: float = 3600.0
    socket_timeout_s: float = 0.05  # reads (GET + TTL refresh); a cache miss beats a slow hit
    connect_timeout_s: float = 0.2
    write_timeout_s: float = 0.5  # background writer only
    # Whole exchanges: a read round trip, a write batch. The timeouts above bound each wait on the
    # socket, so a peer sending a byte now and then could hold an exchange for ever without these.
    # None: 4 x the timeout (0.2 s a read round trip of up to max_fetch_bytes, 2 s a write batch).
    read_deadline_s: float | None = None
    write_deadline_s: float | None = None
    max_queue_bytes: int = 256 << 20
    max_batch: int = 64  # writes per pipelined round trip
    write_lanes: int = 4  # writer connections sending at once (SETs; deletes go in order on one)
    max_fetch_bytes: int = 4 << 20  # reply bytes per pipelined read round trip (when the frame size is known)
    socket_read_size: int = 256 << 10  # per-connection receive buffer
    write_retries: int = 1  # on connection errors only (SET is idempotent)
    breaker_failures: int = 3
    breaker_backoff_min_s: float = 0.25
    breaker_backoff_max_s: float = 5.0
    max_connections: int = 16  # per client (the tier has a reader and a writer)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_check_hostname: bool = True
    # Shared by every instance on this Redis: frames are then MAC'd, so Redis write access
    # alone cannot plant KV (codec.py). Never in repr: options get logged.
    hmac_key: bytes | None = field(default=None, repr=False)
    # Blocks of Redis the service's presence table follows for its same-host engines (at a quarter
    # full: 32 bytes of shared memory each; tiers/redis_presence.py); 0: none, engines look up
    # every prompt.
    presence_blocks: int = PRESENCE_BLOCKS

    def __post_init__(self) -> None:
        scheme = url_scheme(self.url)
        if self.hmac_key is not None:
            if not isinstance(self.hmac_key, (bytes, bytearray)):
                raise ConfigError("hmac_key", f"must be bytes, got {type(self.hmac_key).__name__}")
            if len(self.hmac_key) < MIN_MAC_KEY_BYTES:
                raise ConfigError("hmac_key", f"must be at least {MIN_MAC_KEY_BYTES} bytes, got {len(self.hmac_key)}")
            object.__setattr__(self, "hmac_key", bytes(self.hmac_key))
        if not _KEY_PREFIX.match(self.key_prefix):
            # No glob characters (the prefix goes into SCAN MATCH) and no braces (a
            # cluster hash tag would put every block in one slot).
            raise ConfigError("key_prefix", f"must be 1-64 characters of [A-Za-z0-9_.:/-], got {self.key_prefix!r}")
        for name in (
            "ttl_s",
            "socket_timeout_s",
            "connect_timeout_s",
            "write_timeout_s",
            "breaker_backoff_min_s",
            "breaker_backoff_max_s",
        ):
            seconds = parse_duration(getattr(self, name), name)
            if seconds <= 0:
                raise ConfigError(name, "must be > 0")
            object.__setattr__(self, name, seconds)
        for name, timeout in (("read_deadline_s", "socket_timeout_s"), ("write_deadline_s", "write_timeout_s")):
            value = getattr(self, name)
            seconds = 4 * getattr(self, timeout) if value is None else parse_duration(value, name)
            if seconds < getattr(self, timeout):
                raise ConfigError(name, f"must be at least {timeout} ({getattr(self, timeout):g} s), got {seconds:g} s")
            object.__setattr__(self, name, seconds)
        if self.breaker_backoff_min_s > self.breaker_backoff_max_s:
            raise ConfigError("breaker_backoff_min_s", "must not exceed breaker_backoff_max_s")
        for name in ("max_queue_bytes", "max_fetch_bytes", "socket_read_size"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        for name, low in (("max_fetch_bytes", 1), ("socket_read_size", 4096)):
            if getattr(self, name) < low:
                raise ConfigError(name, f"must be at least {low} bytes")
        for name, low, high in (
            ("max_batch", 1, 1 << 16),
            ("write_lanes", 1, 16),
            ("breaker_failures", 1, 1 << 16),
            ("max_connections", 1, 1 << 16),
            ("write_retries", 0, 1 << 16),
            ("presence_blocks", 0, 1 << 28),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(name, f"must be an integer in [{low}, {high}], got {value!r}")
        if self.write_lanes > self.max_connections:
            raise ConfigError("write_lanes", f"must not exceed max_connections ({self.max_connections})")
        tls_files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(tls_files) and scheme not in TLS_SCHEMES:
            raise ConfigError("tls_ca_file", "TLS options need a rediss:// or rediss+cluster:// URL")

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))


def _common_kwargs(options: RedisOptions, socket_timeout_s: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        "socket_read_size": options.socket_read_size,
        "health_check_interval": 0,
        "max_connections": options.max_connections,
        "driver_info": None,  # no CLIENT SETINFO round trips on every connect
        # One CLIENT SETNAME round trip per new connection: names us in CLIENT LIST, and
        # reading its reply consumes TLS 1.3 session tickets, which redis-py would
        # otherwise mistake for unread data ("Connection not ready") on a fresh socket.
        "client_name": CLIENT_NAME,
        "protocol": 2,
    }
    if url_scheme(options.url) != "unix":
        kwargs["socket_keepalive"] = True  # TCP only; a unix socket connection rejects the option
    if options.username is not None:
        kwargs["username"] = options.username
    if options.password is not None:
        kwargs["password"] = options.password
    if url_scheme(options.url) in TLS_SCHEMES:
        kwargs.update(ssl_cert_reqs="required", ssl_check_hostname=options.tls_check_hostname)
        if options.tls_ca_file:
            kwargs["ssl_ca_certs"] = options.tls_ca_file
        if options.tls_cert_file:
            kwargs["ssl_certfile"] = options.tls_cert_file
        if options.tls_key_file:
            kwargs["ssl_keyfile"] = options.tls_key_file
    return kwargs


def _cluster_seeds(url: str) -> tuple[list[ClusterNode], dict[str, str]]:
    """Seed nodes and credentials of a redis+cluster:// URL."""
    rest = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    credentials: dict[str, str] = {}
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if password:
            credentials["password"] = unquote(password)
    nodes = []
    for seed in rest.split(","):
        host, _, port = seed.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("redis_url", f"cluster seed {seed!r} is not host:port")
        nodes.append(ClusterNode(host, int(port)))
    return nodes, credentials


def connect(url: str, options: RedisOptions, socket_timeout_s: float | None = None) -> RedisClient:
    """A client for `url` with explicit timeouts and no library retries.

    A standalone client does no I/O here. A cluster client fetches the slot map
    here (bounded by the connect timeout) and raises a RedisError if no seed answers.
    """
    scheme = url_scheme(url)
    kwargs = _common_kwargs(options, options.socket_timeout_s if socket_timeout_s is None else socket_timeout_s)
    no_retry = LibraryRetry(NoBackoff(), 0)
    if scheme in CLUSTER_SCHEMES:
        nodes, credentials = _cluster_seeds(url)
        kwargs.update(credentials)
        if scheme in TLS_SCHEMES:
            kwargs["ssl"] = True
        return RedisCluster(
            startup_nodes=nodes,
            retry=no_retry,
            require_full_coverage=True,
            dynamic_startup_nodes=True,
            reinitialize_steps=5,
            **kwargs,
        )
    return redis.Redis.from_url(url, retry=no_retry, retry_on_error=[], **kwargs)
