"""`prefixcache serve`: flags -> ServerOptions -> a running server until SIGTERM/SIGINT.

On start it prints one line, `prefixcache serve: listening on HOST:PORT`
(the real port when `--listen` asks for port 0), so scripts and tests can wait
for readiness without sleeping. By then the host tier's shared memory is
reserved in full (tiers/shm.py): a /dev/shm too small for `--host-capacity`,
or a live service owning the segment name, fails the start with one line. SIGTERM or SIGINT drains within `--grace` and
exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import torch

from prefixcache.config import (
    CacheConfig,
    HashAlgorithm,
    KVLayout,
    TenantQuota,
    TenantQuotas,
    parse_duration,
    parse_size,
)
from prefixcache.errors import ConfigError
from prefixcache.presence import PRESENCE_BLOCKS
from prefixcache.tiers.base import RemoteTier
from prefixcache.tiers.disk import DiskOptions
from prefixcache.tiers.shm import check_name

from .auth import Authenticator, load_credentials, quota_overrides
from .backend import BackendOptions
from .malloc import tune_for_large_frames
from .options import ServerOptions, split_host_port
from .pools import waiting
from .server import build_server

log = logging.getLogger(__name__)

TOKEN_ENV = "PREFIXCACHE_AUTH_TOKEN"
EXAMPLES = """examples:
  prefixcache serve --host-capacity 8GiB --ttl 10m
  prefixcache serve --listen 0.0.0.0:50051 --credentials tenants.txt --tls-cert c.pem --tls-key k.pem
  prefixcache serve --credentials tenants.txt --tenant-quota host=2GiB --hash sha256
  PREFIXCACHE_AUTH_TOKEN=... prefixcache serve --metrics-port 9400
  prefixcache serve --redis-url redis://127.0.0.1:6379/0 --redis-password-file /run/secrets/redis
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the cache service (gRPC)",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the prefix-cache gRPC service. Workers of any models (KV layouts) share its tiers.",
    )
    add = parser.add_argument
    add("--listen", default="127.0.0.1:50051", help="HOST:PORT to listen on (default %(default)s; port 0: any)")
    add("--host-capacity", default="1GiB", help="host tier (shared memory) byte budget (default %(default)s)")
    add(
        "--host-prefault",
        action="store_true",
        help="map every page of the host tier at start, so no commit pays a page's first touch (start-up "
        "pays instead: about 2.3 s per GiB on a 2-vCPU VM)",
    )
    add("--device-capacity", default="0", help="device tier byte budget on CUDA (default %(default)s: none)")
    add(
        "--block-size",
        type=int,
        default=16,
        help="tokens per block (default %(default)s); an engine attaches with any multiple of it",
    )
    add(
        "--chunk-bytes",
        default=None,
        help="slot tiers are cut into chunks of this size, each serving one model's KV layout at a time "
        "(default: 64MiB, at most a quarter of a tier, in whole blocks of the first layout; must hold "
        "the largest block)",
    )
    add(
        "--min-block-bytes",
        default=None,
        help="the smallest block that fills a whole chunk (sizes the index; default and at most: the first "
        "layout's block; a smaller model's blocks fill chunks partly)",
    )
    add("--ttl", default="300s", help="sliding time-to-live of a block (default %(default)s)")
    add("--lease-ttl", default="30s", help="how long a lease pins blocks at most (default %(default)s)")
    add(
        "--hash",
        default="xxh3_128",
        choices=[h.value for h in HashAlgorithm],
        help="block hash (default %(default)s; sha256 where tenants may be adversarial, see SECURITY.md)",
    )
    add(
        "--tenant-quota",
        default="",
        metavar="TIER=SIZE[,...]",
        help="byte budget of every tenant per tier, e.g. host=256MiB,device=1GiB (default: none); "
        "a credentials line may override it",
    )
    add(
        "--max-retention",
        default="0s",
        metavar="DURATION",
        help="longest retention hint (a store's prompt_cache_retention) honoured for a tenant, e.g. 24h; "
        "longer hints are cut to it and counted (default %(default)s: hints keep nothing past --ttl and "
        "--redis-ttl); a credentials line's retention= overrides it",
    )
    add(
        "--shm-name",
        default=None,
        help="name of the host tier's shared-memory segment in /dev/shm (default: prefixcache-HOST-PORT of the "
        "bound address); a dead owner's segment of that name is reclaimed, a live one's refused",
    )
    add(
        "--no-control-socket",
        dest="control_socket",
        action="store_false",
        help="same-host engines make their per-request calls (Lookup, Reserve, Commit, Release) over "
        "gRPC only, not over the socket beside the shared-memory segment (docs/client.md)",
    )
    add("--max-prompt-tokens", type=int, default=1 << 20, help="longest prompt accepted (default %(default)s)")
    add("--max-leases", type=int, default=4096, help="leases held at once (default %(default)s)")
    events = parser.add_argument_group("KV events for routers (vLLM's KVEventBatch over ZMQ; docs/deploy.md)")
    events.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish what the local tiers gain and lose on this ZMQ PUB address (default: off)",
    )
    events.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="answer replay requests (a start sequence number) on this ZMQ ROUTER address",
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--auth-token", default=None, help=f"shared bearer token (or env {TOKEN_ENV})")
    auth.add_argument("--auth-token-file", default=None, help="file holding the shared bearer token")
    auth.add_argument("--credentials", default=None, help="file of 'TOKEN TENANT [admin]' lines (multi-tenant)")
    add("--tls-cert", default=None, help="PEM certificate chain (enables TLS, with --tls-key)")
    add("--tls-key", default=None, help="PEM private key")
    add("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (default: off)")
    add(
        "--metrics-host",
        default=None,
        help="metrics bind address (default 127.0.0.1, whatever --listen is: the figures are "
        "unauthenticated; e.g. 0.0.0.0 in a pod scraped by Prometheus)",
    )
    add("--grace", default="10s", help="drain period on SIGTERM (default %(default)s)")
    add(
        "--max-concurrent-rpcs",
        type=int,
        default=128,
        help="calls held at once (queued or running); more get RESOURCE_EXHAUSTED with a retry "
        "hint; health checks and Release are never refused (default %(default)s)",
    )
    add(
        "--workers",
        type=int,
        default=2,
        help="unary calls (Lookup, Commit, ...) run at once, plus one per call waiting on Redis; more "
        "rarely helps: each extra runnable thread costs GIL hand-offs (default %(default)s)",
    )
    add(
        "--stream-workers",
        type=int,
        default=16,
        help="threads for Fetch/Store streams, one per open stream (default %(default)s)",
    )
    add(
        "--stream-idle-timeout",
        default="10s",
        help="cancel a Fetch/Store stream with no message through for this long (default %(default)s)",
    )
    add(
        "--tenant-share",
        type=float,
        default=0.5,
        help="with --credentials naming several tenants: the share of --max-concurrent-rpcs and of "
        "--stream-workers one tenant may hold at once (default %(default)s)",
    )
    add("--stream-timeout", default="10m", help="cancel a Fetch/Store stream open this long (default %(default)s)")
    add(
        "--max-store-buffer",
        default=None,
        help="bytes Store streams may buffer at once; a Store beyond is refused at its header "
        "(default: the host capacity)",
    )
    add("--max-message-size", default="16MiB", help="largest gRPC message either way (default %(default)s)")
    redis = parser.add_argument_group("Redis tier (optional: shared across instances and restarts)")
    redis.add_argument(
        "--redis-url",
        default=None,
        help="redis://[user:pass@]host:port/0, rediss://..., or redis+cluster://host:port,...",
    )
    redis.add_argument("--redis-key-prefix", default="pfx", help="key prefix (default %(default)s)")
    redis.add_argument("--redis-timeout-ms", type=int, default=50, help="read timeout (default %(default)s)")
    redis.add_argument("--redis-ttl", default="1h", help="TTL of a block in Redis (default %(default)s)")
    redis.add_argument(
        "--redis-presence-blocks",
        type=int,
        default=None,
        help="Redis blocks the presence table follows for same-host engines, which skip Lookups of "
        "prompts neither this service nor Redis holds (32 bytes of shared memory each; 0: none, "
        f"engines look up every prompt; default {PRESENCE_BLOCKS})",
    )
    redis.add_argument(
        "--redis-password-file",
        default=None,
        help="file holding the Redis password (the ACL user goes in the URL: redis://USER@host...)",
    )
    redis.add_argument(
        "--redis-tls-ca-file", default=None, help="CA bundle that signed Redis's certificate (rediss://)"
    )
    redis.add_argument("--redis-tls-cert-file", default=None, help="client certificate, if Redis asks for one")
    redis.add_argument("--redis-tls-key-file", default=None, help="client certificate's private key")
    redis.add_argument(
        "--redis-hmac-key-file",
        default=None,
        help="file holding a secret of >= 32 bytes (e.g. `openssl rand -hex 32`) that MACs every "
        "Redis frame, so Redis write access alone cannot plant KV; the same on every instance",
    )
    disk = parser.add_argument_group("Disk tier (optional: capacity beyond RAM, warm after a restart)")
    disk.add_argument("--disk-dir", default=None, help="directory of the disk tier's preallocated files (a local SSD)")
    disk.add_argument(
        "--disk-capacity", default=None, help="the disk tier's byte budget, e.g. 100GiB (needs --disk-dir)"
    )
    disk.add_argument(
        "--disk-admit-after",
        type=int,
        default=2,
        help="write a block to disk the Nth time it leaves the host tier (default %(default)s; 1: every time)",
    )
    disk.add_argument(
        "--disk-ttl", default="24h", help="time-to-live of a block on disk since its last use (default %(default)s)"
    )
    parser.set_defaults(handler=run)


def disk_options_from(args: argparse.Namespace) -> DiskOptions | None:
    if args.disk_dir is None:
        if args.disk_capacity is not None:
            raise ConfigError("disk_capacity", "needs --disk-dir")
        return None
    if args.disk_capacity is None:
        raise ConfigError("disk_capacity", "--disk-dir needs a --disk-capacity")
    return DiskOptions(args.disk_dir, args.disk_capacity, ttl_s=args.disk_ttl, admit_after=args.disk_admit_after)


def authenticator_from(args: argparse.Namespace) -> Authenticator:
    if args.credentials:
        return Authenticator(load_credentials(args.credentials))
    if args.auth_token_file:
        with open(args.auth_token_file, encoding="utf-8") as handle:
            return Authenticator.shared_token(handle.read().strip())
    token = args.auth_token if args.auth_token is not None else os.environ.get(TOKEN_ENV)
    return Authenticator.shared_token(token) if token is not None else Authenticator.open()


def quotas_from(args: argparse.Namespace, authenticator: Authenticator) -> TenantQuotas:
    """`--tenant-quota` for every tenant, with the credentials file's per-tenant overrides."""
    default = TenantQuota.parse(args.tenant_quota).updated(f"retention={args.max_retention}", "max_retention")
    overrides = quota_overrides(authenticator.principals)
    return TenantQuotas(default, tuple((tenant, default.updated(spec)) for tenant, spec in sorted(overrides.items())))


def _warn_weak_hash(authenticator: Authenticator, cache: CacheConfig) -> None:
    tenants = {principal.tenant for principal in authenticator.principals}
    if len(tenants) > 1 and cache.hash_algorithm is HashAlgorithm.XXH3_128:
        log.warning(
            "%d tenants share this cache with xxh3_128 block hashes; if a tenant may be adversarial, "
            "use --hash sha256 (SECURITY.md)",
            len(tenants),
        )


def remote_factory_from(args: argparse.Namespace) -> Callable[[KVLayout], RemoteTier] | None:
    """Validated Redis options now; the tier itself is built with the cache (it does no I/O)."""
    if args.redis_url is None:
        for name in (
            "redis_presence_blocks",
            "redis_password_file",
            "redis_tls_ca_file",
            "redis_tls_cert_file",
            "redis_tls_key_file",
            "redis_hmac_key_file",
        ):
            if getattr(args, name) is not None:
                raise ConfigError(name, "needs --redis-url")
        return None
    from prefixcache.codec import MIN_MAC_KEY_BYTES
    from prefixcache.tiers.redis import RedisTier  # only a service with a Redis tier imports redis
    from prefixcache.tiers.redis_options import RedisOptions

    password = None
    if args.redis_password_file:
        with open(args.redis_password_file, encoding="utf-8") as handle:
            password = handle.read().strip()
    hmac_key = None
    if args.redis_hmac_key_file:
        with open(args.redis_hmac_key_file, "rb") as handle:
            hmac_key = handle.read().strip()  # the file's bytes are the key (hex text is fine, not decoded)
        if len(hmac_key) < MIN_MAC_KEY_BYTES:
            raise ConfigError(
                "redis_hmac_key_file",
                f"must hold at least {MIN_MAC_KEY_BYTES} bytes besides "
                f"whitespace, got {len(hmac_key)} (generate one: openssl rand -hex 32)",
            )
        log.info("redis frames are authenticated (HMAC-SHA256, key from --redis-hmac-key-file)")
    if args.redis_timeout_ms < 1:
        raise ConfigError("redis_timeout_ms", "must be >= 1")
    options = RedisOptions(
        url=args.redis_url,
        key_prefix=args.redis_key_prefix,
        ttl_s=parse_duration(args.redis_ttl, "redis_ttl"),
        socket_timeout_s=args.redis_timeout_ms / 1000,
        password=password,
        tls_ca_file=args.redis_tls_ca_file,
        tls_cert_file=args.redis_tls_cert_file,
        tls_key_file=args.redis_tls_key_file,
        hmac_key=hmac_key,
        presence_blocks=PRESENCE_BLOCKS if args.redis_presence_blocks is None else args.redis_presence_blocks,
    )
    return lambda _layout: RedisTier(options, io_wait=waiting)


def options_from(args: argparse.Namespace) -> ServerOptions:
    authenticator = authenticator_from(args)
    cache = CacheConfig(
        host_capacity=parse_size(args.host_capacity, "host_capacity"),
        device_capacity=parse_size(args.device_capacity, "device_capacity"),
        ttl_s=parse_duration(args.ttl, "ttl"),
        lease_ttl_s=parse_duration(args.lease_ttl, "lease_ttl"),
        hash_algorithm=args.hash,
        max_prompt_tokens=args.max_prompt_tokens,
        max_leases=args.max_leases,
        tenant_quotas=quotas_from(args, authenticator),
        chunk_bytes=None if args.chunk_bytes is None else parse_size(args.chunk_bytes, "chunk_bytes"),
        min_block_bytes=None if args.min_block_bytes is None else parse_size(args.min_block_bytes, "min_block_bytes"),
        host_prefault=args.host_prefault,
    )
    _warn_weak_hash(authenticator, cache)
    if cache.device_capacity and not torch.cuda.is_available():
        raise ConfigError("device_capacity", "needs a CUDA device and none is available")
    if args.block_size < 1 or args.block_size > 65536:
        raise ConfigError("block_size", f"must be in [1, 65536], got {args.block_size}")
    if args.shm_name is not None:
        check_name(args.shm_name)
    message_size = parse_size(args.max_message_size, "max_message_size")
    backend = BackendOptions(
        cache=cache,
        block_size=args.block_size,
        shm_name=args.shm_name,
        device="cuda" if cache.device_capacity else None,
        remote_factory=remote_factory_from(args),
        disk=disk_options_from(args),
    )
    split_host_port(args.listen)
    return ServerOptions(
        backend=backend,
        listen=args.listen,
        authenticator=authenticator,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        max_receive_bytes=message_size,
        max_send_bytes=message_size,
        max_chunk_bytes=min((4 << 20) - 1024, message_size - (64 << 10)),
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        workers=args.workers,
        stream_workers=args.stream_workers,
        stream_idle_timeout_s=parse_duration(args.stream_idle_timeout, "stream_idle_timeout"),
        tenant_share=args.tenant_share,
        stream_timeout_s=parse_duration(args.stream_timeout, "stream_timeout"),
        max_store_buffer_bytes=None
        if args.max_store_buffer is None
        else parse_size(args.max_store_buffer, "max_store_buffer"),
        grace_s=parse_duration(args.grace, "grace"),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        control_socket=args.control_socket,
    )


def run(args: argparse.Namespace) -> int:
    options = options_from(args)
    tune_for_large_frames()
    server = build_server(options)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    print(f"prefixcache serve: listening on {server.address}", flush=True)
    if server.metrics_port is not None:
        print(f"prefixcache serve: metrics on port {server.metrics_port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    sys.stdout.flush()
    return 0
