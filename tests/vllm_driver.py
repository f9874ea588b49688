"""One vLLM engine running a scripted scenario; the vLLM tests run it as a subprocess.

    python tests/vllm_driver.py SPEC.json OUT.json

SPEC: {"model": DIR, "apc": bool, "connector": {kv_connector_extra_config} | null,
"kv_cache_dtype": "auto" | "fp8" | ...,
"max_model_len": int, "steps": [...]} with steps
- {"generate": NAME, "prompts": [[token ids]...], "salts": [str|null...]?, "max_tokens": n,
   "kill_pid_after_s": [pid, seconds]?}: greedy outputs and num_cached_tokens per prompt;
   with kill_pid_after_s a thread SIGKILLs pid that long after generation starts;
- {"barrier": NAME}: writes OUT.NAME.reached, waits for OUT.NAME.go (the test acts meanwhile).
OUT: {"startup_s": s, "steps": {NAME: {"outputs": [[ids]...], "cached": [n...], "seconds": s,
"metrics": {connector counter: cumulative value}}}}.
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
            kv_role="kv_both",
            kv_connector_extra_config=spec["connector"],
        )
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        enable_prefix_caching=bool(spec.get("apc")),
        max_num_seqs=spec.get("max_num_seqs", 16),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    result: dict = {"startup_s": time.monotonic() - started, "steps": {}}
    for step in spec["steps"]:
        if "barrier" in step:
            _barrier(out, step["barrier"])
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
        params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
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
