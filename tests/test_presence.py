"""The presence table: the service's indexed blocks in shared memory, read by same-host clients
(prefixcache/presence.py). It follows every store, eviction and flush of a real service; it is
published where it follows all a Lookup can hit (not with a disk tier); a client that cannot read it looks up
as before; the reference worker sends no Lookup the table shows cannot hit. Real services
(real gRPC, real shared memory) and real Redis."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError, InvalidArgument
from prefixcache.hashing import Hasher
from prefixcache.presence import STALE_S, WAYS, PresenceTable, PresenceView, fingerprints, table_bytes
from prefixcache.tiers.disk import DiskOptions
from prefixcache.tiers.shm import SHM_DIR, OwnedSegment
from prefixcache_services.cache_server.auth import Authenticator
from prefixcache_services.cache_server.backend import BackendOptions
from prefixcache_services.cache_server.options import ServerOptions
from prefixcache_services.cache_server.server import build_server
from prefixcache_services.worker.cache_link import WorkerLink
from prefixcache_services.worker.hit_policy import HitPolicy
from prefixcache_services.worker.model import load_model
from tests.support.service import BLOCK, layout_of, prompt, random_kv, running_servers

pytestmark = pytest.mark.process


@pytest.fixture
def start():
    with running_servers() as make:
        yield make


def _store(client, tokens: list[int], seed: int = 0) -> int:
    """Store every full block of `tokens`; the blocks stored (not already held)."""
    return client.store(tokens, random_kv(len(tokens) // BLOCK, layout_of(), seed=seed)).stored


def test_a_same_host_client_reads_what_the_index_holds(start):
    server = start()
    client = start.client(server)
    client.attach("model", layout_of())
    tokens = prompt(6)
    assert client.held_tokens(tokens) == 0  # nothing stored yet
    _store(client, tokens[: 4 * BLOCK])
    assert client.held_tokens(tokens) == 4 * BLOCK
    _store(client, tokens)
    assert client.held_tokens(tokens) == 6 * BLOCK
    forked = tokens[: 3 * BLOCK] + [7] * (3 * BLOCK)
    assert client.held_tokens(forked) == 3 * BLOCK  # the chain: block 3 differs, so does every later hash
    other = start.client(server)
    other.attach("model", layout_of(), cache_salt="tenant-b")  # another namespace: other hashes
    assert other.held_tokens(tokens) == 0
    # What the table says, a Lookup confirms: the same prefix, to the block.
    assert client.lookup(forked, take_lease=False).hit_tokens == 3 * BLOCK


def test_a_salted_prompt_is_read_under_its_own_salt(start):
    """A view hashes a salted prompt from its salt's root (the attach's `salt_head`/`salt_tail`):
    the blocks stored under that salt, none of another salt's or the unsalted namespace's."""
    server = start()
    client = start.client(server)
    client.attach("model", layout_of())
    tokens = prompt(6)
    assert client.held_tokens(tokens, cache_salt="tenant-a") == 0
    client.store(tokens[: 4 * BLOCK], random_kv(4, layout_of(), seed=5), cache_salt="tenant-a")
    assert client.held_tokens(tokens, cache_salt="tenant-a") == 4 * BLOCK
    assert client.held_tokens(tokens) == 0 and client.held_tokens(tokens, cache_salt="tenant-b") == 0
    _store(client, tokens[: 2 * BLOCK])
    assert client.held_tokens(tokens) == 2 * BLOCK and client.held_tokens(tokens, cache_salt="tenant-a") == 4 * BLOCK
    assert client.lookup(tokens, cache_salt="tenant-a", take_lease=False).hit_tokens == 4 * BLOCK
    # A salt no Lookup would take: no answer, and the Lookup names the field.
    assert client.held_tokens(tokens, cache_salt="bad\nsalt") is None
    with pytest.raises(InvalidArgument) as refused:
        client.lookup(tokens, cache_salt="bad\nsalt", take_lease=False)
    assert refused.value.field == "cache_salt"
    # A service that sent no salt gap (before it existed): salted prompts are not answered.
    view = client._presence
    old = PresenceView(server.backend.presence_of(client.attachment.namespace_id)[0], view.root, view.hasher, BLOCK)
    assert old.held_tokens(tokens) == 2 * BLOCK and old.held_tokens(tokens, "tenant-a") is None


def test_evictions_and_flushes_leave_the_table(start):
    server = start()
    client = start.client(server)
    client.attach("model", layout_of())
    tokens = prompt(6)
    _store(client, tokens)
    assert client.evict(prefix_tokens=tokens[: 4 * BLOCK + 1]) > 0  # the blocks from 4 on, ... (prefix + 1 token)
    held = client.held_tokens(tokens)
    assert held is not None and held == client.lookup(tokens, take_lease=False).hit_tokens < 6 * BLOCK
    _store(client, tokens, seed=1)
    assert client.held_tokens(tokens) == 6 * BLOCK
    assert client.flush() == 6
    assert client.held_tokens(tokens) == 0


def test_the_table_follows_the_index_through_lru_churn(start):
    """Many prompts through a host tier of 16 blocks: capacity evictions on every store. After
    each, the table holds exactly the indexed blocks (a block displaced from a full row aside)."""
    server = start(host_capacity=16 * layout_of().block_bytes)
    client = start.client(server)
    client.attach("model", layout_of())
    rng = random.Random(5)
    prompts = [prompt(rng.randint(1, 5), start=1000 * i) for i in range(40)]
    cache = server.backend.cache
    table = cache.index.presence
    assert table is not None
    for round_ in range(120):
        tokens = rng.choice(prompts)
        _store(client, tokens, seed=round_)
        live = cache.index.live()
        indexed = set(cache.index.map.words[0][live].tolist())
        published = set(table.cells[table.cells != 0].tolist())
        assert published <= indexed, "a block left the index but not the table"
        for missing in indexed - published:
            assert np.count_nonzero(table.cells[missing & int(table.mask)]) == WAYS  # displaced, not lost
        held = client.held_tokens(tokens)
        assert held == client.lookup(tokens, take_lease=False).hit_tokens


def test_a_full_row_displaces_one_block_and_removal_clears_only_its_own():
    segment = OwnedSegment(f"prefixcache-test-held-{os.getpid()}", table_bytes(16), directory=SHM_DIR)
    try:
        table = PresenceTable(segment.buf, 16)
        rows = len(table.cells)
        same_row = np.array([(i << 32) | 3 for i in range(1, WAYS + 2)], dtype=np.uint64)  # all in row 3
        table.add(same_row)  # WAYS + 1 blocks in one batch into one row: the last displaces one
        assert np.count_nonzero(table.cells[3]) == WAYS and rows > 3
        kept = set(table.cells[3].tolist())
        assert len(kept & set(same_row.tolist())) == WAYS
        table.discard(same_row[:2])
        assert set(table.cells[3].tolist()) == (kept - set(same_row[:2].tolist())) | {0}
        table.add(np.zeros(1, dtype=np.uint64))  # a zero word is stored as 1 (0 marks an empty cell)
        assert 1 in table.cells[1].tolist()
        hasher = Hasher()
        root = b"r" * 16
        tokens = list(range(4 * BLOCK))
        hashes = hasher.block_hashes(root, np.asarray(tokens, dtype=np.uint32), BLOCK)
        table.add(fingerprints(hashes[:2]))
        view = PresenceView(segment.name, root, hasher, BLOCK)
        assert view.held_tokens(tokens) == 2 * BLOCK
        table.add(fingerprints(hashes[3:]))  # block 2 missing: the chain stops there
        assert view.held_tokens(tokens) == 2 * BLOCK
        table.release()
    finally:
        segment.close()


def test_a_segment_that_is_not_a_table_is_refused_naming_it():
    segment = OwnedSegment(f"prefixcache-test-notheld-{os.getpid()}", 4096, directory=SHM_DIR)
    empty = SHM_DIR / f"prefixcache-test-empty-{os.getpid()}"
    empty.touch(mode=0o600)
    try:
        with pytest.raises(ConfigError, match="presence.*not a presence table"):
            PresenceView(segment.name, b"r" * 16, Hasher(), BLOCK)
        with pytest.raises(ConfigError, match="presence.*too short"):
            PresenceView(empty.name, b"r" * 16, Hasher(), BLOCK)
    finally:
        segment.close()
        empty.unlink()


def test_no_table_where_a_lookup_can_hit_more_than_the_table_follows(tmp_path):
    """With a disk tier a Lookup also finds spilled blocks the table does not follow: no table, and
    clients look up every prompt. (A Redis tier's blocks it follows: tests/test_redis_presence.py.)"""
    layout = layout_of()
    backend = BackendOptions(
        cache=CacheConfig(host_capacity=16 * layout.block_bytes),
        block_size=BLOCK,
        disk=DiskOptions(str(tmp_path / "disk"), capacity_bytes="4MiB", file_bytes="1MiB", chunk_bytes="256KiB"),
    )
    server = build_server(ServerOptions(backend=backend, listen="127.0.0.1:0", authenticator=Authenticator.open()))
    try:
        with running_servers() as make:
            client = make.client(server)
            client.attach("model", layout)
            _store(client, prompt(2))
            assert client.held_tokens(prompt(2)) is None
            assert server.backend.presence_of(client.attachment.namespace_id) is None
    finally:
        server.shutdown(0)


def test_a_client_off_the_host_or_of_a_stopped_service_reads_none(start):
    server = start()
    remote = start.client(server)
    remote.attach("model", layout_of(), same_host=False)
    assert remote.held_tokens(prompt(2)) is None
    local = start.client(server)
    local.attach("model", layout_of())
    name = server.backend.presence_of(local.attachment.namespace_id)[0]
    assert (SHM_DIR / name).exists()
    server.shutdown(0)
    assert not (SHM_DIR / name).exists()  # unlinked with the service
    assert local.held_tokens(prompt(2)) is None  # the mapping stays readable (no crash), and says it is not kept


def test_a_table_no_longer_kept_reads_as_none():
    """A killed service's table stops beating; a closed one's says so at once: engines then look
    up (their Lookup fails, and re-attaching maps the new service's table)."""
    capacity = 64
    segment = OwnedSegment(f"prefixcache-test-beat-{os.getpid()}", table_bytes(capacity), directory=SHM_DIR)
    try:
        table = PresenceTable(segment.buf, capacity)
        table.beat_every(0.01)
        view = PresenceView(segment.name, b"r" * 16, Hasher(), BLOCK)
        assert view.held_tokens(prompt(2)) == 0 and view.kept()
        table.stop_beating()
        table._beat[0] = time.monotonic_ns() - int((STALE_S + 1) * 1e9)  # as a hung or killed writer leaves it
        assert view.held_tokens(prompt(2)) is None and not view.kept()  # stale
        table._beat[0] = time.monotonic_ns()
        assert view.held_tokens(prompt(2)) == 0
        table.stop_beating()  # closed: 0
        assert view.held_tokens(prompt(2)) is None
        table._beat[0] = time.monotonic_ns()
        (SHM_DIR / segment.name).unlink()  # a restarted service (or a cleaner) removed the dead one's name
        assert view.held_tokens(prompt(2)) is None and not view.kept()
        table.release()
    finally:
        segment.close()


def test_the_reference_worker_looks_up_only_prompts_the_table_shows_held(start):
    """WorkerLink.lookup: a prompt of which the table shows no block costs no Lookup (the
    request prefills in full, as after a miss); once stored, the same prompt is looked up and
    hits; a salted prompt likewise, under its own salt."""
    server = start()
    stats = start.client(server)
    registry = CollectorRegistry()
    policy = HitPolicy(registry, always_take=True)
    link = WorkerLink(server.address, load_model("tiny"), BLOCK, deadline_s=5.0, registry=registry, policy=policy)
    try:
        assert link.connect()
        tokens, other = prompt(4), prompt(4, start=5000)

        def lookups() -> tuple[int, float]:
            return stats.stats().snapshot.lookups, registry.get_sample_value("prefixcache_worker_lookups_skipped_total")

        assert link.lookup(tokens, None) == (None, None)
        assert lookups() == (0, 1)
        kv = random_kv(4, link.layout, seed=3)
        link.store(tokens, kv, start_block=0, salt=None)
        hit, prefix = link.lookup(tokens, None)
        assert hit is not None and hit.blocks == 4 and prefix is not None
        assert torch.equal(prefix.view(torch.uint8), kv[: len(prefix)].view(torch.uint8))
        link.release(hit)
        assert lookups() == (1, 1)
        assert link.lookup(other, None) == (None, None)  # nothing of it held: skipped again
        assert link.lookup(other, "tenant-b") == (None, None)  # nor under a salt
        assert lookups() == (1, 3)
        salted = random_kv(4, link.layout, seed=4)
        link.store(other, salted, start_block=0, salt="tenant-b")
        hit, prefix = link.lookup(other, "tenant-b")
        assert hit is not None and hit.blocks == 4 and prefix is not None
        assert torch.equal(prefix.view(torch.uint8), salted[: len(prefix)].view(torch.uint8))
        link.release(hit)
        assert lookups() == (2, 3)
        assert link.lookup(other, None) == (None, None)  # unsalted: still nothing held
        assert link.lookup(tokens, "tenant-b") == (None, None)  # stored unsalted only
        assert lookups() == (2, 5)
    finally:
        link.close()
