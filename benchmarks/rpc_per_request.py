"""RPCs per worker request: what each of Lookup, Reserve, Commit and Release costs a same-host worker.

    python benchmarks/rpc_per_request.py [--requests 300] [--prompt-tokens 2048] [--suffix 256]
        [--small] [--host-capacity 4GiB] [--redis] [--service-root DIR]

Starts `prefixcache serve` as its own process, attaches like a worker (same host: the host tier
mapped), stores a shared prefix, then replays the worker's per-request sequence N times:
Lookup (with a lease) -> read the hit through shared memory -> store the new suffix blocks ->
Release. Each way in turn, so that load drifts hit all alike:
- two calls: Reserve + write the mapped slots + Commit, each timed (the client before issue 31);
- one call: `CacheClient.store`, whose Commit also reserves the next store's slots
  (`reserve_next`): a store that finds that spare writes and commits, one RPC;
- returned: as one call, but the lease goes back with the next request's Lookup
  (`lookup(release=...)`, what the vLLM connector does with leases vLLM did not need) instead
  of a Release: two RPCs per request;
- socket: as returned, over the service's same-host control socket instead of gRPC (what a
  same-host client does by default; the first three modes use `control_socket=False`).
Four ways, then, in alternating eighths (A B C D A B C D).
It prints the wall time of each stage, mean and p50, and the service's and the client's CPU per request in each
mode (from /proc), and the share of stores that found a spare reservation (one call, no Reserve). Only Lookup and the read sit before the first token: the store and the
Release run after the response has streamed. Layout: Llama-3-8B-shaped (`--small`: the vLLM
fleet benchmark's 4-layer model, 64 KiB blocks of 32 tokens, where the RPCs are the cost).
`--redis`: the service writes every stored block through to a redis-server of its own (the cost
of the cross-host shape's saves), whose CPU per request is reported too. `--service-root DIR`:
the service runs from another checkout (a "before"), this script and client from this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.service_process import start_service  # noqa: E402
from prefixcache.client import CacheClient  # noqa: E402
from prefixcache.config import KVLayout  # noqa: E402
from prefixcache.rpc import cache_pb2 as pb  # noqa: E402

LAYOUT = KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype="float16")
SMALL = KVLayout(layers=4, kv_heads=2, head_dim=64, block_size=32, dtype="bfloat16")  # vllm_fleet_bench's model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="shared, cached prefix")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens per request (stored after it)")
    parser.add_argument("--small", action="store_true", help="vllm_fleet_bench's 4-layer model (64 KiB blocks)")
    parser.add_argument(
        "--host-capacity",
        default="4GiB",
        help="the service's host tier; one smaller than the stores' total fills, and LRU evicts from then on",
    )
    parser.add_argument("--redis", action="store_true", help="a Redis tier on a redis-server of its own")
    parser.add_argument("--service-root", type=Path, default=ROOT, help="the checkout the service runs from")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if not (args.service_root / "services" / "cache_server").is_dir():
        parser.error(f"--service-root: {args.service_root} is not a prefixcache checkout (no services/cache_server)")
    layout = SMALL if args.small else LAYOUT
    size = layout.block_size
    suffix_blocks = args.suffix // size
    flags = ["--host-capacity", args.host_capacity, "--block-size", str(size)]
    redis = None
    if args.redis:
        from tests.support.redis_server import RedisServer

        redis_dir = tempfile.TemporaryDirectory(prefix="rpc-redis-")
        redis = RedisServer(Path(redis_dir.name)).start()
        flags += ["--redis-url", redis.url]
    process, address = start_service(*flags, root=args.service_root)
    redis_pid = redis.process.pid if redis is not None and redis.process is not None else None
    try:
        grpc_client = CacheClient(address, timeout_s=30, control_socket=False)
        socket_client = CacheClient(address, timeout_s=30)
        grpc_client.attach("bench-model", layout, same_host=True)
        socket_client.attach("bench-model", layout, same_host=True)
        assert socket_client._control is not None, "the service announced no control socket"
        client = grpc_client
        prefix = list(range(args.prompt_tokens))
        dtype = layout.dtype.torch
        client.store(prefix, torch.zeros((args.prompt_tokens // size, *layout.block_shape), dtype=dtype))
        kv = torch.ones((suffix_blocks, *layout.block_shape), dtype=dtype)
        ns_id = client.attachment.namespace_id
        modes: dict[str, dict[str, list[float]]] = {
            "two_calls": {name: [] for name in ("lookup", "read", "reserve", "write", "commit", "release")},
            "one_call": {name: [] for name in ("lookup", "read", "store", "release")},
            "returned": {name: [] for name in ("lookup", "read", "store")},
            "socket": {name: [] for name in ("lookup", "read", "store")},
        }
        cpu = {mode: 0.0 for mode in modes}
        redis_cpu = {mode: 0.0 for mode in modes}  # redis-server's, with --redis
        client_cpu = {mode: 0.0 for mode in modes}  # this process: the caller's side of the calls and copies
        one_call = {mode: 0 for mode in modes}  # stores that found a spare reservation (no Reserve)
        share = max(1, args.requests // (2 * len(modes)))
        returning: list = []  # a lease waiting for its mode's next Lookup
        returning_mode = ""
        for request in range(args.requests):
            mode = list(modes)[(request // share) % len(modes)]
            if returning and mode != returning_mode:
                client.release(returning.pop())  # leaving the mode: not timed
            client = socket_client if mode == "socket" else grpc_client
            tokens = prefix + [100_000 + request * args.suffix + i for i in range(args.suffix)]
            cpu_before, client_before = _cpu_s(process.pid), time.process_time()
            redis_before = _cpu_s(redis_pid) if redis_pid else 0.0
            t0 = time.perf_counter()
            hit = client.lookup(tokens, take_lease=True, release=returning)
            returning = []
            t1 = time.perf_counter()
            client.read(hit)
            t2 = time.perf_counter()
            if mode != "two_calls":
                spare = client._spare  # the reservation a store that fits makes no Reserve for
                one_call[mode] += spare is not None and len(spare[0].slots) >= len(kv) and time.monotonic() < spare[1]
                client.store(tokens, kv, start_block=hit.blocks)
                marks = [t0, t1, t2, time.perf_counter()]
            else:  # CacheClient._store_shared before it kept a spare reservation, step by step
                reservation = client._stub.Reserve(pb.ReserveRequest(namespace_id=ns_id, block_count=len(kv)))
                t3 = time.perf_counter()
                client._pools.scatter(list(reservation.slots), kv[: len(reservation.slots)])
                t4 = time.perf_counter()
                client._stub.Commit(
                    pb.CommitRequest(
                        namespace_id=ns_id,
                        tokens=tokens,
                        start_block=hit.blocks,
                        reservation_id=reservation.reservation_id,
                    )
                )
                marks = [t0, t1, t2, t3, t4, time.perf_counter()]
            if mode in ("returned", "socket"):
                returning, returning_mode = [hit], mode  # goes back with this mode's next Lookup
            else:
                client.release(hit)
                marks.append(time.perf_counter())
            cpu[mode] += _cpu_s(process.pid) - cpu_before
            redis_cpu[mode] += (_cpu_s(redis_pid) - redis_before) if redis_pid else 0.0
            client_cpu[mode] += time.process_time() - client_before
            for name, start, end in zip(modes[mode], marks, marks[1:]):
                modes[mode][name].append((end - start) * 1e3)
        if returning:
            client.release(returning.pop())
        report: dict = {
            mode: {name: {"mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v)} for name, v in stages.items()}
            for mode, stages in modes.items()
        }
        report["service_cpu_ms_per_request"] = {
            mode: 1e3 * cpu[mode] / max(1, len(stages["lookup"])) for mode, stages in modes.items()
        }
        report["redis_cpu_ms_per_request"] = {
            mode: 1e3 * redis_cpu[mode] / max(1, len(stages["lookup"])) for mode, stages in modes.items()
        }
        report["client_cpu_ms_per_request"] = {
            mode: 1e3 * client_cpu[mode] / max(1, len(stages["lookup"])) for mode, stages in modes.items()
        }
        report["stores_without_reserve"] = {
            mode: one_call[mode] / max(1, len(stages["lookup"])) for mode, stages in modes.items()
        }
        report["shared_memory"] = grpc_client.attachment.shared_memory
        grpc_client.close()
        socket_client.close()
    finally:
        process.terminate()
        process.wait(30)
        if redis is not None:
            redis.stop()
            redis_dir.cleanup()
    for mode in modes:
        print(f"{mode:<24}{'mean ms':>10}{'p50 ms':>10}   (before the first token: lookup, read)")
        for name in modes[mode]:
            print(f"  {name:<22}{report[mode][name]['mean_ms']:>10.3f}{report[mode][name]['p50_ms']:>10.3f}")
        print(f"  {'service CPU / request':<22}{report['service_cpu_ms_per_request'][mode]:>10.3f}")
        if args.redis:
            print(f"  {'redis CPU / request':<22}{report['redis_cpu_ms_per_request'][mode]:>10.3f}")
        print(f"  {'client CPU / request':<22}{report['client_cpu_ms_per_request'][mode]:>10.3f}")
        print(f"  {'stores without Reserve':<22}{report['stores_without_reserve'][mode]:>10.0%}")
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
