"""What the vLLM connector's copies cost on a CPU host: a hit loaded into vLLM's paged cache, and
new blocks saved out of it, through a real service's shared memory.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_copy_cost.py [--blocks 48] [--layers 12]
        [--rounds 40] [--host-capacity 1GiB] [--root TREE] [--json-out FILE]

A real `prefixcache serve` holds a prompt of `--blocks` 32-token blocks; a `PagedCache` over
tensors laid out as vLLM's CPU attention backend lays them out (`CPU_ATTN`, `[blocks, kv_heads,
32, 2 * head_dim]` per layer) is what the worker copies into and out of. Each round times, in
alternation (A B A B on the same lease's blocks):
- load, staged (before): `read` into a fresh tensor, then `PagedCache.load` (two copies);
- load, direct (after, the worker on CPU): `read_into`, each mapped run copied straight into
  vLLM's blocks (one copy);
- save, the step's part: `PagedCache.gather` of the blocks into a fresh tensor;
- save, the save thread's part: `CacheClient.store` (copy into reserved slots + Commit);
- save in place, the step's part (the worker on CPU): `reserve_mapped` (the spare reservation
  the last Commit made) and `PagedCache.gather_into` the mapped slots (one copy);
- save in place, the save thread's part: `commit_reserved` (the Commit alone).
The two saves alternate which goes first; each save is read back and compared (untimed).
Medians and p90 in microseconds per request, and GB/s of KV moved; the ratios are
direct/staged and in place/staged (step + thread). `--root`: time another checkout's
prefixcache (an older one without `read_into` or `reserve_mapped` times what it has), for a
before/after of the copies themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]

BLOCK = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=48, help="blocks of the hit and of the save")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--host-capacity",
        default="1GiB",
        help="the service's host tier: slots this process never touched fault on first write, so a "
        "tier much larger than the rounds' stores times a fresh service, a small one (64MiB) a tier "
        "in use, whose slots this worker has written before (default %(default)s)",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose prefixcache is timed")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    sys.path.insert(0, str(args.root.resolve()))

    import torch
    from service_process import start_service

    from prefixcache.client.api import CacheClient
    from prefixcache.config import KVLayout
    from prefixcache.integrations.vllm.paged import KVPacking, PagedCache, PagedLayer

    torch.set_num_threads(1)  # as vLLM's worker thread copies: one core
    layout = KVLayout(
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=BLOCK, dtype="bfloat16"
    )
    paged_blocks = 4 * args.blocks + 1
    tensors = [
        torch.zeros((paged_blocks, args.kv_heads, BLOCK, 2 * args.head_dim), dtype=torch.bfloat16)
        for _ in range(args.layers)
    ]
    paged = PagedCache([PagedLayer.of(t, KVPacking.TOKEN_STACKED, args.head_dim) for t in tensors])
    # vLLM's blocks of a request are scattered over its pool: every other block, from 1
    block_ids = (tuple(range(1, 2 * args.blocks + 1, 2)),)
    nbytes = args.blocks * layout.block_bytes
    service, address = start_service("--host-capacity", args.host_capacity, "--block-size", str(BLOCK))
    timings: dict[str, list[float]] = {
        "load, staged": [],
        "load, direct": [],
        "save: gather": [],
        "save: store": [],
        "save in place: gather": [],
        "save in place: commit": [],
    }
    if not hasattr(CacheClient, "read_into"):
        del timings["load, direct"]
    if not hasattr(CacheClient, "reserve_mapped"):
        del timings["save in place: gather"], timings["save in place: commit"]
    try:
        client = CacheClient(address, timeout_s=10)
        client.attach("copy-bench", layout, revision="r1")
        assert client.attachment.shared_memory, "the service's host tier must be mapped here"
        prompt = list(range(1, args.blocks * BLOCK + 2))
        kv = torch.randn((args.blocks, *layout.block_shape)).to(torch.bfloat16)
        # The service grants a Commit's spare reservation only from its layout's free slots, and only
        # where as many stay free: give the layout room first, as a tier in use has (stored, then
        # evicted: its chunks keep the layout).
        room = [7, *range(1, 4 * args.blocks * BLOCK)]
        with CacheClient(address, timeout_s=10) as other:  # another writer: its store size is not this one's
            other.attach("copy-bench", layout, revision="r1")
            other.store(room, torch.zeros((4 * args.blocks, *layout.block_shape), dtype=torch.bfloat16))
            other.evict(prefix_tokens=room[:BLOCK])
        client.store(prompt, kv)
        hit = client.lookup(prompt)
        assert hit.blocks == args.blocks and hit.mapped_blocks == args.blocks, hit

        def staged() -> None:
            paged.load(client.read(hit), block_ids)

        def direct() -> None:
            client.read_into(
                hit, lambda first, view: paged.load(view, tuple(ids[first : first + len(view)] for ids in block_ids))
            )

        def staged_save(tokens: list[int]) -> float:
            saved = paged.gather(block_ids)
            gathered = time.perf_counter()
            client.store(tokens, saved)
            return gathered

        def in_place_save(tokens: list[int]) -> float:
            reservation = client.reserve_mapped(args.blocks)
            assert reservation is not None, "the last store's Commit reserved this store's slots"
            for first, view in client.reserved_pieces(reservation):
                paged.gather_into(tuple(ids[first : first + len(view)] for ids in block_ids), view)
            written = time.perf_counter()
            assert client.commit_reserved(reservation, tokens).stored == args.blocks, "every block is new"
            return written

        try:
            for number in range(args.rounds + 2):  # the first two rounds warm up
                for name, run in (("load, staged", staged), ("load, direct", direct)):
                    if name not in timings:
                        continue
                    if hit.lease_deadline is None or hit.lease_deadline - time.monotonic() < 1.0:
                        client.release(hit)
                        hit = client.lookup(prompt)
                    started = time.perf_counter()
                    run()
                    if number >= 2:
                        timings[name].append(time.perf_counter() - started)
                assert torch.equal(paged.gather(block_ids), kv), "the loads put the stored blocks in place"
                saves = [("save: gather", "save: store", staged_save)]
                if "save in place: gather" in timings:
                    saves.insert(number % 2, ("save in place: gather", "save in place: commit", in_place_save))
                for kind, (step, thread, save) in enumerate(saves):
                    # every block new (its first token differs): a store of new blocks, not deduplicated
                    fresh = [100000 * (kind + 1) + number, *prompt[1 : args.blocks * BLOCK]]
                    started = time.perf_counter()
                    mid = save(fresh)
                    ended = time.perf_counter()
                    if number >= 2:
                        timings[step].append(mid - started)
                        timings[thread].append(ended - mid)
                    back = client.lookup([*fresh, 1])
                    try:
                        assert torch.equal(client.read(back), kv), f"{step}: the save stored vLLM's blocks"
                    finally:
                        client.release(back)
                    client.evict(prefix_tokens=fresh[:BLOCK])  # the tier stays as empty as each round found it
        finally:
            client.release(hit)
            client.close()
    finally:
        service.terminate()
        service.wait(timeout=30)

    rows = {
        name: {
            "p50_us": statistics.median(values) * 1e6,
            "p90_us": statistics.quantiles(values, n=10)[-1] * 1e6,
            "gb_per_s": nbytes / statistics.median(values) / 1e9,
        }
        for name, values in timings.items()
    }
    ratio = rows["load, direct"]["p50_us"] / rows["load, staged"]["p50_us"] if "load, direct" in rows else None
    in_place = (
        (rows["save in place: gather"]["p50_us"] + rows["save in place: commit"]["p50_us"])
        / (rows["save: gather"]["p50_us"] + rows["save: store"]["p50_us"])
        if "save in place: gather" in rows
        else None
    )
    print(
        f"{args.root.resolve()}: {args.blocks} blocks of {layout.block_bytes / 1024:.0f} KiB "
        f"({nbytes / 2**20:.1f} MiB), {args.layers} layers, {args.rounds} rounds, host tier {args.host_capacity}"
    )
    print(f"{'copy':<22} {'p50 us':>9} {'p90 us':>9} {'GB/s':>7}")
    for name, row in rows.items():
        print(f"{name:<22} {row['p50_us']:>9.0f} {row['p90_us']:>9.0f} {row['gb_per_s']:>7.2f}")
    if ratio is not None:
        print(f"load, direct / staged (p50): {ratio:.2f}x")
    if in_place is not None:
        print(f"save, in place / staged (p50, step + thread): {in_place:.2f}x")
    summary = {
        "root": str(args.root.resolve()),
        "blocks": args.blocks,
        "host_capacity": args.host_capacity,
        "layers": args.layers,
        "bytes": nbytes,
        "rows": rows,
        "direct_over_staged": ratio,
        "in_place_over_staged": in_place,
    }
    print(json.dumps(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
