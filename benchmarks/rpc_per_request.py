"""RPCs per worker request: what each of Lookup, Reserve, Commit and Release costs a same-host worker.

    python benchmarks/rpc_per_request.py [--requests 300] [--prompt-tokens 2048] [--suffix 256]

Starts `prefixcache serve` as its own process, attaches like a worker (same host: the host tier
mapped), stores a shared prefix, then replays the worker's per-request sequence N times:
Lookup (with a lease) -> read the hit through shared memory -> store the new suffix blocks
(Reserve + write the mapped slots + Commit, as `CacheClient.store` does) -> Release. It prints the wall time of each call,
mean and p50, and which of them sit before the first token (only Lookup and the read do: the
store and the release run after the response has streamed). Layout: Llama-3-8B-shaped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="shared, cached prefix")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens per request (stored after it)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    size = LAYOUT.block_size
    suffix_blocks = args.suffix // size
    process, address = start_service("--host-capacity", "4GiB", "--block-size", str(size))
    try:
        client = CacheClient(address, timeout_s=30)
        client.attach("bench-model", LAYOUT, same_host=True)
        prefix = list(range(args.prompt_tokens))
        client.store(prefix, torch.zeros((args.prompt_tokens // size, *LAYOUT.block_shape), dtype=torch.float16))
        kv = torch.ones((suffix_blocks, *LAYOUT.block_shape), dtype=torch.float16)
        stages: dict[str, list[float]] = {
            "lookup": [],
            "read": [],
            "reserve": [],
            "write": [],
            "commit": [],
            "release": [],
        }
        ns_id = client.attachment.namespace_id
        for request in range(args.requests):
            tokens = prefix + [100_000 + request * args.suffix + i for i in range(args.suffix)]
            t0 = time.perf_counter()
            hit = client.lookup(tokens, take_lease=True)
            t1 = time.perf_counter()
            client.read(hit)
            t2 = time.perf_counter()
            # client.store's same-host path, step by step (CacheClient._store_shared)
            reservation = client._stub.Reserve(pb.ReserveRequest(namespace_id=ns_id, block_count=len(kv)))
            t3 = time.perf_counter()
            client._pools.scatter(list(reservation.slots), kv[: len(reservation.slots)])
            t4 = time.perf_counter()
            client._stub.Commit(
                pb.CommitRequest(
                    namespace_id=ns_id, tokens=tokens, start_block=hit.blocks, reservation_id=reservation.reservation_id
                )
            )
            t5 = time.perf_counter()
            client.release(hit)
            t6 = time.perf_counter()
            for name, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                stages[name].append(seconds * 1e3)
        report = {name: {"mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v)} for name, v in stages.items()}
        report["shared_memory"] = client.attachment.shared_memory
        client.close()
    finally:
        process.terminate()
        process.wait(30)
    print(f"{'stage':<24}{'mean ms':>10}{'p50 ms':>10}   (before the first token: lookup, read)")
    for name in stages:
        print(f"{name:<24}{report[name]['mean_ms']:>10.3f}{report[name]['p50_ms']:>10.3f}")
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
