"""PrefixCacheConnector end to end: real vLLM engines, real cache services, a real redis-server.

One module-scoped scenario runs eight engines (vLLM takes tens of seconds to start, so each
engine performs several checks; tests/vllm_driver.py) and the tests assert on what they
report:
- A (connector -> service s1, vLLM prefix caching off, `kv_role` kv_producer: saves only)
  serves multi-turn conversations and saves their prompts' blocks; s1 writes them through to
  Redis.
- REF (no connector, prefix caching off) and APC (no connector, prefix caching on, warmed
  with A's prompts) give the reference outputs and vLLM's own prefix-cache baseline.
- B1 (fresh, connector -> s1, prefix caching off): loads A's prefixes from s1's host tier
  (shared memory); then s1 is SIGKILLed while B1 serves a batch, restarted, and B1 hits again;
  last, s1 restarts with 1 ms leases, so every scheduled load fails after scheduling and vLLM
  must recompute the blocks the connector reports (get_block_ids_with_load_errors).
- B2 (fresh, connector -> s2, a second service over the same Redis, prefix caching on,
  `kv_role` kv_consumer: loads only): loads A's prefixes through Redis; after every Redis value
  is corrupted, prompts only Redis holds are misses with reference outputs.
- fp8 KV (`kv_cache_dtype="fp8"`, stored byte for byte): FA (connector -> s3, a third service
  over the same Redis keyspace) looks up a prompt whose bf16 blocks A wrote to Redis and must
  miss, then serves and saves more of A's prompts as fp8; FB (fresh, -> s3) loads them; FR (no
  connector) gives the fp8 reference outputs. (A service holds bf16 and fp8 namespaces side by
  side since the tiers became arenas of chunks; tests/test_fp8.py and test_multi_model_workers.py
  cover that.) vLLM keeps fp8 KV on a CPU only with AVX-512 or AMX: elsewhere these three
  engines are not started and their test is skipped, naming why.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.poll import poll
from tests.support.redis_server import RedisServer
from tests.support.worker_procs import CacheService

ROOT = Path(__file__).resolve().parents[2]
BS = 32
VOCAB = 512
MAX_TOKENS = 8
KILL_AFTER_S = 0.2
DRIVER_TIMEOUT_S = 420

pytestmark = [pytest.mark.process, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(900)]


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's own rule (v1/attention/backends/cpu_attn.py, `_get_attn_isa`): its CPU attention
    keeps fp8 KV only on x86 with AVX-512 or AMX, and refuses to start otherwise."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


FP8_KV = _cpu_runs_fp8_kv()
NO_FP8_KV = "vLLM's CPU attention keeps fp8 KV only with AVX-512 or AMX, which this CPU lacks"


def _model(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )  # 0.1: greedy output varies
    torch.manual_seed(1234)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _conversations(rng: random.Random, count: int, system: list[int]) -> list[list[list[int]]]:
    """ShareGPT-shaped token prompts: each turn's prompt is the previous one plus a reply and a user turn."""
    conversations = []
    for _ in range(count):
        turns, prompt = [], system + _tokens(rng, rng.randrange(20, 60))
        for _ in range(3):
            turns.append(prompt)
            prompt = prompt + _tokens(rng, rng.randrange(10, 40)) + _tokens(rng, rng.randrange(15, 50))
        conversations.append(turns)
    return conversations


@dataclass
class Engine:
    name: str
    process: subprocess.Popen
    out: Path

    def reached(self, barrier: str) -> bool:
        return self.out.with_name(f"{self.out.name}.{barrier}.reached").exists()

    def go(self, barrier: str) -> None:
        self.out.with_name(f"{self.out.name}.{barrier}.go").write_text("1")

    def wait_barrier(self, barrier: str) -> None:
        assert poll(lambda: self.reached(barrier) or self.process.poll() is not None, DRIVER_TIMEOUT_S), barrier
        assert self.process.poll() is None, f"{self.name} exited before barrier {barrier}: {self.log()}"

    def result(self) -> dict:
        code = self.process.wait(timeout=DRIVER_TIMEOUT_S)
        assert code == 0, f"{self.name} exited {code}: {self.log()}"
        return json.loads(self.out.read_text())

    def log(self) -> str:
        return self.log_text()[-4000:]

    def log_text(self) -> str:
        return self.out.with_suffix(".log").read_text(errors="replace")

    def worker_totals(self) -> dict[str, float]:
        """The worker's shutdown line `prefixcache worker totals: k=v, ...` (seconds as floats:
        vLLM's metrics reader rounds the connector's second counters)."""
        lines = [
            line
            for line in self.out.with_suffix(".log").read_text(errors="replace").splitlines()
            if "prefixcache worker totals:" in line
        ]
        if not lines:
            return {}
        pairs = (item.split("=") for item in lines[-1].split("totals:", 1)[1].split(","))
        return {key.strip(): float(value) for key, value in pairs}

    def measured_prefill(self) -> tuple[float, float, int] | None:
        """The scheduler's shutdown line: vLLM's step cost as the auto policy measured it
        (ms a step, tokens/s, steps timed); None if the line is missing."""
        found = re.findall(
            r"measured step cost ([\d.e+-]+) ms \+ ([\d.e+-]+) tokens/s \((\d+) steps\)",
            self.out.with_suffix(".log").read_text(errors="replace"),
        )
        return (float(found[-1][0]), float(found[-1][1]), int(found[-1][2])) if found else None


def _start(
    workdir: Path,
    name: str,
    model: Path,
    steps: list[dict],
    connector: dict | None,
    apc: bool,
    kv_cache_dtype: str = "auto",
    env: dict[str, str] | None = None,
    **spec_extra: object,
) -> Engine:
    """One driver process (tests/vllm_driver.py); `spec_extra` adds SPEC keys (block_size, ...)."""
    spec = workdir / f"{name}.spec.json"
    out = workdir / f"{name}.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "apc": apc,
                "connector": connector,
                "steps": steps,
                "kv_cache_dtype": kv_cache_dtype,
                **spec_extra,
            }
        )
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", **(env or {}))
    with out.with_suffix(".log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "vllm_driver.py"), str(spec), str(out)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Engine(name, process, out)


def _gen(name: str, prompts: list[list[int]], **extra) -> dict:
    return {"generate": name, "prompts": prompts, "max_tokens": MAX_TOKENS, **extra}


def _corrupt_every_value(redis: RedisServer, prefix: str) -> int:
    corrupted = 0
    with redis.client() as raw:
        for key in raw.scan_iter(match=f"{prefix}*", count=1000):
            value = raw.get(key)
            if value:
                raw.set(key, value[:-1] + bytes([value[-1] ^ 0x01]), keepttl=True)
                corrupted += 1
    return corrupted


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm")
    model = _model(workdir / "model")
    rng = random.Random(7)
    system = _tokens(rng, 70)
    convs = _conversations(rng, 8, system)  # 0-3 for B1, 4-7 for B2 (B1 saves: keep them apart)
    own = [_conversations(rng, 1, _tokens(rng, 50))[0] for _ in range(3)]  # own system prompts
    prompts = {
        "a": [turn for conv in convs for turn in conv[:2]] + [conv[0] for conv in own],
        "b": [conv[2] for conv in convs[:4]] + [conv[1] for conv in convs[:2]],  # a new turn, and repeats
        "b2": [conv[2] for conv in convs[4:]] + [conv[1] for conv in convs[4:6]],
        "c": [turn for conv in convs[:4] for turn in conv] * 3,  # served while s1 dies
        "e": [conv[0] + _tokens(rng, 7) for conv in own],  # only Redis holds these
    }
    fresh = _conversations(rng, 3, _tokens(rng, 40))
    prompts["d1"] = [conv[0] for conv in fresh]
    prompts["d2"] = [conv[1] for conv in fresh]
    late = _conversations(rng, 3, _tokens(rng, 40))
    prompts["f1"] = [conv[0] for conv in late]
    prompts["f2"] = [conv[1] for conv in late]
    prompts["x8"] = [convs[2][0]]  # A saved it as bf16; alone in its step, so only Redis could serve it
    prompts["a8"] = [turn for conv in convs[:2] for turn in conv[:2]]  # A saved these as bf16 too
    prompts["b8"] = [conv[2] for conv in convs[:2]] + [conv[1] for conv in convs[:2]]
    salted = _tokens(rng, 150)
    prompts["s_a"] = [salted]
    prompts["s_b"] = [salted + _tokens(rng, 9)] * 3
    prompts["a2"] = [_tokens(rng, 40)]  # one block, saved once A's earlier saves are committed
    prompts["b_a2"] = [prompts["a2"][0] + _tokens(rng, 9)]  # B1 loads that block
    redis = RedisServer(workdir / "redis").start()
    s1 = CacheService(workdir / "s1", redis_url=redis.url, extra_args=["--block-size", str(BS)])
    s2 = CacheService(workdir / "s2", redis_url=redis.url, extra_args=["--block-size", str(BS)])
    s3 = CacheService(workdir / "s3", redis_url=redis.url, extra_args=["--block-size", str(BS)])
    s2.redis_key_prefix = s3.redis_key_prefix = s1.redis_key_prefix  # one shared Redis keyspace
    engines: list[Engine] = []
    try:
        s1.start()
        s2.start()
        s3.start()
        connector = {"hit_policy": "always", "timeout_s": 5.0, "lookup_timeout_s": 5.0}
        if FP8_KV:
            fr = _start(
                workdir,
                "FR",
                model,
                [_gen("a8", prompts["a8"]), _gen("b8", prompts["b8"])],
                None,
                apc=False,
                kv_cache_dtype="fp8",
            )
            engines.append(fr)
        order = ["b", "b2", "c", "d1", "d2", "e", "f2", "s_b", "b_a2"]
        a = _start(
            workdir,
            "A",
            model,
            [
                _gen("a", prompts["a"]),
                {"barrier": "saved"},
                _gen("a2", prompts["a2"]),
                _gen("s_a", prompts["s_a"], salts=["tenant-1"]),
            ],
            {"cache": s1.address, **connector},
            apc=False,
            kv_role="kv_producer",
        )
        ref = _start(workdir, "REF", model, [_gen(k, prompts[k]) for k in order], None, apc=False)
        apc = _start(
            workdir,
            "APC",
            model,
            [_gen("a", prompts["a"]), _gen("b", prompts["b"]), _gen("b2", prompts["b2"])],
            None,
            apc=True,
        )
        engines += [a, ref, apc]
        a.wait_barrier("saved")
        blocks = {tuple(p[: k * BS]) for p in prompts["a"] for k in range(1, len(p) // BS + 1)}
        with redis.client() as raw:  # A's blocks reach Redis by s1's write-through
            assert poll(lambda: sum(1 for _ in raw.scan_iter(match=f"{s1.redis_key_prefix}*")) >= len(blocks), 60)
        a.go("saved")  # A's save thread is idle: the last Commit's spare reservation waits for a2's save
        results = {"A": a.result()}
        b1 = _start(
            workdir,
            "B1",
            model,
            [
                _gen("b", prompts["b"]),
                _gen("s_b", prompts["s_b"], salts=["tenant-1", "tenant-2", None]),
                _gen("b_a2", prompts["b_a2"]),
                {"barrier": "kill"},
                _gen("c", prompts["c"], kill_pid_after_s=[s1.process.pid, KILL_AFTER_S], max_tokens=32),
                {"barrier": "restart"},
                _gen("d1", prompts["d1"]),
                _gen("d2", prompts["d2"]),
                {"barrier": "short_lease"},
                _gen("f1", prompts["f1"]),
                _gen("f2", prompts["f2"]),
            ],
            {"cache": s1.address, **connector},
            apc=False,
        )
        b2 = _start(
            workdir,
            "B2",
            model,
            [_gen("b2", prompts["b2"]), {"barrier": "corrupt"}, _gen("e", prompts["e"])],
            {"cache": s2.address, **connector, "layer_loads": "on"},  # layers.py's CPU pipeline, end to end
            apc=True,
            kv_role="kv_consumer",
        )
        engines += [b1, b2]
        if FP8_KV:
            fa = _start(
                workdir,
                "FA",
                model,
                [_gen("x8", prompts["x8"]), _gen("a8", prompts["a8"])],
                {"cache": s3.address, **connector},
                apc=False,
                kv_cache_dtype="fp8",
            )
            engines.append(fa)
            results["FA"] = fa.result()
            fb = _start(
                workdir,
                "FB",
                model,
                [_gen("b8", prompts["b8"])],
                {"cache": s3.address, **connector},
                apc=False,
                kv_cache_dtype="fp8",
            )
            engines.append(fb)
        b1.wait_barrier("kill")
        b1.go("kill")
        b1.wait_barrier("restart")
        assert not s1.alive()
        s1.restart()  # same port, fresh host tier (the dead one's segment unlinked)
        b1.go("restart")
        b1.wait_barrier("short_lease")
        s1.extra_args += ("--lease-ttl", "1ms")  # every lease is over before a worker can copy it
        s1.restart()
        b1.go("short_lease")
        results["B1"] = b1.result()
        b2.wait_barrier("corrupt")
        corrupted = _corrupt_every_value(redis, s1.redis_key_prefix)
        b2.go("corrupt")
        results["B2"] = b2.result()
        results["REF"], results["APC"] = ref.result(), apc.result()
        if FP8_KV:
            results["FB"], results["FR"] = fb.result(), fr.result()
        results["totals"] = {engine.name: engine.worker_totals() for engine in engines}
        results["prefill"] = {engine.name: engine.measured_prefill() for engine in engines}
        results["corrupted"] = corrupted
        results["prompts"] = prompts
        (workdir / "results.json").write_text(json.dumps(results))
        if os.environ.get("PREFIXCACHE_VLLM_RESULTS"):  # figures for docs/vllm.md
            Path(os.environ["PREFIXCACHE_VLLM_RESULTS"]).write_text(json.dumps(results))
        return results
    finally:
        for engine in engines:
            if engine.process.poll() is None:
                engine.process.send_signal(signal.SIGKILL)
                engine.process.wait(timeout=30)
        for service in (s1, s2, s3):
            service.stop()
        redis.stop()


def _expected_external(prompt: list[int], saved: list[list[int]]) -> int:
    """All but the last block of the shared prefix: whole cached blocks, never the prompt's last token."""
    shared = 0
    for other in saved:
        n = 0
        for x, y in zip(prompt, other[: len(other) // BS * BS]):
            if x != y:
                break
            n += 1
        shared = max(shared, n)
    return min(shared // BS * BS, (len(prompt) - 1) // BS * BS)


def _mismatches(outputs: list[list[int]], reference: list[list[int]]) -> int:
    return sum(1 for o, r in zip(outputs, reference, strict=True) if o != r)


def test_a_fresh_instance_loads_every_shared_prefix_from_the_host_tier(scenario: dict) -> None:
    prompts, b = scenario["prompts"], scenario["B1"]["steps"]["b"]
    expected = [_expected_external(p, prompts["a"]) for p in prompts["b"]]
    assert all(e >= 2 * BS for e in expected)
    assert b["cached"] == expected  # vLLM's own prefix caching is off: all of it came from the cache
    metrics = b["metrics"]
    assert metrics.get("loaded_tokens") == sum(expected) and metrics.get("load_failures", 0) == 0
    assert metrics.get("hits") == len(expected)
    # mapped blocks of a one-group model, far cheaper than a step: copied within the step that schedules them
    assert metrics.get("in_step_loads") == len(expected)


def test_through_redis_a_second_service_serves_what_the_first_saved(scenario: dict) -> None:
    prompts, b = scenario["prompts"], scenario["B2"]["steps"]["b2"]
    expected = [_expected_external(p, prompts["a"]) for p in prompts["b2"]]
    # With vLLM's prefix caching on, a prompt vLLM already holds part of loads only the rest;
    # num_cached_tokens counts both.
    assert b["cached"] == expected
    assert b["metrics"].get("loaded_tokens", 0) > 0
    # B2 copies in-step loads layer by layer (layer_loads: on), each before its layer's attention:
    # its outputs are checked against a vLLM without the connector below.
    assert b["metrics"].get("layered_loads", 0) == b["metrics"].get("in_step_loads") > 0


def test_kv_role_a_producer_only_saves_and_a_consumer_only_loads(scenario: dict) -> None:
    a = scenario["A"]["steps"]["a"]["metrics"]
    assert a.get("saved_blocks", 0) > 0
    # Once a Commit reserved the next save's slots, a save is copied straight into them (one
    # copy). Within step a that races the save thread's queue; a2 is saved after it drained.
    a2 = scenario["A"]["steps"]["a2"]["metrics"]
    assert a2.get("saves_in_place", 0) > a.get("saves_in_place", 0)
    b_a2 = scenario["B1"]["steps"]["b_a2"]  # that block, loaded: the same outputs as without a cache
    assert b_a2["cached"] == [BS] and b_a2["outputs"] == scenario["REF"]["steps"]["b_a2"]["outputs"]
    assert a.get("lookups", 0) == 0 and a.get("hits", 0) == 0  # kv_producer: not one Lookup
    b2 = scenario["B2"]["steps"]["e"]["metrics"]  # cumulative: the b2 and e steps
    assert b2.get("lookups", 0) >= len(scenario["prompts"]["b2"]) and b2.get("loaded_tokens", 0) > 0
    totals = scenario["totals"]["B2"]  # the worker's shutdown line
    assert totals.get("loaded_blocks", 0) > 0 and totals.get("saved_blocks", 0) == 0  # kv_consumer: nothing saved
    assert b2.get("saved_blocks", 0) == 0


def test_outputs_equal_a_vllm_without_the_connector_and_no_worse_than_apc(scenario: dict) -> None:
    ref, apc = scenario["REF"]["steps"], scenario["APC"]["steps"]
    assert all(apc[k]["cached"] != [0] * len(ref[k]["outputs"]) for k in ("b", "b2"))  # APC really hit
    apc_b, apc_b2 = (_mismatches(apc[k]["outputs"], ref[k]["outputs"]) for k in ("b", "b2"))
    host = _mismatches(scenario["B1"]["steps"]["b"]["outputs"], ref["b"]["outputs"])
    via_redis = _mismatches(scenario["B2"]["steps"]["b2"]["outputs"], ref["b2"]["outputs"])
    print(
        f"mismatching prompts: host tier {host} vs APC {apc_b} of {len(ref['b']['outputs'])}; "
        f"via Redis {via_redis} vs APC {apc_b2} of {len(ref['b2']['outputs'])}"
    )
    assert host <= apc_b and via_redis <= apc_b2
    assert host == 0 and via_redis == 0


def test_a_service_killed_mid_batch_never_fails_a_request_nor_changes_outputs(scenario: dict) -> None:
    c = scenario["B1"]["steps"]["c"]
    assert c["seconds"] > KILL_AFTER_S  # the batch was still being served when the service died
    assert len(c["outputs"]) == len(scenario["prompts"]["c"])
    assert all(len(o) == 32 for o in c["outputs"])
    assert [o[:MAX_TOKENS] for o in c["outputs"]] == scenario["REF"]["steps"]["c"]["outputs"]


def test_hits_resume_after_the_service_restarts(scenario: dict) -> None:
    prompts, d2 = scenario["prompts"], scenario["B1"]["steps"]["d2"]
    expected = [_expected_external(p, prompts["d1"]) for p in prompts["d2"]]
    assert all(e > 0 for e in expected)
    assert d2["cached"] == expected
    assert d2["outputs"] == scenario["REF"]["steps"]["d2"]["outputs"]


def test_a_corrupted_redis_block_is_a_miss_never_wrong_output(scenario: dict) -> None:
    e = scenario["B2"]["steps"]["e"]
    assert scenario["corrupted"] > 0
    assert e["cached"] == [0] * len(scenario["prompts"]["e"])
    assert e["outputs"] == scenario["REF"]["steps"]["e"]["outputs"]


def test_a_load_that_fails_after_scheduling_is_recomputed_by_vllm(scenario: dict) -> None:
    steps = scenario["B1"]["steps"]
    before, after = steps["f1"]["metrics"], steps["f2"]["metrics"]
    failed = after.get("load_failures", 0) - before.get("load_failures", 0)
    assert failed == len(scenario["prompts"]["f2"])  # each f2 prompt was offered f1's blocks, none loaded
    # in-step loads: their blocks went back to vLLM through get_block_ids_with_load_errors
    assert after.get("in_step_loads", 0) - before.get("in_step_loads", 0) == failed
    assert after.get("loaded_tokens", 0) == before.get("loaded_tokens", 0)
    assert steps["f2"]["outputs"] == scenario["REF"]["steps"]["f2"]["outputs"]


def test_a_request_cache_salt_shares_only_with_the_same_salt(scenario: dict) -> None:
    s_b, prompts = scenario["B1"]["steps"]["s_b"], scenario["prompts"]
    expected = _expected_external(prompts["s_b"][0], prompts["s_a"])
    assert expected == 128
    assert s_b["cached"] == [expected, 0, 0]  # same salt; another salt; no salt
    assert s_b["outputs"] == scenario["REF"]["steps"]["s_b"]["outputs"]


@pytest.mark.skipif(not FP8_KV, reason=NO_FP8_KV)
def test_fp8_kv_is_stored_and_loaded_byte_for_byte_and_never_shares_with_bf16(scenario: dict) -> None:
    prompts, steps = scenario["prompts"], {k: scenario[k]["steps"] for k in ("FA", "FB", "FR")}
    x8, fa, fb = steps["FA"]["x8"], steps["FA"]["a8"], steps["FB"]["b8"]
    # FA's first lookup: a prompt whose bf16 blocks A had written to the Redis keyspace s3 shares.
    assert _expected_external(prompts["x8"][0], prompts["a"]) >= 2 * BS
    assert x8["cached"] == [0] and x8["metrics"].get("misses") == 1 and x8["metrics"].get("hits", 0) == 0
    assert fa["metrics"].get("saved_blocks", 0) > 0
    # FB, fresh, loads FA's fp8 blocks: all but the last block of each shared prefix.
    expected = [_expected_external(p, prompts["x8"] + prompts["a8"]) for p in prompts["b8"]]
    assert all(e >= 2 * BS for e in expected)
    assert fb["cached"] == expected
    assert fb["metrics"].get("loaded_tokens") == sum(expected) and fb["metrics"].get("load_failures", 0) == 0
    # FR, without a connector, prefilled everything.
    for name in ("a8", "b8"):
        assert steps["FR"][name]["cached"] == [0] * len(prompts[name])
    # Outputs: FR (fp8, no cache) equals FA (which loaded its own earlier fp8 saves for some
    # of a8, vLLM's batching permitting) and FB (which loaded most of every prompt).
    assert steps["FR"]["a8"]["outputs"] == fa["outputs"]
    mismatches = _mismatches(fb["outputs"], steps["FR"]["b8"]["outputs"])
    fp8, bf16 = scenario["totals"]["FB"], scenario["totals"]["B1"]
    assert fp8.get("loaded_blocks") == sum(expected) / BS
    print(
        f"fp8: {sum(expected)} tokens loaded, {mismatches} of {len(expected)} prompts mismatch; load "
        f"{1000 * fp8['load_seconds'] / fp8['loaded_blocks']:.2f} ms/block (8 KiB blocks) vs bf16 "
        f"{1000 * bf16['load_seconds'] / bf16['loaded_blocks']:.2f} ms/block (16 KiB) in B1"
    )
    assert mismatches == 0


def test_the_scheduler_measures_vllms_own_step_cost(scenario: dict) -> None:
    # The auto policy's prefill rate comes from timing vLLM's steps (B1 served 7 batches of 8+ steps).
    measured = scenario["prefill"]["B1"]
    assert measured is not None, "no 'measured step cost' line in B1's log"
    step_ms, tokens_per_s, steps = measured
    print(
        f"B1's vLLM as the connector measured it: {step_ms:.3g} ms a step + {tokens_per_s:.4g} tokens/s "
        f"over {steps} steps"
    )
    assert steps >= 8 and 0 < tokens_per_s < 1e12 and step_ms >= 0
