"""One vLLM engine running a scripted scenario; the vLLM tests run it as a subprocess.

    python tests/vllm_driver.py SPEC.json OUT.json

SPEC: {"model": DIR, "apc": bool, "connector": {kv_connector_extra_config} | null,
"kv_role": "kv_both" (default) | "kv_producer" | "kv_consumer",
"kv_cache_dtype": "auto" | "fp8" | ..., "block_size": int (32), "tensor_parallel_size": int (1),
"max_model_len": int, "steps": [...]} with steps
- {"generate": NAME, "prompts": [[token ids]...], "salts": [str|null...]?, "max_tokens": n,
   "kill_pid_after_s": [pid, seconds]?, "kv_transfer_params": {...}?}: greedy outputs and
   num_cached_tokens per prompt (kv_transfer_params: every prompt's, as an API request sets them);
   with kill_pid_after_s a thread SIGKILLs pid that long after generation starts;
- {"barrier": NAME}: writes OUT.NAME.reached, waits for OUT.NAME.go (the test acts meanwhile).
- {"stall": NAME, "running": [ids], "running_tokens": n, "arriving": [ids], "arrive_after": k}:
   steps the engine by hand; "running" decodes n tokens, "arriving" is added once it has k; the
   result has each token's time of "running" (`gaps`: seconds between consecutive tokens, `arrived_at`:
   the index of the first gap after the arrival), the arriving request's `cached` and `ttft_s`.
OUT: {"startup_s": s, "kv_blocks": vLLM's KV cache capacity in blocks, "steps": {NAME: {"outputs":
[[ids]...], "cached": [n...], "seconds": s, "metrics": {connector counter: cumulative value}}}}.
Engines take tens of seconds to start, so one process serves many checks; vLLM spawns
processes, hence the __main__ guard.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def _barrier(out: Path, name: str, timeout_s: float = 300.0) -> None:
    out.with_name(f"{out.name}.{name}.reached").write_text("1")
    go = out.with_name(f"{out.name}.{name}.go")
    deadline = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: no go within {timeout_s}s")
        time.sleep(0.05)


def _connector_metrics(llm) -> dict[str, float]:
    """vllm:prefixcache_* counters as vLLM's own metrics reader sees them (cumulative)."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:prefixcache_") and hasattr(metric, "value"):
            key = metric.name.removeprefix("vllm:prefixcache_")
            values[key] = values.get(key, 0) + metric.value
    return values


def _stall(llm, step: dict) -> dict:
    """One request decoding while another arrives: the decoding one's token times."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=step["running_tokens"], ignore_eos=True)
    engine.add_request(f"{step['stall']}-running", {"prompt_token_ids": step["running"]}, params)
    times: list[float] = []
    arrived_at = None
    arrival = {"cached": None, "ttft_s": None}
    added = 0.0
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.monotonic()
            if output.request_id.endswith("-running"):
                while len(times) < len(output.outputs[0].token_ids):
                    times.append(now)
            elif arrival["ttft_s"] is None and output.outputs[0].token_ids:
                arrival = {"cached": output.num_cached_tokens or 0, "ttft_s": now - added}
        if arrived_at is None and len(times) >= step["arrive_after"]:
            added = time.monotonic()
            arrived_at = len(times) - 1
            short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            engine.add_request(f"{step['stall']}-arriving", {"prompt_token_ids": step["arriving"]}, short)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"gaps": gaps, "arrived_at": arrived_at, **arrival, "metrics": _connector_metrics(llm)}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_path)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.pop(
        "ONEDNN_MAX_CPU_ISA", None
    )  # the HF worker's cap (worker/model.py): vLLM's AMX kernels SIGILL under it
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixCacheConnector",
            kv_connector_module_path="prefixcache.integrations.vllm",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
        )
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=spec.get("block_size", 32),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        enable_prefix_caching=bool(spec.get("apc")),
        max_num_seqs=spec.get("max_num_seqs", 16),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        seed=0,
        disable_log_stats=False,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        distributed_executor_backend="mp" if spec.get("tensor_parallel_size", 1) > 1 else None,
        **kwargs,
    )
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    result: dict = {"startup_s": time.monotonic() - started, "kv_blocks": blocks, "steps": {}}
    for step in spec["steps"]:
        if "barrier" in step:
            _barrier(out, step["barrier"])
            continue
        if "stall" in step:
            result["steps"][step["stall"]] = _stall(llm, step)
            out.write_text(json.dumps(result))
            continue
        prompts = []
        salts = step.get("salts") or [None] * len(step["prompts"])
        for tokens, salt in zip(step["prompts"], salts):
            prompt = {"prompt_token_ids": tokens}
            if salt is not None:
                prompt["cache_salt"] = salt
            prompts.append(prompt)
        if step.get("kill_pid_after_s"):
            pid, delay = step["kill_pid_after_s"]
            threading.Timer(delay, os.kill, (pid, signal.SIGKILL)).start()
        extra = {"kv_transfer_params": step["kv_transfer_params"]} if "kv_transfer_params" in step else None
        params = SamplingParams(
            temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True, extra_args=extra
        )
        begun = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["steps"][step["generate"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "cached": [o.num_cached_tokens or 0 for o in outputs],
            "seconds": time.monotonic() - begun,
            "metrics": _connector_metrics(llm),
        }
        out.write_text(json.dumps(result))
    out.write_text(json.dumps(result))
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
