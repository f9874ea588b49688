"""GPU check of the co-located CUDA path: device tier, pinned host memory, CUDA IPC, bf16 exactness.

    PYTHONPATH=. python benchmarks/gpu_check.py [--json-out FILE]

On a machine without CUDA it says so and exits 0. On a CUDA machine it runs,
well within 8 minutes (about a minute on an H100/H200):

1. device tier: `DeviceTier` on cuda, write/read round trip of random bf16 bits;
   a `PrefixCache` with a device tier promotes a hit from host to device;
2. pinned host memory: the host tier's shared memory is page-locked
   (`is_pinned()`), and host->device copies from it vs from pageable memory;
3. a worker's mapping of the host tier is pinned in its own process, and a
   host-tier hit is read straight into GPU memory;
4. CUDA IPC: `python -m prefixcache_services serve --device-capacity ...` in its own
   process; this process attaches as a same-host worker, opens the device pool
   from its IPC handle, and reads a promoted hit device-to-device;
5. bf16 exactness: every byte read back (device tier, IPC, shared memory, gRPC
   stream) equals what was stored, NaN payloads included;
6. the vLLM connector's layer-by-layer loads (prefixcache/integrations/vllm/layers.py; where
   vLLM is importable): a 32-layer "forward" (a matmul per layer, reading that layer's loaded
   blocks) after a whole in-step load vs with the copies on a side stream, each layer waited
   for; the loaded bytes must equal the source, and the times are reported;
7. the connector's saves off the step (paged.py `HostCopy`): with a "forward" queued on the
   stream, `gather_later` must return before it has run (vs `gather`, which waits for it and
   the copy), and the saved bytes must be the blocks as they were when the save was queued,
   though a later kernel on the same stream overwrote them (a block vLLM reused).

Prints a table (and JSON); exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service_process import start_service as start_process  # noqa: E402

from prefixcache.cache import PrefixCache  # noqa: E402
from prefixcache.client import CacheClient  # noqa: E402
from prefixcache.config import CacheConfig, KVLayout, Namespace  # noqa: E402
from prefixcache.kinds import TierKind  # noqa: E402
from prefixcache.tiers.device import DeviceTier  # noqa: E402
from prefixcache.tiers.host import HostTier  # noqa: E402

LAYOUT = KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # 2 MiB blocks


def random_bits(blocks: int) -> torch.Tensor:
    """bf16 tensor of random bit patterns (NaNs and infinities included): only exact copies compare equal."""
    return torch.randint(-(2**15), 2**15, (blocks, *LAYOUT.block_shape), dtype=torch.int16).view(torch.bfloat16)


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def gbps(nbytes: int, fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def check_device_tier(rows: list) -> None:
    tier = DeviceTier(LAYOUT, 64 * LAYOUT.block_bytes, "cuda")
    data = random_bits(8)
    for slot in range(8):
        tier.write(slot * 3 % 64, data[slot].cuda())
    back = tier.read([slot * 3 % 64 for slot in range(8)])
    rows.append(("device tier write/read, bf16 bits", exact(back, data), f"{tier.num_slots} slots on {back.device}"))
    config = CacheConfig(host_capacity=64 * LAYOUT.block_bytes, device_capacity=16 * LAYOUT.block_bytes)
    host = HostTier(LAYOUT, config.host_capacity, f"pfx-gpucheck-{secrets.token_hex(4)}")
    cache = PrefixCache(config, LAYOUT, host, device=DeviceTier(LAYOUT, config.device_capacity, "cuda"))
    try:
        ns = cache.attach(Namespace("gpu-check", "", LAYOUT))
        tokens = list(range(8 * 16))
        cache.store(ns, tokens, data)
        hit = cache.lookup(ns, tokens)
        on_device = sum(1 for loc in hit.locations if loc.tier == TierKind.DEVICE)
        rows.append(("hit promoted host -> device", on_device == 8, f"{on_device}/8 blocks on device"))
        rows.append(
            (
                "promoted blocks read back exactly",
                exact(torch.cat([cache.tiers[loc.tier].read([loc.slot]).cpu() for loc in hit.locations]), data),
                "",
            )
        )
        pinned = host.storage.is_pinned()
        rows.append(("host tier shared memory is pinned", pinned, "cudaHostRegister"))
        pageable = torch.empty_like(host.storage)
        target = torch.empty(host.storage.shape, dtype=host.storage.dtype, device="cuda")
        nbytes = host.storage.numel() * host.storage.element_size()
        pinned_bw = gbps(nbytes, lambda: target.copy_(host.storage, non_blocking=True))
        pageable_bw = gbps(nbytes, lambda: target.copy_(pageable, non_blocking=True))
        rows.append(
            ("H2D from pinned shm vs pageable", pinned_bw > pageable_bw, f"{pinned_bw:.1f} vs {pageable_bw:.1f} GB/s")
        )
    finally:
        cache.close()


def start_service(device_blocks: int) -> tuple[subprocess.Popen, str]:
    return start_process(
        "--host-capacity",
        str(256 * LAYOUT.block_bytes),
        "--device-capacity",
        str(device_blocks * LAYOUT.block_bytes),
        grace="5s",
    )


def check_host_to_gpu(rows: list) -> None:
    """A service without a device tier: a worker's hit goes from the (pinned) shared memory to its GPU."""
    process, address = start_service(device_blocks=0)
    try:
        client = CacheClient(address, timeout_s=60)
        client.attach("gpu-check", LAYOUT)
        mapping = client._pools.host
        rows.append(
            (
                "worker's shm mapping is pinned too",
                bool(mapping is not None and mapping.is_pinned()),
                "cudaHostRegister per process",
            )
        )
        tokens, data = list(range(64 * 16)), random_bits(64)
        client.store(tokens, data)
        hit = client.lookup(tokens)
        out = torch.empty((64, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
        nbytes = out.numel() * out.element_size()
        h2d = gbps(nbytes, lambda: client.read(hit, out=out))
        pageable = data.clone()
        plain = gbps(nbytes, lambda: out.copy_(pageable))
        rows.append(
            (
                "host-tier hit read into GPU, bf16 exact",
                exact(out, data),
                f"{h2d:.1f} GB/s (pageable memcpy {plain:.1f})",
            )
        )
        client.release(hit)
        client.close()
    finally:
        process.terminate()
        rows.append(("service (host tier only) exits 0 after SIGTERM", process.wait(60) == 0, ""))


def check_ipc(rows: list) -> None:
    process, address = start_service(device_blocks=128)
    try:
        local, remote = CacheClient(address, timeout_s=60), CacheClient(address, timeout_s=60)
        attachment = local.attach("gpu-check", LAYOUT)
        remote.attach("gpu-check", LAYOUT, same_host=False)
        rows.append(
            (
                "worker maps host shm and device pool (IPC)",
                attachment.shared_memory and attachment.device_ipc,
                f"shm={attachment.shared_memory} ipc={attachment.device_ipc}",
            )
        )
        tokens, data = list(range(64 * 16)), random_bits(64)  # 128 MiB
        rows.append(("store through shared memory", local.store(tokens, data).stored == 64, "64 blocks"))
        hit = local.lookup(tokens)  # the hit promotes the blocks to the device tier
        tiers = {TierKind(int(t)).label for t in hit.locations.tiers}
        rows.append(("hit served from the device tier", tiers == {"device"}, f"tiers {sorted(tiers)}"))
        out = torch.empty((64, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
        nbytes = out.numel() * out.element_size()
        ipc_bw = gbps(nbytes, lambda: local.read(hit, out=out))
        rows.append(("IPC device-to-device read, bf16 exact", exact(out, data), f"{ipc_bw:.1f} GB/s"))
        host_out = torch.empty((64, *LAYOUT.block_shape), dtype=torch.bfloat16)
        rows.append(("IPC read into host memory, bf16 exact", exact(local.read(hit, out=host_out), data), ""))
        local.release(hit)
        remote_hit = remote.lookup(tokens)
        stream_out = remote.read(remote_hit)
        rows.append(("gRPC stream read of device blocks, bf16 exact", exact(stream_out, data), ""))
        remote.release(remote_hit)
        local.close()
        remote.close()
    finally:
        process.terminate()
        rows.append(("service exits 0 after SIGTERM", process.wait(60) == 0, ""))


def check_layer_loads(rows: list) -> None:
    try:
        from prefixcache.integrations.vllm.layers import LayerLoads
        from prefixcache.integrations.vllm.paged import KVPacking, PagedCache, PagedLayer
    except ImportError as error:
        rows.append(("layer-by-layer loads", True, f"not checked: {error}"[:120]))
        return
    layers, heads, tokens, dim, blocks = LAYOUT.layers, LAYOUT.kv_heads, LAYOUT.block_size, LAYOUT.head_dim, 256
    tensors = [
        torch.zeros(blocks + 1, heads, tokens, 2 * dim, dtype=torch.bfloat16, device="cuda") for _ in range(layers)
    ]
    cache = PagedCache([PagedLayer.of(t, KVPacking.CONTENT_SPLIT, dim) for t in tensors])
    names = [f"layer{i}" for i in range(layers)]
    source = random_bits(blocks).pin_memory()
    ids = tuple(range(1, blocks + 1))
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    activations = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")

    def forward(pipeline: LayerLoads | None) -> None:
        x = activations
        for number, name in enumerate(names):
            if pipeline is not None:
                pipeline.wait(name)
            x = (x @ weight).tanh() + tensors[number][1, 0, :1, :1].float().sum().to(x.dtype)  # reads layer's KV
        if pipeline is not None:
            pipeline.finish()

    def whole() -> None:
        cache.load(source, (ids,))
        forward(None)

    pipeline = LayerLoads(cache, names, lambda failed: None)

    def by_layer() -> None:
        pipeline.add(cache.plan_load(source, (ids,)), ids)
        pipeline.start()
        forward(pipeline)

    def best_ms(fn: Callable[[], None]) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return 1000 * min(times)

    whole_ms, layered_ms, compute_ms = best_ms(whole), best_ms(by_layer), best_ms(lambda: forward(None))
    pipeline.close()
    ok = all(exact(cache.gather((ids,))[:, i], source[:, i]) for i in (0, layers - 1))
    rows.append(
        (
            "layer-by-layer loads",
            ok,
            f"{blocks} blocks of {LAYOUT.block_bytes >> 20} MiB: whole load + forward {whole_ms:.1f} ms, "
            f"layer by layer {layered_ms:.1f} ms, forward alone {compute_ms:.1f} ms",
        )
    )


def check_saves_off_the_step(rows: list) -> None:
    try:
        from prefixcache.integrations.vllm.paged import KVPacking, PagedCache, PagedLayer
    except ImportError as error:
        rows.append(("saves off the step", True, f"not checked: {error}"[:120]))
        return
    dim, blocks = LAYOUT.head_dim, 256
    source = random_bits(blocks + 1)  # canonical blocks; vLLM's layer l holds [keys | values] per token
    tensors = [torch.cat((source[:, i, 0], source[:, i, 1]), dim=-1).cuda() for i in range(LAYOUT.layers)]
    cache = PagedCache([PagedLayer.of(t, KVPacking.CONTENT_SPLIT, dim) for t in tensors])
    ids = ((*range(1, blocks + 1),),)
    expected = source[1:]
    weight = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def forward() -> None:  # ~tens of ms queued ahead of the save, as a step's forward is
        x = weight
        for _ in range(8):
            x = x @ weight

    forward()
    torch.cuda.synchronize()
    started = time.perf_counter()
    forward()
    pending = cache.gather_later(ids)
    queued_ms = 1000 * (time.perf_counter() - started)
    for tensor in tensors:
        tensor.zero_()  # the next forward reuses the blocks
    got = pending.wait()
    waited_ms = 1000 * (time.perf_counter() - started)
    torch.cuda.synchronize()
    started = time.perf_counter()
    forward()
    cache.gather(ids)
    sync_ms = 1000 * (time.perf_counter() - started)
    ok = exact(got, expected) and bool(got.is_pinned()) and queued_ms < sync_ms / 4
    rows.append(
        (
            "saves off the step",
            ok,
            f"{blocks} blocks of {LAYOUT.block_bytes >> 20} MiB behind a queued forward: gather_later returns "
            f"in {queued_ms:.2f} ms (copy done {waited_ms:.1f} ms), gather {sync_ms:.1f} ms; exact after overwrite",
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (exit 0)")
        return 0
    started = time.monotonic()
    torch.manual_seed(0)
    rows: list[tuple[str, bool, str]] = []
    for check in (check_device_tier, check_host_to_gpu, check_ipc, check_layer_loads, check_saves_off_the_step):
        try:
            check(rows)
        except (RuntimeError, OSError, AssertionError) as error:  # report and go on to the next check
            rows.append((check.__name__, False, f"{type(error).__name__}: {error}"[:120]))
    width = max(len(name) for name, _, _ in rows)
    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | {time.monotonic() - started:.1f}s")
    for name, ok, detail in rows:
        print(f"{name.ljust(width)}  {'PASS' if ok else 'FAIL'}  {detail}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([{"check": n, "ok": o, "detail": d} for n, o, d in rows], indent=2))
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
