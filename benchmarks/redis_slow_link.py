"""Writes through to a distant Redis: a burst of SETs over a link of long round trips.

    PYTHONPATH=. python benchmarks/redis_slow_link.py [--latency-ms 50] [--bytes-per-s 400e3]
        [--blocks 200] [--block-kib 16] [--seconds 8] [--tls] [--root DIR] [--json-out FILE]

Starts a redis-server of its own behind `tests/slow_proxy.py` (`--latency-ms` each way and a
bandwidth cap), queues `--blocks` frames on a `RedisTier` at once, as a commit's write-through
does, and after `--seconds` reports what reached Redis: bytes written, writes failed, batches cut
by their deadline (`write_deadline_s`, 2 s by default), writes dropped, breaker trips (reads go
by that breaker too), the writer's measured time per SET where it has one, and the keys Redis
holds. `--tls` puts the redis-server behind TLS (a throwaway CA): the tier then pipelines each
batch through Python (a TLS socket's methods need the GIL), where over plain TCP its lanes stream
them from the core. `--root DIR` imports prefixcache from another checkout (a "before"), this
script and the proxy from this one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-ms", type=float, default=50.0, help="added each way: 100 ms round trips")
    parser.add_argument("--bytes-per-s", type=float, default=400e3, help="the link's bandwidth cap")
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the writer gets")
    parser.add_argument("--tls", action="store_true", help="Redis behind TLS: batches pipelined by Python")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout prefixcache is imported from")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.latency_ms < 0:
        parser.error("--latency-ms must be >= 0")
    for flag, value in (
        ("--bytes-per-s", args.bytes_per_s),
        ("--blocks", args.blocks),
        ("--block-kib", args.block_kib),
        ("--seconds", args.seconds),
    ):
        if value <= 0:
            parser.error(f"{flag} must be > 0")
    if not (args.root / "prefixcache" / "__init__.py").is_file():
        parser.error(f"--root {args.root}: no prefixcache package there")
    sys.path[:0] = [str(args.root.resolve()), str(ROOT)]

    from prefixcache.tiers.redis import RedisOptions, RedisTier
    from tests.slow_proxy import SlowProxy
    from tests.support.redis_server import RedisServer, make_tls_files

    frame = os.urandom(args.block_kib << 10)
    with tempfile.TemporaryDirectory() as workdir:
        tls = make_tls_files(Path(workdir) / "tls") if args.tls else None
        server = RedisServer(Path(workdir) / "redis", tls=tls).start()
        try:
            with SlowProxy(server.port, args.latency_ms / 1e3, args.bytes_per_s) as proxy:
                url = proxy.url.replace("redis://", "rediss://") if tls else proxy.url
                # Reads' timeout above a round trip, so that the probe at start-up answers.
                options = RedisOptions(
                    url=url, key_prefix="slow", socket_timeout_s=1.0, tls_ca_file=str(tls.ca) if tls else None
                )
                with RedisTier(options) as tier:
                    started = time.perf_counter()
                    for i in range(args.blocks):
                        tier.submit("ns", i.to_bytes(8, "big"), frame)
                    idle = tier.wait_idle(args.seconds)
                    elapsed = time.perf_counter() - started
                    stats = tier.stats()
            with server.client() as client:
                held = sum(1 for _ in client.scan_iter(match="slow*", count=1000))
        finally:
            server.stop()
    report = {
        "root": str(args.root),
        "tls": args.tls,
        "blocks": args.blocks,
        "bytes_queued": args.blocks * len(frame),
        "bytes_written": stats.bytes_written,
        "keys_in_redis": held,
        "writes_failed": stats.writes_failed,
        "write_deadlines": stats.write_deadlines,
        "spills_dropped": stats.spills_dropped,
        "breaker_trips": stats.breaker_trips,
        "write_set_s": getattr(stats, "write_set_s", None),  # None: a checkout without the measured pace
        "idle": idle,
        "seconds": round(elapsed, 3),
    }
    print(
        "| root | link | bytes written of queued | keys in Redis | failed | deadlines | dropped | breaker trips | s per SET | idle |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    pace = "—" if report["write_set_s"] is None else f"{report['write_set_s']:.3f}"
    print(
        f"| {args.root} | {'TLS' if args.tls else 'TCP'} | {report['bytes_written']:,} of {report['bytes_queued']:,} | {held} | "
        f"{report['writes_failed']} | {report['write_deadlines']} | {report['spills_dropped']} | "
        f"{report['breaker_trips']} | {pace} | {idle} |"
    )
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
