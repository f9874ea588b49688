"""Never block vLLM: a slow service never stalls the requests vLLM is already running.

One engine (the connector scenario's tiny Llama, vLLM prefix caching off) talks to its service
through a loopback proxy whose latency the test sets between phases (tests/slow_proxy.py).
Each phase steps the engine by hand (tests/vllm_driver.py "stall"): request R1 decodes 96
tokens; after its 16th, R2 arrives, whose prompt shares 320 tokens with one the service holds.
- fast link: the baseline of R1's token gaps;
- 0.15 s each way (a Lookup takes ~0.3 s, under the 1.0 s lookup_timeout_s): R2 still loads its
  prefix, and R1's longest gap grows by no more than 0.2 s (a Lookup on the scheduler thread
  stalled it for the whole round trip);
- 0.8 s each way (past the deadline): R2 prefills in full, R1's gaps as above.
"""

from __future__ import annotations

import random

import pytest

from tests.slow_proxy import SlowProxy
from tests.support.poll import poll
from tests.support.worker_procs import CacheService
from tests.vllm_e2e.test_vllm_connector import _gen, _model, _start, _tokens

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_slow_service_never_stalls_running_requests(tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = tmp_path_factory.mktemp("vllm-stall")
    model = _model(workdir / "model")
    rng = random.Random(5)
    shared = _tokens(rng, 330)
    phases = ("baseline", "in_time", "late")
    arriving = {phase: shared + _tokens(rng, 20) for phase in phases}
    running = {phase: _tokens(rng, 64) for phase in phases}
    service = CacheService(workdir / "service", extra_args=["--block-size", "32"]).start()
    proxy = SlowProxy(service.port, latency_s=0.0, bytes_per_s=1e9).start()
    connector = {"cache": f"127.0.0.1:{proxy.port}", "hit_policy": "always", "lookup_timeout_s": 1.0, "timeout_s": 10}
    steps: list[dict] = [_gen("warm", [shared])]
    for phase in phases:
        steps.append({"barrier": phase})
        steps.append(
            {
                "stall": phase,
                "running": running[phase],
                "running_tokens": 96,
                "arriving": arriving[phase],
                "arrive_after": 16,
            }
        )
    engine = _start(workdir, "stall", model, steps, connector, apc=False)
    try:
        for phase, latency in zip(phases, (0.0, 0.15, 0.8), strict=True):
            engine.wait_barrier(phase)
            if phase == "baseline":
                assert poll(lambda: service.resident_blocks().get(model.name, 0) >= 10, 60, interval_s=0.2)
            proxy.latency_s = latency
            engine.go(phase)
        result = engine.result()["steps"]
    finally:
        if engine.process.poll() is None:
            engine.process.kill()
            engine.process.wait(timeout=30)
        proxy.stop()
        service.stop()
    worst = {phase: max(result[phase]["gaps"][result[phase]["arrived_at"] :]) for phase in phases}
    print(
        "\nR1's longest token gap after R2 arrives: "
        + ", ".join(f"{p} {1000 * worst[p]:.0f} ms" for p in phases)
        + "; R2 cached / TTFT: "
        + ", ".join(f"{p} {result[p]['cached']} / {1000 * result[p]['ttft_s']:.0f} ms" for p in phases)
    )
    assert result["baseline"]["cached"] == 320 and result["in_time"]["cached"] == 320
    assert result["late"]["cached"] == 0  # past lookup_timeout_s: prefilled in full
    assert worst["in_time"] <= worst["baseline"] + 0.2
    assert worst["late"] <= worst["baseline"] + 0.2
