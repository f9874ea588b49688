"""`prefixcache route` over real processes: two reference workers, each with its own cache service.

- A multi-turn replay through the router: every turn after the first goes to the engine that
  holds the conversation's prefix (Match found it, the engine's usage reports it cached), though
  each request names a fresh conversation id so the sticky tie-break cannot be what decided;
  /metrics counts the decisions and both the predicted and the observed TTFT.
- An engine SIGKILLed while requests are queued on it: every request that had not received a
  byte completes on the other engine (failover); only a stream already started may fail, and
  it fails visibly (an SSE error event), never silently.
- `--discover`: a name's addresses become engines.
- Bad CLI input: a clear error that names the flag (in-process, no router started).

One fleet (two services, two workers, one router) serves the module; the kill test runs last.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import pytest

from prefixcache_services.cli import main
from tests.support.poll import poll
from tests.support.worker_procs import CacheService, RouterProcess, WorkerProcess, start_all, stop_all

pytestmark = pytest.mark.process

CHAT = "/v1/chat/completions"
SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the handbook section {i * 7 % 31}." for i in range(24))
WORKER_ARGS = ("--cache-deadline-ms", "5000", "--hit-policy", "always")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("router-fleet")
    services = [CacheService(work / f"service-{i}", host_capacity="64MiB").start() for i in range(2)]
    workers = [WorkerProcess(work / f"worker-{i}", services[i], WORKER_ARGS) for i in range(2)]
    router = None
    try:
        start_all(workers)
        for worker in workers:  # a salted sibling namespace, fuller than the base one: never Match's
            salted = [{"role": "user", "content": SYSTEM * 2}]
            worker.client.chat(salted, max_tokens=1, cache_salt="other-tenant")
            reply = worker.client.post("/tokenize", {"messages": salted, "cache_salt": "other-tenant"})
            wait_stored(worker, salted, reply.body["count"], salt="other-tenant")
        router = RouterProcess(
            work / "router", list(zip(workers, services, strict=True)), ["--health-interval-ms", "300"]
        )
        router.start()
        names = {f"127.0.0.1:{w.port}": w for w in workers}
        poll(lambda: _resolved(router), 30, "the router resolved both caches' namespaces")
        yield router, names
    finally:
        if router is not None:
            router.stop()
        stop_all(workers)
        for service in services:
            service.stop()


def _resolved(router: RouterProcess) -> bool:
    """Both engines healthy (the router's first health round, which also resolves the namespaces)."""
    status, data, _ = router.client.request("GET", "/health")
    return status == 200 and all(e["healthy"] for e in json.loads(data)["engines"])


def stream_chat(port: int, body: dict, headers: dict | None = None, on_first_byte=None) -> dict:
    """One streamed chat through `port`: headers, text, usage, and whether any byte came before a failure."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    result: dict = {"status": None, "engine": None, "bytes": 0, "text": "", "done": False, "error": None}
    try:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        connection.request(
            "POST", CHAT, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        result["status"] = response.status
        result["engine"] = response.getheader("X-Prefixcache-Engine")
        result["predicted_ms"] = float(response.getheader("X-Prefixcache-Predicted-Ttft-Ms") or "nan")
        result["hit_tokens"] = int(response.getheader("X-Prefixcache-Hit-Tokens") or "0")
        if response.status != 200:
            result["error"] = response.read().decode(errors="replace")
            return result
        for raw in response:
            if result["bytes"] == 0 and on_first_byte is not None:
                on_first_byte(result)
            result["bytes"] += len(raw)
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                result["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                result["error"] = event["error"]["message"]
                continue
            for choice in event.get("choices", []):
                result["text"] += choice.get("delta", {}).get("content") or ""
            if event.get("usage"):
                result["usage"] = event["usage"]
    except (OSError, http.client.HTTPException) as error:
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return result


def wait_stored(worker: WorkerProcess, messages: list[dict], prompt_tokens: int, salt: str | None = None) -> None:
    """Until the worker's background store of a prompt is visible in its cache (whole blocks)."""
    want = ((prompt_tokens - 1) // 16) * 16

    def stored() -> bool:
        reply = worker.client.post("/tokenize", {"messages": messages, **({"cache_salt": salt} if salt else {})})
        return reply.status == 200 and (reply.body.get("cached_tokens") or 0) >= want

    poll(stored, 30, f"{want} tokens stored")


def test_each_turn_goes_to_the_engine_holding_its_prefix(fleet):
    router, workers = fleet
    chosen: dict[str, list[str]] = {}
    for conversation in range(3):
        topic = f"conversation {conversation} {uuid.uuid4().hex[:8]}"
        salt = {"cache_salt": "tenant-b"} if conversation == 1 else {}  # Match carries the salt
        history = [{"role": "system", "content": SYSTEM + " " + topic}]
        for turn in range(3):
            history.append({"role": "user", "content": f"{topic}: question {turn} about section {turn * 3}."})
            # A fresh conversation id each turn: the sticky tie-break knows nothing, Match decides.
            result = stream_chat(
                router.port, {"messages": history, "max_tokens": 4, **salt}, {"X-Conversation-Id": uuid.uuid4().hex}
            )
            assert result["status"] == 200 and result["done"] and result["error"] is None, result
            chosen.setdefault(topic, []).append(result["engine"])
            cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn > 0:
                assert result["engine"] == chosen[topic][0], (topic, chosen[topic])
                assert result["hit_tokens"] > 0 and cached >= result["hit_tokens"] - 16, result
            wait_stored(workers[result["engine"]], history, result["usage"]["prompt_tokens"], salt.get("cache_salt"))
            history.append({"role": "assistant", "content": f"Answer {turn}: see section {turn * 3}."})
    metrics = router.client.metrics()
    decisions = sum(v for (name, _), v in metrics.items() if name == "prefixcache_router_decisions_total")
    assert decisions >= 9
    for family in ("prefixcache_router_predicted_ttft_seconds_count", "prefixcache_router_observed_ttft_seconds_count"):
        assert sum(v for (name, _), v in metrics.items() if name == family) >= 9, family
    status, data, _ = router.client.request("GET", "/v1/models")
    assert status == 200 and json.loads(data)["data"][0]["id"]


def test_discovered_engines_are_the_addresses_of_a_name(fleet, tmp_path):
    """--discover: `localhost` resolves to the engine's loopback address (a headless Service's pod IPs)."""
    router, workers = fleet
    name, worker = next(iter(workers.items()))
    service = worker.cache
    found = RouterProcess(tmp_path, [], ["--discover", f"http://localhost:{worker.port}={service.port}"]).start()
    try:
        poll(lambda: name in _healthy(found), 30, f"{name} discovered and healthy")
        result = stream_chat(found.port, {"messages": [{"role": "user", "content": "Where am I?"}], "max_tokens": 2})
        assert result["status"] == 200 and result["done"] and result["engine"] == name, result
    finally:
        found.stop()


def _in_flight(router: RouterProcess, engine: str) -> int:
    status, data, _ = router.client.request("GET", "/health")
    return next(e["in_flight"] for e in json.loads(data)["engines"] if e["engine"] == engine)


def _healthy(router: RouterProcess) -> set[str]:
    status, data, _ = router.client.request("GET", "/health")
    return {e["engine"] for e in json.loads(data)["engines"] if e["healthy"]} if status in (200, 503) else set()


def test_a_killed_engine_loses_no_request_that_had_not_started_streaming(fleet):
    router, workers = fleet
    victim_name, victim = next(iter(workers.items()))
    killed = threading.Event()

    def kill_on_victim_stream(result: dict) -> None:
        if result["engine"] == victim_name and not killed.is_set():
            killed.set()
            # SIGKILL once more requests wait in the victim's queue (the router's /health counts them).
            poll(lambda: _in_flight(router, victim_name) >= 2, 20, "two requests in flight on the victim")
            victim.process.kill()

    # The victim alone holds the requests' long shared prefix: Match makes it the best engine, so
    # requests queue there (the other engine would prefill ~2k tokens).
    system = {"role": "system", "content": f"{uuid.uuid4().hex} " + SYSTEM * 6}
    victim.client.chat([system, {"role": "user", "content": "prime"}], max_tokens=1)
    reply = victim.client.post("/tokenize", {"messages": [system]})
    wait_stored(victim, [system], reply.body["count"] - 8)
    results: list[dict] = []
    lock = threading.Lock()

    def one(number: int) -> None:
        body = {"messages": [system, {"role": "user", "content": f"Count to forty, request {number}."}]}
        body["max_tokens"] = 48
        result = stream_chat(router.port, body, on_first_byte=kill_on_victim_stream)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(180)
    assert killed.is_set(), "no request reached the victim engine"
    assert len(results) == 8
    for result in results:
        if result["bytes"] == 0:  # never started streaming: must have been answered elsewhere
            pytest.fail(f"a request that had not started streaming was lost: {result}")
        if not result["done"] or result["error"] is not None:
            assert result["engine"] == victim_name and result["bytes"] > 0, result  # a started stream, told
    survivors = [r for r in results if r["done"] and r["error"] is None]
    assert len(survivors) >= 6, results
    health = json.loads(router.client.request("GET", "/health")[1])
    assert [e["healthy"] for e in health["engines"] if e["engine"] == victim_name] == [False]
    metrics = router.client.metrics()
    failovers = metrics.get(("prefixcache_router_failovers_total", (("engine", victim_name),)), 0.0)
    assert failovers >= 1, results  # requests queued on the victim were moved, not lost
    after = stream_chat(router.port, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert after["status"] == 200 and after["done"] and after["engine"] != victim_name


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["route", "--engine", "localhost:8000"], "--engine"),
        (["route", "--engine", "http://a:8000=nowhere"], "--engine"),
        (["route", "--listen", "8080", "--engine", "http://a:8000"], "--listen"),
        (["route", "--engine", "http://a:8000", "--tier-rates", "host=fast"], "--tier-rates"),
        (["route", "--engine", "http://a:8000", "--tier-rates", "nvme=1e6"], "--tier-rates"),
        (["route", "--engine", "http://a:8000", "--match-timeout-ms", "0"], "--match-timeout-ms"),
        (["route", "--discover", "http://pods:8000=grpc"], "--discover"),
    ],
)
def test_bad_cli_input_names_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["route"], "--engine"),
        (["route", "--engine", "http://a:8000", "--engine", "http://a:8000/"], "--engine"),
        (["route", "--engine", "http://a:8000", "--tokenizer", "/nonexistent/checkpoint"], "--tokenizer"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixcache route: error: ") and named in err
