"""KV format benchmark: bf16 vs fp8 (float8_e4m3fn) of the same layout.

    PYTHONPATH=. python benchmarks/kv_dtype_bench.py [--tokens 1024] [--repeats 5] [--json-out FILE]

Capacity (exact, from `KVLayout`): bytes per token, bytes per block and blocks (and tokens)
per GiB of a tier, for a Llama-3-8B-shaped layout (32 layers, 8 KV heads, head_dim 128) and
the reference worker's tiny model (4 layers, 2 KV heads, head_dim 32), 16-token blocks.

Measured (one `prefixcache serve` process per format, loopback gRPC): the time to Store a
`--tokens`-token prompt's KV and to read its hit back through the Fetch stream (a client that
does not map memory) and through the mapped shared memory; every read is checked byte for
byte. The median of `--repeats` runs; timings on a shared machine are noisy, ratios less so.
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
sys.path.insert(0, str(ROOT))

from service_process import start_service  # noqa: E402

from prefixcache.client import CacheClient  # noqa: E402
from prefixcache.config import DType, KVLayout  # noqa: E402

GiB = 1 << 30
SHAPES = {"Llama-3-8B": (32, 8, 128), "tiny": (4, 2, 32)}
FORMATS = (DType.BFLOAT16, DType.FLOAT8_E4M3FN)


def capacity_rows() -> list[dict]:
    rows = []
    for name, (layers, kv_heads, head_dim) in SHAPES.items():
        for dtype in FORMATS:
            layout = KVLayout(layers, kv_heads, head_dim, 16, dtype)
            rows.append(
                {
                    "layout": name,
                    "dtype": dtype.value,
                    "bytes_per_token": layout.bytes_per_token,
                    "block_bytes": layout.block_bytes,
                    "blocks_per_GiB": GiB // layout.block_bytes,
                    "tokens_per_GiB": GiB // layout.block_bytes * layout.block_size,
                }
            )
    return rows


def median_s(action, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(dtype: DType, tokens: int, repeats: int) -> dict:
    layout = KVLayout(*SHAPES["Llama-3-8B"], 16, dtype)
    kv_bytes = tokens * layout.bytes_per_token
    process, address = start_service("--host-capacity", str((repeats + 1) * kv_bytes))
    try:
        with CacheClient(address) as remote, CacheClient(address) as local:
            remote.attach("kv-dtype-bench", layout, same_host=False)
            local.attach("kv-dtype-bench", layout, same_host=True)
            blocks = tokens // layout.block_size
            kv = torch.randint(0, 256, (blocks, layout.block_bytes), dtype=torch.uint8).view(dtype.torch)
            kv = kv.reshape(blocks, *layout.block_shape)
            prompts = [[seed * 1_000_000 + i for i in range(tokens)] for seed in range(repeats)]
            it = iter(prompts)
            store_s = median_s(lambda: remote.store(next(it), kv), repeats)  # each a new prompt: a real store
            out = torch.empty_like(kv)
            hit = remote.lookup(prompts[0])
            fetch_s = median_s(lambda: remote.read(hit, out=out), repeats)
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), "Fetch was not byte-exact"
            remote.release(hit)
            mapped = local.lookup(prompts[0])
            shm_s = median_s(lambda: local.read(mapped, out=out), repeats)
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), "shared memory was not byte-exact"
            local.release(mapped)
    finally:
        process.terminate()
        process.wait(30)
    return {
        "dtype": dtype.value,
        "tokens": tokens,
        "bytes": kv_bytes,
        "store_ms": store_s * 1e3,
        "fetch_ms": fetch_s * 1e3,
        "shm_read_ms": shm_s * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens stored and read per sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    capacity = capacity_rows()
    print(f"{'layout':<12}{'dtype':<16}{'B/token':>10}{'block':>12}{'blocks/GiB':>12}{'tokens/GiB':>12}")
    for row in capacity:
        print(
            f"{row['layout']:<12}{row['dtype']:<16}{row['bytes_per_token']:>10,}{row['block_bytes']:>12,}"
            f"{row['blocks_per_GiB']:>12,}{row['tokens_per_GiB']:>12,}"
        )
    moved = [measure(dtype, args.tokens, args.repeats) for dtype in FORMATS]
    print(f"\nLlama-3-8B layout, {args.tokens}-token prompt, median of {args.repeats}:")
    print(f"{'dtype':<16}{'MiB':>8}{'Store ms':>10}{'Fetch ms':>10}{'shm read ms':>13}")
    for row in moved:
        print(
            f"{row['dtype']:<16}{row['bytes'] / (1 << 20):>8.0f}{row['store_ms']:>10.1f}{row['fetch_ms']:>10.1f}"
            f"{row['shm_read_ms']:>13.1f}"
        )
    result = {"capacity": capacity, "moved": moved}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
