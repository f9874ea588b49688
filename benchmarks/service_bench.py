"""Service benchmark: Lookup latency and throughput, KV bandwidth through shared memory and gRPC.

    PYTHONPATH=. python benchmarks/service_bench.py [--fetch-mib 256] [--seconds 5] [--json-out FILE]

Starts `python -m prefixcache_services serve` as its own process (its own GIL, as in
production) with a Llama-3-8B-shaped layout (32 layers, 8 KV heads, head_dim
128, fp16: 2 MiB per 16-token block), stores an 8k-token prompt, then measures:

- Lookup latency p50/p99 (hits of 2k- and 8k-token prompts, sequential, one
  client, through `CacheClient.lookup`);
- Lookup throughput of 2k-token prompts with concurrent clients (asyncio gRPC
  clients in separate processes), and the service's CPU time per call;
- read bandwidth of a leased hit through the mapped shared memory vs a plain
  memcpy of the same bytes (same source, same destination, same run);
- read bandwidth through the Fetch stream (a client that does not map memory).

Prints a table and a JSON object. Targets (issue 4): >= 3,000 Lookup/s for 2k
tokens on 2 cores; shared memory >= 80% of memcpy; stream >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service_process import start_service as start_process  # noqa: E402

from prefixcache.client import CacheClient  # noqa: E402
from prefixcache.config import KVLayout  # noqa: E402

LAYOUT = KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype="float16")


def start_service(host_capacity: str, workers: int | None) -> tuple[subprocess.Popen, str]:
    flags = ("--workers", str(workers)) if workers is not None else ()  # else serve's default
    return start_process("--host-capacity", host_capacity, *flags, timeout_s=60)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> dict[str, float]:
    values = np.array(samples) * 1e3
    return {
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
        "mean_ms": float(values.mean()),
    }


def lookup_latency(client: CacheClient, tokens: list[int], calls: int) -> dict[str, float]:
    for _ in range(50):
        client.lookup(tokens, take_lease=False)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        hit = client.lookup(tokens, take_lease=False)
        samples.append(time.perf_counter() - started)
    assert hit.hit_tokens == len(tokens) // 16 * 16, hit
    return percentiles(samples)


def _load_process(
    address: str, namespace_id: str, tokens: list[int], in_flight: int, seconds: float, start_at: float, results
) -> None:
    import grpc

    from prefixcache.rpc import cache_pb2 as pb
    from prefixcache.rpc import cache_pb2_grpc as pb_grpc

    async def run() -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PrefixCacheStub(channel)
            request = pb.LookupRequest(namespace_id=namespace_id, tokens=tokens)
            while time.time() < start_at:
                await asyncio.sleep(0.001)
            stop, done = time.time() + seconds, 0

            async def worker() -> None:
                nonlocal done
                while time.time() < stop:
                    await stub.Lookup(request)
                    done += 1

            await asyncio.gather(*(worker() for _ in range(in_flight)))
            return done

    results.put(asyncio.run(run()))


def lookup_throughput(
    address: str, pid: int, namespace_id: str, tokens: list[int], processes: int, in_flight: int, seconds: float
) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 3.0  # after every process has imported grpc
    workers = [
        context.Process(
            target=_load_process, args=(address, namespace_id, tokens, in_flight, seconds, start_at, results)
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    while time.time() < start_at:
        time.sleep(0.001)
    cpu_before = cpu_seconds(pid)
    calls = sum(results.get(timeout=seconds + 60) for _ in workers)
    cpu_used = cpu_seconds(pid) - cpu_before
    for worker in workers:
        worker.join()
    return {
        "clients": processes * in_flight,
        "processes": processes,
        "rpc_per_s": calls / seconds,
        "service_cpu_us_per_call": cpu_used / calls * 1e6,
        "service_cores_used": cpu_used / seconds,
    }


def bandwidth(fn, nbytes: int, repeats: int) -> float:
    fn()  # warm: page faults, allocator
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return nbytes / float(np.median(times)) / 1e9


def fetch_bandwidth(
    local: CacheClient, remote: CacheClient, wide: CacheClient, tokens: list[int], repeats: int
) -> dict[str, float]:
    """`wide`: attached with 32-token engine blocks (two of the service's per block), so its read
    reorders the token axis into its own blocks: the cost of an engine block size unlike the service's."""
    hit = local.lookup(tokens)
    out = torch.empty((hit.blocks, *LAYOUT.block_shape), dtype=torch.float16)
    pools = local._pools  # the same mapped bytes the client reads, for the memcpy baseline
    nbytes = out.numel() * out.element_size()
    shm = bandwidth(lambda: local.read(hit, out=out), nbytes, repeats)
    memcpy = bandwidth(lambda: pools.gather(hit.locations, out), nbytes, repeats)  # a copy per run of slots
    expected = out.clone()
    remote_hit = remote.lookup(tokens)
    stream = bandwidth(lambda: remote.read(remote_hit, out=out), nbytes, repeats)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    wide_hit = wide.lookup(tokens)
    assert wide_hit.blocks * 2 == hit.blocks, "a whole number of 32-token blocks"
    wide_out = torch.empty((wide_hit.blocks, *wide.attachment.layout.block_shape), dtype=torch.float16)
    split = bandwidth(lambda: wide.read(wide_hit, out=wide_out), nbytes, repeats)
    local.release(hit)
    remote.release(remote_hit)
    wide.release(wide_hit)
    return {
        "bytes": nbytes,
        "shm_GBps": shm,
        "memcpy_GBps": memcpy,
        "shm_vs_memcpy": shm / memcpy,
        "shm_engine_blocks_of_2_GBps": split,
        "engine_blocks_of_2_vs_1": split / shm,
        "stream_GBps": stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fetch-mib", type=int, default=256, help="bytes read per bandwidth sample (MiB)")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of the throughput run")
    parser.add_argument("--calls", type=int, default=2000, help="sequential lookups per latency sample")
    parser.add_argument("--processes", type=int, default=2, help="load-generating client processes")
    parser.add_argument("--in-flight", type=int, default=8, help="concurrent lookups per client process")
    parser.add_argument("--workers", type=int, default=None, help="serve --workers (default: serve's own)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    prompt_tokens = 8192
    process, address = start_service(f"{prompt_tokens // 16 * LAYOUT.block_bytes + (64 << 20)}", args.workers)
    try:
        local, remote = CacheClient(address, timeout_s=30), CacheClient(address, timeout_s=30)
        wide = CacheClient(address, timeout_s=30)
        namespace_id = local.attach("llama-3-8b-shaped", LAYOUT).namespace_id
        remote.attach("llama-3-8b-shaped", LAYOUT, same_host=False)
        wide.attach("llama-3-8b-shaped", dataclasses.replace(LAYOUT, block_size=2 * LAYOUT.block_size))
        tokens = [int(t) for t in np.random.default_rng(0).integers(0, 128_000, prompt_tokens)]
        kv = torch.randn((prompt_tokens // 16, *LAYOUT.block_shape), dtype=torch.float16)
        assert local.store(tokens, kv).stored == prompt_tokens // 16
        del kv
        results = {
            "layout": {
                "layers": LAYOUT.layers,
                "kv_heads": LAYOUT.kv_heads,
                "head_dim": LAYOUT.head_dim,
                "block_size": LAYOUT.block_size,
                "dtype": LAYOUT.dtype.value,
                "block_bytes": LAYOUT.block_bytes,
            },
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": os.getloadavg()[0],
            "service_workers": args.workers if args.workers is not None else "serve default",
            "lookup_latency_2k": lookup_latency(local, tokens[:2048], args.calls),
            "lookup_latency_8k": lookup_latency(local, tokens, args.calls // 2),
            "lookup_throughput_2k": lookup_throughput(
                address, process.pid, namespace_id, tokens[:2048], args.processes, args.in_flight, args.seconds
            ),
            "fetch": fetch_bandwidth(
                local, remote, wide, tokens[: args.fetch_mib * 1024 * 1024 // LAYOUT.bytes_per_token], repeats=7
            ),
        }
        local.close()
        remote.close()
        wide.close()
    finally:
        process.terminate()
        process.wait(30)
    print_table(results)
    print(json.dumps(results, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


def print_table(r: dict) -> None:
    t, f = r["lookup_throughput_2k"], r["fetch"]
    short, long = r["lookup_latency_2k"], r["lookup_latency_8k"]
    rows = [
        ("Lookup 2k tokens, p50 / p99", f"{short['p50_ms']:.3f} / {short['p99_ms']:.3f} ms", ""),
        ("Lookup 8k tokens, p50 / p99", f"{long['p50_ms']:.3f} / {long['p99_ms']:.3f} ms", ""),
        (f"Lookup 2k throughput, {t['clients']} clients", f"{t['rpc_per_s']:,.0f} RPC/s", ">= 3,000 RPC/s"),
        (
            "  service CPU per Lookup",
            f"{t['service_cpu_us_per_call']:.0f} us ({t['service_cores_used']:.2f} cores)",
            "",
        ),
        (f"Read {f['bytes'] / 2**20:.0f} MiB via shared memory", f"{f['shm_GBps']:.2f} GB/s", ""),
        ("  plain memcpy, same bytes", f"{f['memcpy_GBps']:.2f} GB/s", ""),
        ("  shared memory / memcpy", f"{f['shm_vs_memcpy']:.0%}", ">= 80%"),
        (
            "  into 32-token engine blocks (2 a block)",
            f"{f['shm_engine_blocks_of_2_GBps']:.2f} GB/s ({f['engine_blocks_of_2_vs_1']:.0%})",
            "",
        ),
        ("Read via gRPC Fetch stream", f"{f['stream_GBps']:.2f} GB/s", ">= 1 GB/s"),
    ]
    width = max(len(name) for name, _, _ in rows)
    print(f"{'measure'.ljust(width)}  {'result':>28}  target")
    for name, value, target in rows:
        print(f"{name.ljust(width)}  {value:>28}  {target}")


if __name__ == "__main__":
    main()
