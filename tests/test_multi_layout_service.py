"""One running service, namespaces of two KV layouts: one budget, both hit, the shm path per chunk.

A real gRPC server (in this process) over a shared-memory host tier cut into chunks of 30720
bytes: layout A (3840-byte blocks, 8 a chunk, tiled) attaches first; layout B (7168-byte
blocks: 4 a chunk, not tiling it, so addresses only follow from the chunk arithmetic) joins.
A separate Python process maps the segment as a worker does, writes and reads B's slots in
chunks other than 0, and the bytes are compared through the service's own Fetch stream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prefixcache.config import KVLayout
from prefixcache.rpc import cache_pb2 as pb
from tests.support.service import BLOCK, ROOT, layout_of, prompt, random_kv, running_servers, same_bytes

pytestmark = pytest.mark.process

A = layout_of()  # 3840 bytes a block
B = KVLayout(layers=2, kv_heads=1, head_dim=28, block_size=BLOCK, dtype="float32")  # 7168 bytes
CHUNK = 8 * A.block_bytes  # 30720: B holds 4 (28672 bytes) and leaves a gap before the next chunk
CHUNKS = 8

CHILD = r"""
import json, sys
import numpy as np
from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache.rpc import cache_pb2 as pb
from tests.support.service import BLOCK, prompt, random_kv, same_bytes

address = sys.argv[1]
layout = KVLayout(layers=2, kv_heads=1, head_dim=28, block_size=BLOCK, dtype="float32")
client = CacheClient(address, timeout_s=10)
attachment = client.attach("model-b", layout)
assert attachment.shared_memory, "the worker process must map the host tier"
mine = prompt(6, start=5000)
result = client.store(mine, random_kv(6, layout, seed=11))  # Reserve, write the mapped slots, Commit
theirs = prompt(6, start=7000)  # stored by the parent through the Store stream
hit = client.lookup(theirs)
try:
    read = client.read(hit)  # from the mapped segment
finally:
    client.release(hit)
own = client.lookup(mine)
try:
    back = client.read(own)
finally:
    client.release(own)
print(json.dumps({
    "stored": result.stored,
    "theirs_hit": hit.hit_tokens,
    "theirs_same": same_bytes(read, random_kv(6, layout, seed=22)),
    "own_same": same_bytes(back, random_kv(6, layout, seed=11)),
    "own_slots": own.locations.slots.tolist(),
    "theirs_slots": hit.locations.slots.tolist(),
    "per_chunk": client._pools.host.per_chunk,
}))
client.close()
"""


def test_a_worker_process_reads_and_writes_a_second_layout_through_shared_memory() -> None:
    with running_servers() as start:
        server = start(host_capacity=CHUNKS * CHUNK, chunk_bytes=CHUNK)
        first = start.client(server)
        first.attach("model-a", A)
        for n in range(2):  # A fills chunks 0 and 1
            assert first.store(prompt(8, start=100 * n + 100), random_kv(8, A, seed=n)).stored == 8
        stream = start.client(server)
        stream.attach("model-b", B, same_host=False)
        assert stream.store(prompt(6, start=7000), random_kv(6, B, seed=22)).stored == 6
        child = subprocess.run(
            [sys.executable, "-c", CHILD, server.address],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        report = json.loads(child.stdout.strip().splitlines()[-1])
        assert report["stored"] == 6 and report["theirs_hit"] == 6 * BLOCK
        assert report["theirs_same"] and report["own_same"]
        per_chunk = report["per_chunk"]
        assert per_chunk == 4
        chunks = {slot // per_chunk for slot in report["own_slots"] + report["theirs_slots"]}
        assert 0 not in chunks and len(chunks) >= 3  # chunks 0 and 1 hold A's blocks
        assert any(np.diff(np.asarray(report["own_slots"]) // per_chunk).tolist())  # a run across chunks
        hit = stream.lookup(prompt(6, start=5000))  # what the child wrote, read by the service itself
        try:
            assert same_bytes(stream.read(hit), random_kv(6, B, seed=11))
        finally:
            stream.release(hit)
        hit = first.lookup(prompt(8, start=100))  # A's blocks untouched beside B's
        try:
            assert same_bytes(first.read(hit), random_kv(8, A, seed=0))
        finally:
            first.release(hit)


def test_two_layouts_share_the_budget_and_the_stats_show_both() -> None:
    with running_servers() as start:
        server = start(host_capacity=CHUNKS * CHUNK, chunk_bytes=CHUNK)
        a, b = start.client(server), start.client(server)
        ns_a = a.attach("model-a", A).namespace_id
        ns_b = b.attach("model-b", B).namespace_id
        for n in range(CHUNKS):  # A fills every chunk
            assert a.store(prompt(8, start=1000 * n + 1000), random_kv(8, A, seed=n)).stored == 8
        full = a.stats().snapshot.tiers[0]
        assert full.bytes_used == CHUNKS * CHUNK == full.capacity_bytes
        for n in range(3):  # B's traffic takes room from A: three chunks of A go
            assert b.store(prompt(4, start=50_000 + 100 * n), random_kv(4, B, seed=100 + n)).stored == 4
        assert [a.lookup(prompt(8, start=1000 * n + 1000), take_lease=False).hit_tokens for n in range(CHUNKS)] == [
            0,
            0,
            0,
            *[8 * BLOCK] * 5,
        ]  # the least recently used
        assert all(
            b.lookup(prompt(4, start=50_000 + 100 * n), take_lease=False).hit_tokens == 4 * BLOCK for n in range(3)
        )
        tier = a.stats().snapshot.tiers[0]
        assert tier.blocks == 5 * 8 + 3 * 4
        assert tier.bytes_used == 5 * 8 * A.block_bytes + 3 * 4 * B.block_bytes <= tier.capacity_bytes
        listed = {entry.namespace_id: entry for entry in a.namespaces()}
        assert set(listed) == {ns_a, ns_b}
        assert sum(listed[ns_a].blocks.values()) == 40 and sum(listed[ns_b].blocks.values()) == 12
        raw = a._stub.ListNamespaces(pb.ListNamespacesRequest())  # the bytes the service reports
        bytes_of = {n.namespace_id: sum(t.bytes for t in n.tiers) for n in raw.namespaces}
        assert bytes_of == {ns_a: 40 * A.block_bytes, ns_b: 12 * B.block_bytes}
