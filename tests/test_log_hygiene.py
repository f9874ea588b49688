"""Logs, metrics and error messages never carry token ids, prompt text, salts or bearer tokens.

A real `prefixcache serve` process (`--log-level DEBUG`, a credentials file, the Prometheus
exporter) and a real `prefixcache worker` process (DEBUG, authenticated as a tenant) handle a
secret prompt: stored, looked up, read back over shared memory and over the stream, inspected,
evicted, hit again through the worker, and sent in bad requests of every kind. Then no captured
log line (both processes' stderr), no scraped metric and no error message contains any of:
the secret token ids (decimal) or their bytes (hex), the secret prompt text, the raw salts,
or any bearer token (right or wrong).

Positive controls: the service log holds DEBUG lines for the calls, failures included (so the
error messages did pass through logging), the worker's second request is a cache hit, and every
bad request did fail.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache.errors import PrefixCacheError
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.rpc import cache_pb2_grpc as pb_grpc
from tests.support.isolation import write_credentials
from tests.support.redis_server import free_port
from tests.support.worker_procs import WorkerClient

pytestmark = [pytest.mark.redis, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent
READY = "prefixcache serve: listening on "
METRICS = "prefixcache serve: metrics on port "
DEADLINE_S = 120.0

RNG = secrets.SystemRandom()
BLOCK = 16
SECRET_TOKENS = [RNG.randrange(3_000_000_000, 1 << 32) for _ in range(4 * BLOCK + 5)]
SECRET_SALT = f"salt-{secrets.token_hex(8)}"
SECRET_TEXT = f"the launch code is {secrets.token_hex(6)} and the vault word is {secrets.token_hex(6)}"
WORKER_SALT = f"wsalt-{secrets.token_hex(8)}"
WRONG_TOKEN = f"tok-wrong-{secrets.token_hex(16)}"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def _start_service(workdir: Path, credentials: Path, port: int) -> tuple[subprocess.Popen, Path]:
    log = workdir / "service.log"
    command = [
        sys.executable,
        "-m",
        "prefixcache_services",
        "--log-level",
        "DEBUG",
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--credentials",
        str(credentials),
        "--metrics-port",
        "0",
        "--host-capacity",
        "4MiB",
        "--shm-name",
        f"pfx-hygiene-{secrets.token_hex(4)}",
        "--grace",
        "2s",
        "--workers",
        "4",
    ]
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=sink, text=True)
    return process, log


def _wait_service(process: subprocess.Popen, log: Path) -> tuple[str, int]:
    address = metrics = None
    deadline = time.monotonic() + DEADLINE_S
    while (address is None or metrics is None) and time.monotonic() < deadline:
        line = process.stdout.readline()  # the two lines come right after start-up
        if not line:
            break
        if line.startswith(READY):
            address = line[len(READY) :].strip()
        elif line.startswith(METRICS):
            metrics = int(line[len(METRICS) :])
    if address is None or metrics is None:
        pytest.fail(f"service did not start: {log.read_text()[-2000:]}")
    return address, metrics


def _start_worker(workdir: Path, address: str, token: str) -> tuple[subprocess.Popen, Path, WorkerClient]:
    log, port = workdir / "worker.log", free_port()
    command = [
        sys.executable,
        "-m",
        "prefixcache_services",
        "--log-level",
        "DEBUG",
        "worker",
        "--listen",
        f"127.0.0.1:{port}",
        "--cache",
        address,
        "--auth-token",
        token,
        "--cache-deadline-ms",
        "5000",
        "--hit-policy",
        "always",
    ]
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=sink, stderr=subprocess.STDOUT)
    return process, log, WorkerClient("127.0.0.1", port)


def _wait_healthy(process: subprocess.Popen, client: WorkerClient, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not client.healthy():
        assert process.poll() is None, f"worker exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"worker not healthy: {log.read_text()[-2000:]}"
        time.sleep(0.05)


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM all at once, then wait (SIGKILL past the deadline)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _failure(call) -> str:
    """The error text a client gets from a call that must fail (details and trailing metadata)."""
    try:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as error:
        return f"{error.code().name} {error.details()} {error.trailing_metadata()}"
    except PrefixCacheError as error:
        return f"{type(error).__name__} {error}"
    pytest.fail("a bad request succeeded")


def _kv(layout: KVLayout, blocks: int) -> torch.Tensor:
    return torch.randn(blocks, *layout.block_shape).to(layout.dtype.torch)


def _exercise_service(address: str, tokens) -> list[str]:
    """The secret prompt through every call, then bad requests carrying it; returns the errors."""
    errors: list[str] = []
    with ExitStack() as stack:
        local = stack.enter_context(CacheClient(address, auth_token=tokens.acme, timeout_s=20))
        remote = stack.enter_context(CacheClient(address, auth_token=tokens.globex, timeout_s=20))
        layout = local.stats().layout  # the worker's, fixed by its Attach
        assert layout is not None and layout.block_size == BLOCK, "the worker never attached"
        store_kv = _kv(layout, 4)
        local.attach("m", layout, cache_salt=SECRET_SALT)
        remote.attach("m", layout, same_host=False)
        for client in (local, remote):
            assert client.store(SECRET_TOKENS, store_kv, cache_salt=SECRET_SALT).stored == 4
            hit = client.lookup(SECRET_TOKENS, cache_salt=SECRET_SALT)
            assert hit.hit_tokens == 4 * BLOCK
            client.read(hit)
            client.release(hit)
            assert client.inspect(SECRET_TOKENS, cache_salt=SECRET_SALT).hit_tokens == hit.hit_tokens
        ns = remote.attachment.namespace_id
        stub = pb_grpc.PrefixCacheStub(stack.enter_context(grpc.insecure_channel(address)))
        auth = (("authorization", f"Bearer {tokens.globex}"),)
        header = pb.StoreHeader(
            namespace_id=ns,
            tokens=SECRET_TOKENS,
            block_count=4,
            dtype=layout.dtype.code,
            block_shape=list(layout.block_shape),
            cache_salt=SECRET_SALT,
        )
        bad_calls = [
            lambda: remote.lookup([*SECRET_TOKENS, 1 << 33]),
            lambda: remote.lookup(SECRET_TOKENS, cache_salt=SECRET_SALT + "\x00"),
            lambda: remote.lookup(SECRET_TOKENS, cache_salt=SECRET_SALT * 9),
            lambda: remote.evict(namespace_id="0123456789abcdef", prefix_tokens=SECRET_TOKENS),
            lambda: remote.inspect(SECRET_TOKENS, namespace_id=local.attachment.namespace_id),
            lambda: stub.Commit(
                pb.CommitRequest(namespace_id=ns, tokens=SECRET_TOKENS, reservation_id=7, cache_salt=SECRET_SALT),
                metadata=auth,
            ),
            lambda: stub.Store(
                iter([pb.StoreRequest(header=header), pb.StoreRequest(data=b"\x01" * 10)]), metadata=auth
            ),
            lambda: stub.Lookup(
                pb.LookupRequest(namespace_id=ns, tokens=SECRET_TOKENS),
                metadata=(("authorization", f"Bearer {WRONG_TOKEN}"),),
            ),
            lambda: stub.GetStats(pb.GetStatsRequest(), metadata=(("authorization", f"Bearer {tokens.acme}x"),)),
        ]
        errors += [_failure(call) for call in bad_calls]
        assert remote.evict(prefix_tokens=SECRET_TOKENS, cache_salt=SECRET_SALT) == 1  # its last block
    return errors


def _exercise_worker(client: WorkerClient) -> list[str]:
    body = {"prompt": SECRET_TEXT * 4, "max_tokens": 2, "temperature": 0, "cache_salt": WORKER_SALT}
    first = client.complete(body["prompt"], max_tokens=2, cache_salt=WORKER_SALT)
    # The store lands after the response (off the inference thread): the second request waits for it.
    second = first
    for _ in range(100):
        second = client.complete(body["prompt"], max_tokens=2, cache_salt=WORKER_SALT)
        if second.cached_tokens:
            break
        time.sleep(0.1)
    assert first.cached_tokens == 0 and second.cached_tokens > 0, "the worker's second request must hit"
    bad = [
        {**body, "cache_salt": WORKER_SALT + "\x01"},
        {**body, "max_tokens": -1},
        {**body, "n": 2},
        {"messages": [{"role": "user", "content": SECRET_TEXT}], "temperature": 9},
    ]
    errors = []
    for payload in bad:
        reply = client.post("/v1/chat/completions" if "messages" in payload else "/v1/completions", payload)
        assert reply.status == 400, reply
        errors.append(str(reply.body))
    status, raw, _ = client.request("POST", "/v1/completions", b'{"prompt": "' + SECRET_TEXT.encode() + b'",')
    assert status == 400
    errors.append(raw.decode())
    return errors


def _secrets(tokens) -> list[str]:
    blocks = np.asarray(SECRET_TOKENS[: 4 * BLOCK], dtype="<u4").reshape(4, -1)
    return [
        *map(str, SECRET_TOKENS),
        *(block.tobytes().hex() for block in blocks),
        SECRET_SALT,
        WORKER_SALT,
        SECRET_TEXT,
        *SECRET_TEXT.split()[4::6],
        tokens.acme,
        tokens.globex,
        tokens.ops,
        WRONG_TOKEN,
    ]


def test_secrets_never_reach_logs_metrics_or_errors(tmp_path: Path) -> None:
    credentials, tokens = write_credentials(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    service, service_log = _start_service(tmp_path, credentials, int(address.rpartition(":")[2]))
    worker, worker_log, worker_client = _start_worker(tmp_path, address, tokens.globex)  # both start at once
    try:
        _, metrics_port = _wait_service(service, service_log)
        _wait_healthy(worker, worker_client, worker_log)
        worker_client.complete("warm up the cache link", max_tokens=1)  # the worker's Attach fixes the layout
        errors = _exercise_service(address, tokens)
        errors += _exercise_worker(worker_client)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        _stop([worker, service])
    service_text, worker_text = service_log.read_text(), worker_log.read_text()
    assert "DEBUG prefixcache_services.cache_server.status: Lookup OK" in service_text  # DEBUG was on, per call
    assert "INVALID_ARGUMENT" in service_text and "Store INVALID_ARGUMENT" in service_text  # failures logged
    assert "prefixcache_lookups" in metrics and "DEBUG" in worker_text
    leaks = [
        (where, secret)
        for secret in _secrets(tokens)
        for where, text in (
            ("service log", service_text),
            ("worker log", worker_text),
            ("metrics", metrics),
            *((f"error {i}", e) for i, e in enumerate(errors)),
        )
        if secret in text
    ]
    assert not leaks, f"secrets found: {leaks}"
