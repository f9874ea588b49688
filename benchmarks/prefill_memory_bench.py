"""Worker memory over many distinct prompt lengths: prefill buckets vs unpadded vs no oneDNN.

    PYTHONPATH=. python benchmarks/prefill_memory_bench.py [--lengths 150] [--json-out FILE]

oneDNN (torch's CPU default) keeps compiled kernels per matmul shape, so an unpadded
bfloat16 worker's RSS grows with every prompt length it has not prefilled before. Each mode
runs in a fresh process (the kernel cache is per process) with the default tiny model in
bfloat16: a warm-up, then `--lengths` distinct random lengths in 40..1000 (pass 1), then as
many other lengths (pass 2, none seen in pass 1). It reports the RSS growth of each pass
(VmRSS), the distinct lengths the model actually ran, and the prefill time of both passes.
Modes: buckets (the default engine), unpadded (`--no-prefill-buckets`), no oneDNN
(`--no-onednn`). Results: docs/benchmarks.md (chaos soak section).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "buckets": {"buckets": None, "onednn": True},
    "unpadded": {"buckets": False, "onednn": True},
    "no_onednn": {"buckets": False, "onednn": False},
}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_mode(mode: str, count: int) -> dict:
    """In this (fresh) process: warm up, then two passes of distinct lengths."""
    import torch

    if not MODES[mode]["onednn"]:
        torch.backends.mkldnn.enabled = False
    from prefixcache_services.worker.engine import Engine, bucket_length
    from prefixcache_services.worker.model import configure_torch_threads, load_model

    configure_torch_threads()
    engine = Engine(load_model("tiny", "bfloat16"), prefill_buckets=MODES[mode]["buckets"])
    rng = random.Random(0)
    passes = {
        "pass1": sorted(rng.sample(range(40, 1000, 2), count)),
        "pass2": sorted(rng.sample(range(41, 1000, 2), count)),
    }

    def prompt(n: int, seed: int) -> list[int]:
        return torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    for n in (512, 40):
        engine.prefill(prompt(n, 1))
    result = {"mode": mode, "prefill_buckets": engine.prefill_buckets, "warm_rss_mib": rss_mib()}
    seen: set[int] = set()
    for name, lengths in passes.items():
        before, started = rss_mib(), time.perf_counter()
        for i, n in enumerate(lengths):
            engine.prefill(prompt(n, i))
        ran = {bucket_length(n) if engine.prefill_buckets else n for n in lengths}
        result[name] = {
            "rss_growth_mib": rss_mib() - before,
            "lengths_run": len(ran),
            "new_lengths_run": len(ran - seen),
            "prefill_seconds": time.perf_counter() - started,
        }
        seen |= ran
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, default=150, help="distinct prompt lengths per pass (<= 480)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # one mode, in a child
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.lengths)))
        return
    results = []
    for mode in MODES:
        child = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--lengths", str(args.lengths)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(
        f"{'mode':<10} {'pass 1 RSS':>11} {'lengths run':>12} {'pass 2 RSS':>11} {'new lengths':>12} {'prefill s':>10}"
    )
    for r in results:
        p1, p2 = r["pass1"], r["pass2"]
        print(
            f"{r['mode']:<10} {p1['rss_growth_mib']:>+9.1f}Mi {p1['lengths_run']:>12} {p2['rss_growth_mib']:>+9.1f}Mi"
            f" {p2['new_lengths_run']:>12} {p1['prefill_seconds'] + p2['prefill_seconds']:>10.1f}"
        )
    document = {"lengths_per_pass": args.lengths, "cpus": os.cpu_count(), "results": results}
    print(json.dumps(document, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
