"""TTFT of vLLM on long shared-prefix prompts: no cache, vLLM's own prefix caching, prefixcache.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_ttft_bench.py [--layers 8 --hidden 1024]

Builds a random-weight Llama (GQA), starts one prefixcache service (host tier) and, one after
another, three vLLM engines on the CPU (tests/vllm_driver.py):
- none:   no connector, prefix caching off: every prompt is a full prefill;
- apc:    no connector, prefix caching on, warmed with the prefixes (the in-process ideal);
- pfx:    a fresh engine with PrefixCacheConnector, after a warm-up engine saved the prefixes.
Each measured prompt is its own generate call with max_tokens=1, so its wall time is its TTFT.
Prints a JSON table: median TTFT per engine, the saving against `none`, and prefixcache's share
of the in-process ideal's saving. Covers the host tier only (not ExampleConnector, not Redis).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.worker_procs import CacheService

BS = 32


def _model(directory: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def _engine(workdir: Path, name: str, model: Path, steps: list[dict], connector: dict | None, apc: bool) -> dict:
    spec, out = workdir / f"{name}.spec.json", workdir / f"{name}.json"
    spec.write_text(json.dumps({"model": str(model), "apc": apc, "connector": connector, "steps": steps,
                                "max_model_len": 4096}))
    with (workdir / f"{name}.log").open("w") as log:
        subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_driver.py"), str(spec), str(out)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "2"},
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    rng = random.Random(0)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    model = workdir / "model"
    _model(model, args.layers, args.hidden)
    prefixes = [[rng.randrange(1, 4096) for _ in range(args.prefix_tokens)] for _ in range(args.prompts)]
    measured = [p + [rng.randrange(1, 4096) for _ in range(40)] for p in prefixes]
    warm = [{"generate": f"warm{i}", "prompts": [p], "max_tokens": 1} for i, p in enumerate(prefixes)]
    timed = [{"generate": f"t{i}", "prompts": [p], "max_tokens": 1} for i, p in enumerate(measured)]
    service = CacheService(workdir / "svc", host_capacity="2GiB", extra_args=["--block-size", str(BS)]).start()
    try:
        connector = {"cache": service.address, "hit_policy": "always"}
        runs = {"none": _engine(workdir, "none", model, timed, None, apc=False),
                "apc": _engine(workdir, "apc", model, warm + timed, None, apc=True)}
        _engine(workdir, "pfx_warm", model, warm, connector, apc=False)
        runs["pfx"] = _engine(workdir, "pfx", model, timed, connector, apc=False)
    finally:
        service.stop()
    ttft = {name: statistics.median(r["steps"][f"t{i}"]["seconds"] for i in range(args.prompts))
            for name, r in runs.items()}
    cached = {name: [r["steps"][f"t{i}"]["cached"][0] for i in range(args.prompts)] for name, r in runs.items()}
    saving = {name: ttft["none"] - ttft[name] for name in ttft}
    print(json.dumps({"model": {"layers": args.layers, "hidden": args.hidden}, "prompt_tokens": len(measured[0]),
                      "median_ttft_s": ttft, "cached_tokens": cached, "saving_s": saving,
                      "pfx_share_of_apc_saving": saving["pfx"] / saving["apc"] if saving["apc"] > 0 else None,
                      "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))


if __name__ == "__main__":
    main()
