"""`python -m prefixcache_services serve` as a real process: readiness line, SIGTERM drain, exit 0, shm unlinked.

A Fetch stream larger than gRPC's flow-control windows is in flight when
SIGTERM arrives; the service must finish it byte for byte, then exit 0 and
leave no shared-memory segment behind.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.rpc import cache_pb2_grpc as pb_grpc
from tests.support import lifetime

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
READY = "prefixcache serve: listening on "


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def _start(*extra: str, grace: str = "20s"):
    """A `serve` subprocess; returns (process, address, shm name, stderr lines)."""
    shm_name = f"pfx-test-{secrets.token_hex(4)}"
    process = lifetime.popen(
        [
            sys.executable,
            "-m",
            "prefixcache_services",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--host-capacity",
            "48MiB",
            "--shm-name",
            shm_name,
            "--grace",
            grace,
            "--workers",
            "4",
            *extra,
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = queue.Queue(), queue.Queue()
    threading.Thread(target=_lines, args=(process.stdout, out), daemon=True).start()
    threading.Thread(target=_lines, args=(process.stderr, err), daemon=True).start()
    address = None
    deadline = time.monotonic() + 30
    while address is None and time.monotonic() < deadline:
        try:
            line = out.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith(READY):
            address = line[len(READY) :].strip()
    if address is None:
        process.kill()
        pytest.fail(f"service did not report readiness: {''.join(_drain(err))}")
    return process, address, shm_name, err


@pytest.fixture
def service():
    """A `serve` subprocess; yields (process, address, shm name, stderr lines)."""
    started = _start()
    yield started
    process = started[0]
    if process.poll() is None:
        process.kill()
        process.wait(10)


def _drain(sink: queue.Queue) -> list[str]:
    lines = []
    while True:
        try:
            line = sink.get(timeout=5)
        except queue.Empty:
            return lines
        if line is None:
            return lines
        lines.append(line)


def test_sigterm_drains_a_fetch_stream_then_exits_zero(service):
    process, address, shm_name, stderr = service
    layout = KVLayout(layers=4, kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16")  # 128 KiB blocks
    client = CacheClient(address, timeout_s=10)
    assert client.attach("model", layout).shared_memory  # same host: the segment is mappable
    assert Path("/dev/shm", shm_name).exists()
    tokens = list(range(256 * 16))
    kv = torch.randint(-(2**15), 2**15, (256, *layout.block_shape), dtype=torch.int16).view(torch.bfloat16)
    assert client.store(tokens, kv).stored == 256  # 32 MiB
    hit = client.lookup(tokens)
    channel = grpc.insecure_channel(address)
    stream = pb_grpc.PrefixCacheStub(channel).Fetch(pb.FetchRequest(lease_id=hit.lease_id, max_chunk_bytes=1 << 20))
    received = [next(stream).data]
    process.send_signal(signal.SIGTERM)
    # The rest is read only once the service says it drains: flow control holds the stream's
    # generator meanwhile, so the call is in flight then, however late the signal is handled
    # (reading on at once let a loaded box finish the stream first: "0 call(s) in flight").
    lines: list[str] = []
    while not any("draining:" in line for line in lines):
        line = stderr.get(timeout=30)
        assert line is not None, "".join(lines)  # the service exited without draining
        lines.append(line)
    assert "draining: 1 call(s) in flight" in lines[-1], "".join(lines)
    received += [chunk.data for chunk in stream]
    assert process.wait(30) == 0
    assert b"".join(received) == kv.view(torch.uint8).numpy().tobytes()
    log = "".join(lines + _drain(stderr))
    assert "stopped" in log, log
    assert not Path("/dev/shm", shm_name).exists()  # the host tier was unlinked
    client.close()
    channel.close()


def test_sigterm_after_the_segment_file_was_removed_still_closes_everything(private_redis):
    """Issue 15.3: `rm /dev/shm/<segment>` while serving. Traffic goes on (the mapping stays);
    SIGTERM then logs the missing segment once, still drains the Redis write queue and exits 0."""
    process, address, shm_name, stderr = _start(
        "--redis-url", private_redis.url, "--redis-key-prefix", "rmshm", grace="2s"
    )
    try:
        layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_size=16, dtype="float16")
        with CacheClient(address, timeout_s=10) as client:
            client.attach("model", layout)
            tokens = list(range(8 * 16))
            kv = torch.randint(-(2**15), 2**15, (8, *layout.block_shape), dtype=torch.int16).view(torch.float16)
            assert client.store(tokens, kv).stored == 8
            Path("/dev/shm", shm_name).unlink()
            hit = client.lookup(tokens)  # still served from the mapping
            assert hit.blocks == 8 and torch.equal(client.read(hit).view(torch.int16), kv.view(torch.int16))
            client.release(hit)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        log = "".join(_drain(stderr))
        assert log.count("was already removed") == 1, log
        assert "error" not in log.lower() and "Traceback" not in log, log
        assert log.rstrip().endswith("stopped"), log  # every step of close ran
        assert len(private_redis.client().keys("rmshm*")) >= 8  # the write-through reached Redis
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
