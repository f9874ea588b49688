"""One service (and one Redis) for engines of every block size (issue 34, part 2).

Two real service processes with the default 16-token blocks share one real redis-server, as on
two hosts. Engines of the same model attach with 16-, 32- and 48-token blocks (a reference
worker, a vLLM on CPU, an engine with an odd multiple): they get one namespace, each hit is a
whole number of the asking engine's blocks, and the bytes each reads are exactly the bytes
another engine of another block size stored, rearranged into its own blocks. That holds over
mapped shared memory, over the Fetch and Store streams, and across hosts through Redis. An
engine whose block size the service cannot store is refused, and the operator sees it on the
service (GetStats, ListNamespaces, `prefixcache namespaces`, the metrics), not only in the
engine's log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache.errors import InvalidArgument, UnknownLease
from prefixcache.kinds import MissReason
from tests.support.poll import poll
from tests.support.service import random_kv, same_bytes
from tests.support.worker_procs import CacheService

pytestmark = pytest.mark.process

BASE = 16
MODEL, REVISION = "mixed-blocks", "r1"


def layout(block_size: int) -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=8, block_size=block_size, dtype="bfloat16")


def as_engine_blocks(stored: torch.Tensor, block_size: int) -> torch.Tensor:
    """Service blocks `[n, L, 2, H, 16, D]` as the same tokens in `block_size`-token blocks (the
    reference: every engine block is its service blocks concatenated along the token axis)."""
    k = block_size // BASE
    groups = stored[: len(stored) // k * k].reshape(len(stored) // k, k, *stored.shape[1:])
    return torch.cat(list(groups.unbind(1)), dim=4)


def tokens(count: int, start: int) -> list[int]:
    return list(range(start, start + count))


@pytest.fixture(scope="module")
def services(redis_server, tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("block-sizes"))
    first = CacheService(root / "a", host_capacity="16MiB", redis_url=redis_server.url)
    second = CacheService(root / "b", host_capacity="16MiB", redis_url=redis_server.url)
    second.redis_key_prefix = first.redis_key_prefix  # one shared tier, as deployed
    with socket.socket() as probe:  # a free port for the first service's metrics
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    first.extra_args = ("--metrics-port", str(metrics_port))
    started = [first.start(), second.start()]
    try:
        yield first, second, metrics_port
    finally:
        for service in started:
            service.stop()


def attach(service: CacheService, block_size: int, same_host: bool = True) -> CacheClient:
    client = CacheClient(service.address, timeout_s=10)
    client.attach(MODEL, layout(block_size), revision=REVISION, same_host=same_host)
    return client


def drained(service: CacheService) -> bool:
    with CacheClient(service.address, timeout_s=10) as client:
        snapshot = client.stats().snapshot
    return snapshot is not None and snapshot.remote.get("queue_bytes", 1) == 0


def test_engines_of_three_block_sizes_share_one_service_and_its_redis(services) -> None:
    first, second, _ = services
    c16, c32, c48 = attach(first, 16), attach(first, 32), attach(first, 48, same_host=False)
    far32 = attach(second, 32, same_host=False)  # another host: only Redis is shared
    try:
        attachments = [c.attachment for c in (c16, c32, c48, far32)]
        assert len({a.namespace_id for a in attachments}) == 1, "one model and layout is one namespace"
        assert [a.layout.block_size for a in attachments] == [16, 32, 48, 32]
        assert [a.split for a in attachments] == [1, 2, 3, 2]
        assert c32.attachment.shared_memory and not c48.attachment.shared_memory

        # A 16-token engine stores 12 blocks (200 tokens: 12 full blocks and 8 more tokens).
        prompt = tokens(200, 1000)
        stored = random_kv(12, layout(16), seed=1)
        assert c16.store(prompt, stored).stored == 12

        # The 32-token engine hits 6 of its blocks, read from mapped memory, byte for byte.
        hit = c32.lookup(prompt)
        try:
            assert (hit.hit_tokens, hit.blocks, hit.split, hit.mapped_blocks) == (192, 6, 2, 6)
            assert hit.usable_blocks == 6
            assert same_bytes(c32.read(hit), as_engine_blocks(stored, 32))
            assert same_bytes(c32.read(hit, blocks=slice(2, 5)), as_engine_blocks(stored, 32)[2:5])
        finally:
            c32.release(hit)

        # The 48-token engine, over the Fetch stream: 4 of its blocks (192 tokens).
        hit = c48.lookup(prompt)
        try:
            assert (hit.hit_tokens, hit.blocks, hit.mapped_blocks) == (192, 4, 0)
            assert same_bytes(c48.read(hit), as_engine_blocks(stored, 48))
            assert same_bytes(c48.read(hit, blocks=slice(1, 3)), as_engine_blocks(stored, 48)[1:3])
        finally:
            c48.release(hit)

        # The other way round: blocks stored by 32- and 48-token engines, read at 16.
        for client, block, start in ((c32, 32, 5000), (c48, 48, 9000)):
            theirs = tokens(4 * block + 7, start)
            kv = random_kv(4, layout(block), seed=block)
            assert client.store(theirs, kv).stored == 4 * block // BASE  # counted in the service's blocks
            hit = c16.lookup(theirs)
            try:
                assert (hit.hit_tokens, hit.blocks) == (4 * block, 4 * block // BASE)
                assert same_bytes(as_engine_blocks(c16.read(hit), block), kv)
            finally:
                c16.release(hit)

        # A hit ends at the last whole engine block: 5 service blocks make 2 blocks of 32, not 3.
        short = tokens(110, 20000)  # 3 blocks of 32 (6 of 16); the service holds 5 of 16
        c16.store(short, random_kv(5, layout(16), seed=5))
        hit = c32.lookup(short, take_lease=False)
        assert (hit.hit_tokens, hit.miss_reason) == (64, MissReason.NOT_CACHED)
        assert c32.lookup(tokens(31, 20000), take_lease=False).miss_reason is MissReason.TOO_SHORT

        # Across hosts: the second service has none of it locally and reads Redis; the keys are
        # the 16-token blocks, whichever engine wrote them.
        poll(lambda: drained(first), timeout_s=30, what="the first service's Redis writes")
        hit = far32.lookup(prompt)
        try:
            assert hit.hit_tokens == 192, "the 16-token engine's blocks reach a 32-token engine on another host"
            assert same_bytes(far32.read(hit), as_engine_blocks(stored, 32))
        finally:
            far32.release(hit)

        listed = {entry.namespace_id: entry for entry in c16.namespaces()}
        assert listed[c16.attachment.namespace_id].engine_block_sizes == (16, 32, 48)
    finally:
        for client in (c16, c32, c48, far32):
            client.close()


def _pieces(client: CacheClient, hit, blocks: slice | None = None) -> list[tuple[int, torch.Tensor]]:
    got: list[tuple[int, torch.Tensor]] = []
    client.read_into(hit, lambda first, kv: got.append((first, kv.clone())), blocks=blocks)
    return got


def test_read_into_hands_mapped_runs_as_views_of_the_service_and_anything_else_as_one_read(services) -> None:
    """The connector's one-copy load (worker.py `_copy` on CPU): mapped runs reach the sink as
    views of the service's memory; a split or streamed hit as `read`'s tensor; and a lease that
    ended while the sink copied is an error after the sink ran, never bytes silently kept."""
    first, _, _ = services
    c16, c32, c48 = attach(first, 16), attach(first, 32), attach(first, 48, same_host=False)
    try:
        prompt = tokens(200, 40000)
        stored = random_kv(12, layout(16), seed=11)
        assert c16.store(prompt, stored).stored == 12
        mapped = c16._pools.host
        assert mapped is not None
        hit = c16.lookup(prompt)
        try:
            views: list[torch.Tensor] = []
            c16.read_into(hit, lambda first, kv: views.append(kv), blocks=slice(3, 11))
            assert views and all(
                view.untyped_storage().data_ptr() == mapped.data.untyped_storage().data_ptr() for view in views
            ), "a mapped run is handed over without a copy"
            pieces = _pieces(c16, hit, blocks=slice(3, 11))
            assert sum(len(kv) for _, kv in pieces) == 8
            assert same_bytes(torch.cat([kv for _, kv in pieces]), stored[3:11])
            sizes = [len(kv) for _, kv in pieces]
            assert [start for start, _ in pieces] == [sum(sizes[:i]) for i in range(len(pieces))]
            expired = dataclasses.replace(hit, lease_deadline=time.monotonic() - 1)
            ran: list[int] = []
            with pytest.raises(UnknownLease):
                c16.read_into(expired, lambda first, kv: ran.append(len(kv)))
            assert sum(ran) == 12, "the sink ran, and the error says its bytes are not to be kept"
        finally:
            c16.release(hit)
        for client, block in ((c32, 32), (c48, 48)):  # split into service blocks; over the stream
            hit = client.lookup(prompt)
            try:
                pieces = _pieces(client, hit, blocks=slice(1, 3))
                assert [(start, len(kv)) for start, kv in pieces] == [(0, 2)]
                assert same_bytes(pieces[0][1], as_engine_blocks(stored, block)[1:3])
            finally:
                client.release(hit)
    finally:
        for client in (c16, c32, c48):
            client.close()


def test_a_block_size_the_service_cannot_store_is_refused_and_shown_to_the_operator(services) -> None:
    first, _, metrics_port = services
    client = CacheClient(first.address, timeout_s=10)
    try:
        with pytest.raises(InvalidArgument) as refused:
            client.attach("odd-engine", layout(24), revision="v9")
        assert refused.value.field == "layout.block_size"
        assert "not a multiple of this service's block size 16" in str(refused.value)
        with pytest.raises(InvalidArgument):
            client.attach("odd-engine", layout(24), revision="v9")

        assert client.stats().attach_refusals["layout.block_size"] >= 2
        latest = client.refused_attaches()[0]
        assert (latest.model, latest.revision, latest.field, latest.count) == (
            "odd-engine",
            "v9",
            "layout.block_size",
            2,
        )
        assert "24 is not a multiple" in latest.reason and latest.seconds_since_last < 60
    finally:
        client.close()

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert 'prefixcache_attach_refusals_total{field="layout.block_size"} 2.0' in metrics

    command = [sys.executable, "-m", "prefixcache_services", "namespaces", "--cache", first.address]
    doc = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, check=True).stdout)
    assert doc["refused"][0]["model"] == "odd-engine" and doc["refused"][0]["count"] == 2
    wide = {**os.environ, "COLUMNS": "240"}
    table = subprocess.run(command, capture_output=True, text=True, check=True, env=wide).stdout
    for needle in ("refused attaches", "odd-engine", "layout.block_size", "24 is not a multiple"):
        assert needle in table, table
