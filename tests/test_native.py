"""The compiled core (prefixcache/_core.c): it is what the library imports, an unbuilt tree says how
to build it, and its kernels' edge cases (empty and partial prompts, collisions, expiry, long
prompts, bad buffers) answer as the index's contract says. Reference hashes come from the
xxhash package (python-xxhash, the implementation the keys were first written with)."""

from __future__ import annotations

import importlib.machinery
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from prefixcache import hashing, index
from prefixcache.blockmap import BlockMap
from prefixcache.hashing import Hasher, token_array
from prefixcache.index import ROOT, RadixIndex
from prefixcache.kinds import MissReason
from prefixcache.native import BUILD_COMMAND, core

pytestmark = pytest.mark.unit

ROOT_DIR = Path(__file__).resolve().parents[1]
BS = 16
ROOT_HASH = xxhash.xxh3_128_digest(b"namespace")


def reference_chain(root: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    raw, out, parent = tokens.astype("<u4").tobytes(), [], root
    for i in range(len(tokens) // block_size):
        parent = xxhash.xxh3_128_digest(parent + raw[i * block_size * 4 : (i + 1) * block_size * 4])
        out.append(parent)
    return out


# -- the extension is what is imported ---------------------------------------------------------
def test_the_core_is_the_compiled_extension_and_the_index_uses_it() -> None:
    import prefixcache._core as compiled

    assert isinstance(compiled.__loader__, importlib.machinery.ExtensionFileLoader)
    assert compiled.__file__ is not None and compiled.__file__.endswith(importlib.machinery.EXTENSION_SUFFIXES[0])
    assert core is compiled and hashing.core is compiled and index.core is compiled
    assert core.XXHASH_VERSION == "0.8.4"  # the vendored header (third_party/xxhash)


def test_an_unbuilt_tree_fails_at_import_naming_the_build_command(tmp_path: Path) -> None:
    shutil.copytree(ROOT_DIR / "prefixcache", tmp_path / "prefixcache", ignore=shutil.ignore_patterns("*.so"))
    done = subprocess.run(
        # -S: no site-packages, so no editable install's finder can bring a built core from elsewhere
        [sys.executable, "-S", "-c", "import prefixcache.native"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "prefixcache._core" in done.stderr and "is not built" in done.stderr
    assert "bash scripts/setup.sh" in done.stderr and BUILD_COMMAND in done.stderr


# -- hashing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 31, 32, 33, 16 * 37 + 5])
def test_chain_hashes_only_full_blocks_bit_for_bit(length: int) -> None:
    tokens = np.random.default_rng(length).integers(0, 2**32, size=length, dtype=np.uint32)
    assert core.xxh3_chain(ROOT_HASH, tokens, BS) == reference_chain(ROOT_HASH, tokens, BS)
    assert Hasher().block_hashes(ROOT_HASH, tokens, BS) == reference_chain(ROOT_HASH, tokens, BS)


def test_chain_of_a_very_long_prompt_and_of_odd_roots_and_block_sizes() -> None:
    tokens = np.random.default_rng(7).integers(0, 2**32, size=1_000_003, dtype=np.uint32)
    hashes = core.xxh3_chain(ROOT_HASH, tokens, BS)
    assert len(hashes) == 1_000_003 // BS
    assert hashes == reference_chain(ROOT_HASH, tokens, BS)
    for root, size in ((b"", 1), (b"r" * 40, 3), (ROOT_HASH, 1024)):  # any root length, any block size
        assert core.xxh3_chain(root, tokens[:5000], size) == reference_chain(root, tokens[:5000], size)
    assert core.xxh3_128(b"abc") == xxhash.xxh3_128_digest(b"abc")


def test_chain_rejects_bad_buffers_naming_the_argument() -> None:
    tokens = np.arange(64, dtype=np.uint32)
    cases = [
        ([1, 2, 3], TypeError, "tokens: expected a C-contiguous uint32"),
        (tokens.astype(np.int64), TypeError, "tokens: expected uint32 items"),
        (tokens.astype(np.float32), TypeError, "tokens: expected uint32 items"),
        (tokens[::2], ValueError, "tokens: must be C-contiguous"),
        (tokens.reshape(8, 8), ValueError, "tokens: expected 1 dimension"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            core.xxh3_chain(ROOT_HASH, bad, BS)
    with pytest.raises(ValueError, match="block_size: expected an integer >= 1"):
        core.xxh3_chain(ROOT_HASH, tokens, 0)
    with pytest.raises(TypeError, match="root: expected bytes"):
        core.xxh3_chain("root", tokens, BS)


def test_token_array_hands_the_core_a_contiguous_copy_of_a_strided_view() -> None:
    strided = np.arange(200, dtype=np.uint32)[::2]
    array = token_array(strided)
    assert array.flags.c_contiguous and array.tolist() == strided.tolist()
    assert Hasher().block_hashes(ROOT_HASH, array, BS) == reference_chain(ROOT_HASH, strided, BS)


# -- match ---------------------------------------------------------------------------------------
def indexed(capacity: int, blocks: np.ndarray, now: float = 0.0) -> tuple[RadixIndex, list[bytes], list[int]]:
    idx = RadixIndex(capacity, BS)
    hashes = reference_chain(ROOT_HASH, blocks.reshape(-1), BS)
    nodes = idx.add_chain(0, ROOT, hashes, blocks, 1, list(range(len(blocks))), now)
    idx.touch(nodes, now)
    return idx, hashes, nodes


def test_match_of_an_empty_prompt_and_of_a_full_one() -> None:
    blocks = np.arange(4 * BS, dtype=np.uint32).reshape(4, BS)
    idx, hashes, nodes = indexed(8, blocks)
    empty = idx.match(0, [], blocks[:0], 0.0, 10.0)
    assert empty.nodes == [] and empty.stop is None and empty.found.size == 0
    full = idx.match(0, hashes, blocks, 0.0, 10.0)
    assert full.nodes == nodes and full.stop is None and full.found.tolist() == nodes


def test_a_collision_is_a_verification_failure_not_a_hit() -> None:
    """The same hash with other tokens (what a collision looks like): the match stops there."""
    blocks = np.arange(4 * BS, dtype=np.uint32).reshape(4, BS)
    idx, hashes, nodes = indexed(8, blocks)
    other = blocks.copy()
    other[2, 5] += 1
    match = idx.match(0, hashes, other, 0.0, 10.0)
    assert match.nodes == nodes[:2] and match.stop is MissReason.VERIFICATION_FAILED
    assert match.found.tolist() == nodes  # every hash was found; verification cut it
    wrong_namespace = idx.match(1, hashes, blocks, 0.0, 10.0)
    assert wrong_namespace.nodes == [] and wrong_namespace.stop is MissReason.VERIFICATION_FAILED
    skipped = idx.match(0, [hashes[0], hashes[2]], blocks[[0, 2]], 0.0, 10.0)  # a broken parent chain
    assert skipped.nodes == nodes[:1] and skipped.stop is MissReason.VERIFICATION_FAILED


def test_expiry_cuts_the_match_and_verification_wins_a_tie() -> None:
    blocks = np.arange(3 * BS, dtype=np.uint32).reshape(3, BS)
    idx, hashes, nodes = indexed(8, blocks, now=0.0)
    idx.touch(nodes[:1], 5.0)  # block 0 fresh, blocks 1 and 2 last used at 0
    expired = idx.match(0, hashes, blocks, 8.0, 4.0)
    assert expired.nodes == nodes[:1] and expired.stop is MissReason.EXPIRED
    other = blocks.copy()
    other[1, 0] += 1  # block 1 both expired and mismatching
    assert idx.match(0, hashes, other, 8.0, 4.0).stop is MissReason.VERIFICATION_FAILED
    missing = idx.match(0, [*hashes[:1], b"\x00" * 16], blocks[:2], 8.0, 4.0)
    assert missing.nodes == nodes[:1] and missing.stop is MissReason.NOT_CACHED


def test_match_of_a_very_long_prompt() -> None:
    count = 20_000
    blocks = np.random.default_rng(3).integers(0, 2**32, size=(count, BS), dtype=np.uint32)
    idx, hashes, nodes = indexed(count + 5, blocks)
    match = idx.match(0, hashes, blocks, 0.0, 1.0)
    assert match.nodes == nodes and match.stop is None
    longer = np.vstack([blocks, blocks[:1]])
    more = idx.match(0, core.xxh3_chain(ROOT_HASH, longer.reshape(-1), BS), longer, 0.0, 1.0)
    assert len(more.rows) == count and more.stop is MissReason.NOT_CACHED


def test_the_index_kernels_reject_bad_buffers_naming_the_argument() -> None:
    blocks = np.arange(2 * BS, dtype=np.uint32).reshape(2, BS)
    idx, hashes, _ = indexed(4, blocks)

    def match(**bad: object) -> None:
        args: dict[str, object] = {"digests": hashes, "blocks": blocks, "ns": 0, "oldest": 0.0}
        args["found"] = np.empty(2, dtype=np.int64)
        args.update(bad)
        idx.core.match(*args.values())

    match()
    strided = np.arange(4 * BS, dtype=np.uint32).reshape(2, 2 * BS)[:, ::2]
    cases = [
        ({"blocks": strided}, "blocks: must be C-contiguous"),
        ({"blocks": blocks.astype(np.int32)}, "blocks: expected uint32"),
        ({"blocks": blocks[:1]}, "blocks: expected at least 2 rows of 16 tokens"),
        ({"blocks": np.zeros((2, 4), dtype=np.uint32)}, "blocks: expected at least 2 rows of 16 tokens"),
        ({"found": np.empty(2, dtype=np.int32)}, "found: expected int64"),
        ({"found": np.empty(3, dtype=np.int64)}, "found: expected one int64 per digest"),
        ({"ns": "0"}, "ns: expected an int"),
        ({"digests": 5}, "digests: expected a list of bytes"),
    ]
    for bad, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            match(**bad)
    readonly = np.empty(2, dtype=np.int64)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="found: expected a writable"):
        match(found=readonly)
    with pytest.raises(ValueError, match=r"path\[1\]: 9 outside \[0, 4\)"):
        idx.core.touch(idx.log.rows, np.array([0, 9]), 0, 1, 0.0)
    with pytest.raises(TypeError, match="log_rows: expected int32"):
        idx.core.touch(idx.log.rows.astype(np.int64), np.array([0]), 0, 1, 0.0)
    with pytest.raises(ValueError, match="position: 2 entries from"):
        idx.core.touch(idx.log.rows, np.array([0, 1]), len(idx.log.rows) - 1, 1, 0.0)
    with pytest.raises(ValueError, match="slots: expected one slot per row"):
        idx.core.add_chain(np.array([2, 3]), ROOT, 0, 1, np.array([0]), blocks, 0.0)
    with pytest.raises(TypeError, match="parent: expected int32"):
        core.IndexCore(idx.map.table, idx.parent.astype(np.int64), *[np.empty(0)] * 8)
    with pytest.raises(ValueError, match="tokens: expected 4 rows"):
        core.IndexCore(
            idx.map.table,
            idx.parent,
            idx.namespace,
            idx.tier,
            idx.slot,
            idx.tick,
            idx.last_access,
            idx.pins,
            idx.children,
            idx.tokens[:2],
        )


def test_hash_table_checks_its_arrays_and_rolls_back_a_failed_batch() -> None:
    table = BlockMap(8, 16)
    with pytest.raises(TypeError, match="cells: expected int32"):
        core.HashTable(table.cells.astype(np.int64), table.cell_of, table.words, 16)
    with pytest.raises(ValueError, match="words: expected 2 x 8 words"):
        core.HashTable(table.cells, table.cell_of, table.words[:1], 16)
    a, b = b"a" * 16, b"b" * 16
    table.insert_many([a], [0])
    cells_before = table.cells.copy()
    for digests, rows in (([b, a], [1, 2]), ([b, b], [1, 2])):  # mapped already / repeated in the batch
        with pytest.raises(KeyError):
            table.insert_many(digests, rows)
        assert (table.cells == cells_before).all() and table.get(b) is None and len(table) == 1
    with pytest.raises(ValueError, match=r"rows\[0\]: 0 is out of range or mapped already"):
        table.insert_many([b], [0])
    with pytest.raises(ValueError, match=r"digests\[0\]: expected bytes of length 16"):
        table.insert_many([b"short"], [1])


def test_insert_prefix_maps_up_to_the_first_mapped_or_repeated_digest() -> None:
    table = BlockMap(8, 16)
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))
    table.insert_many([a], [0])
    assert table.insert_prefix([b, c, a, d], [1, 2, 3, 4]) == 2  # stops at a, mapped already
    assert (table.get(b), table.get(c), table.get(d), len(table)) == (1, 2, None, 3)
    assert table.insert_prefix([d, d], [3, 4]) == 1 and table.get(d) == 3  # stops at the repeat
    assert table.cell_of[4] == -1 and len(table) == 4
    assert table.insert_prefix([], []) == 0 and table.insert_prefix([a], [5]) == 0 and len(table) == 4
    cells_before = table.cells.copy()
    for digests, rows, message in (
        ([bytes(16), b"short"], [5, 6], r"digests\[1\]: expected bytes of length 16"),
        ([bytes(16)], [1], r"rows\[0\]: 1 is out of range or mapped already"),
        ([bytes(16)], [5, 6], "rows: expected one row per digest"),
        ([bytes(16)], [9], r"rows\[0\]: 9 outside \[0, 8\)"),
        (5, [5], "digests: expected a list of bytes"),
    ):
        with pytest.raises((TypeError, ValueError), match=message):
            table.insert_prefix(digests, rows)
        assert (table.cells == cells_before).all() and len(table) == 4  # checked before any change
    with pytest.raises(TypeError, match=r"insert_prefix\(digests, rows\) takes 2 arguments"):
        table.table.insert_prefix([a])


def test_copy_rows_moves_raw_rows_into_slots() -> None:
    """Raw bytes, any pattern (tests/test_fp8.py checks every dtype through the host pool)."""
    dst = np.zeros((6, 24), dtype=np.uint8)
    src = np.random.default_rng(7).integers(0, 256, (3, 24)).astype(np.uint8)
    core.copy_rows(dst, (4, 0, 5), src)
    assert dst[[4, 0, 5]].tobytes() == src.tobytes() and not dst[[1, 2, 3]].any()
    core.copy_rows(dst, [], np.empty((0, 24), np.uint8))  # nothing to copy
    core.copy_rows(dst, np.array([1], dtype=np.int64), src[1].reshape(2, 12))  # any shape of the right size
    assert dst[1].tobytes() == src[1].tobytes()
    big = np.zeros((40, 1 << 16), dtype=np.uint8)  # >= 1 MiB: copied without the GIL
    rows = np.arange(40 * (1 << 16), dtype=np.uint32).view(np.uint8)[: 20 << 16].reshape(20, -1)
    core.copy_rows(big, list(range(39, 19, -1)), rows)
    assert big[39:19:-1].tobytes() == rows.tobytes() and not big[:20].any()


def test_copy_rows_and_flip_flags_reject_bad_buffers_naming_the_argument() -> None:
    dst, src = np.zeros((4, 8), dtype=np.uint8), np.ones((2, 8), dtype=np.uint8)
    readonly = dst.copy()
    readonly.flags.writeable = False
    cases = [
        ((dst.view(np.int32), [0, 1], src), TypeError, "dst: expected uint8"),
        ((dst.reshape(-1), [0, 1], src), ValueError, r"dst: expected 2 dimension\(s\)"),
        ((dst[:, ::2], [0, 1], src[:, :4]), ValueError, "dst: must be C-contiguous"),
        ((readonly, [0, 1], src), TypeError, "dst: expected a writable"),
        ((dst, [0, 4], src), ValueError, r"slots\[1\]: 4 outside \[0, 4\)"),
        ((dst, [0, "1"], src), TypeError, r"slots\[1\]: expected an int"),
        ((dst, np.array([0, 1], dtype=np.int32), src), TypeError, "slots: expected int64"),
        ((dst, [0, 1], src.view(np.int16)), TypeError, "src: expected uint8"),
        ((dst, [0, 1], np.ones((2, 16), np.uint8)[:, ::2]), ValueError, "src: must be C-contiguous"),
        ((dst, [0, 1, 2], src), ValueError, r"src: expected 3 rows of 8 bytes \(one per slot\), got 16 bytes"),
        ((dst, [], src), ValueError, r"src: expected 0 rows of 8 bytes"),
        ((dst, [0]), TypeError, r"copy_rows\(dst, slots, src\) takes 3 arguments"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            core.copy_rows(*args)
    assert not dst.any()  # nothing was written by a refused call
    flags = bytearray(b"\x01") * 5
    core.flip_flags(flags, (4, 0), 0)
    core.flip_flags(flags, [], 0)
    assert flags == bytearray(b"\x00\x01\x01\x01\x00")
    core.flip_flags(np.frombuffer(flags, dtype=np.uint8), np.array([4], dtype=np.int64), 1)
    assert flags[4] == 1
    for args, error, message in (
        ((flags, [5], 0), ValueError, r"rows\[0\]: 5 outside \[0, 5\)"),
        ((flags, [1, 0], 0), ValueError, r"rows\[1\]: 0 is 0 already, or repeats"),  # 1 is put back
        ((flags, [1, 2, 1], 0), ValueError, r"rows\[2\]: 1 is 0 already, or repeats"),
        ((flags, [0], 2), ValueError, "value: expected 0 or 1"),
        ((flags, [0], -1), ValueError, "value: expected an integer >= 0"),
        ((np.zeros(5, np.int16), [0], 0), TypeError, "flags: expected uint8"),
        ((np.zeros((5, 2), np.uint8), [0], 0), ValueError, r"flags: expected 1 dimension\(s\)"),
        ((bytes(5), [0], 0), TypeError, "flags: expected a writable"),
        ((flags, [0]), TypeError, r"flip_flags\(flags, rows, value\) takes 3 arguments"),
    ):
        with pytest.raises(error, match=message):
            core.flip_flags(*args)
    assert flags == bytearray(b"\x00\x01\x01\x01\x01")  # what refused calls flipped is back


def test_the_touch_log_scan_step_keeps_only_current_entries() -> None:
    """current_entries: live rows still carrying the entry's tick, in log order, and how many
    stale ones led; bad buffers are named."""
    tick = np.array([5, 2, 9, 0], dtype=np.int64)
    tier = np.array([1, 1, -1, 1], dtype=np.int8)
    log = np.array([1, 3, 0, 2, -1, 0], dtype=np.int32)  # base 1: entry j carries tick 1 + j
    out = np.empty(6, dtype=np.int64)
    # entry 0 (row 1, tick 2 != 1) stale, 1 (row 3, 0 != 2) stale, 2 (row 0, 5 != 3) stale,
    # 3 (row 2) dead, 4 empty, 5 (row 0, tick 5 == 1 + 4? no: 6) stale -> nothing current
    assert core.current_entries(log, tick, tier, 0, 6, 1, out) == (0, 6)
    tick[0], tick[1] = 6, 1  # row 0 current at entry 5, row 1 at entry 0
    assert core.current_entries(log, tick, tier, 0, 6, 1, out) == (2, 0) and out[:2].tolist() == [1, 0]
    assert core.current_entries(log, tick, tier, 1, 6, 1, out) == (1, 4) and out[:1].tolist() == [0]
    with pytest.raises(ValueError, match="stop: expected an integer >= 3"):
        core.current_entries(log, tick, tier, 3, 2, 1, out)
    with pytest.raises(TypeError, match="tier: expected int8"):
        core.current_entries(log, tick, tier.astype(np.int32), 0, 6, 1, out)
    with pytest.raises(ValueError, match="stop: past the log"):
        core.current_entries(log, tick, tier, 0, 7, 1, np.empty(7, dtype=np.int64))


def reference_leaves(idx: RadixIndex, tier: int, wanted: int, members: np.ndarray | None) -> list[int]:
    """Placement's leaf-first pick over the touch log, in Python (what `lru_leaves` must equal)."""
    gone: dict[int, int] = {}
    victims: list[int] = []
    for node in idx.log.scan(lambda n: (idx.tier[n] == tier) & (idx.pins[n] == 0) & (members is None or members[n])):
        kids = int(idx.children[node])
        if len(victims) < wanted and (not kids or kids == gone.get(node)):
            victims.append(node)
            gone[int(idx.parent[node])] = gone.get(int(idx.parent[node]), 0) + 1
    return victims


@pytest.mark.parametrize("seed", range(10))
def test_lru_leaves_picks_what_evicting_each_lru_node_in_turn_would(seed: int) -> None:
    rnd = np.random.default_rng(seed)
    idx = RadixIndex(400, BS)
    paths: list[list[int]] = []
    for i in range(60):  # a forest: new roots, or branches off a random point of an earlier path
        base = paths[int(rnd.integers(len(paths)))] if paths and rnd.random() < 0.7 else []
        keep = base[: int(rnd.integers(len(base) + 1))]
        count = int(rnd.integers(1, 6))
        blocks = rnd.integers(0, 2**32, size=(count, BS), dtype=np.uint32)
        hashes = [bytes(rnd.integers(0, 256, 16, dtype=np.uint8)) for _ in range(count)]
        nodes = idx.add_chain(0, keep[-1] if keep else ROOT, hashes, blocks, int(rnd.integers(1, 3)), [0] * count, 0.0)
        paths.append(keep + nodes)
        idx.touch(paths[-1], float(i))
        if rnd.random() < 0.3:  # an older path used again
            idx.touch(paths[int(rnd.integers(len(paths)))], float(i))
    idx.pin(paths[3])
    members = rnd.random(idx.capacity) < 0.8
    for tier in (1, 2):
        for wanted in (0, 1, 7, 50, 1000):
            for mask in (None, members):
                want = reference_leaves(idx, tier, wanted, mask)
                got = idx.lru_leaves(tier, wanted, None if mask is None else (lambda n, m=mask: m[n]))
                assert got.tolist() == want
    # the per-row counts are cleared after each pick: a second pick gives the same answer
    assert idx.lru_leaves(1, 50).tolist() == idx.lru_leaves(1, 50).tolist() == reference_leaves(idx, 1, 50, None)
    with pytest.raises(ValueError, match="count: more than out holds"):
        idx.core.pick_leaves(np.array([0]), np.empty(1, dtype=np.int64), 2)
    # pick_lru (the plain pick's one call) moves the head to the first current entry only
    log, out = idx.log, np.empty(5, dtype=np.int64)
    count, head = idx.core.pick_lru(log.rows, 0, log.end, log.base, 1, out)
    assert out[:count].tolist() == reference_leaves(idx, 1, 5, None)
    first_current = next(
        j for j in range(log.end) if idx.tier[log.rows[j]] >= 0 and idx.tick[log.rows[j]] == log.base + j
    )
    assert head == first_current
    assert idx.core.pick_lru(log.rows, 0, log.end, log.base, 1, out[:0]) == (0, 0)  # nothing wanted: no scan
    for args, error, message in (
        ((log.rows, 0, len(log.rows) + 1, log.base, 1, out), ValueError, "end: past the log"),
        ((log.rows, 3, 2, log.base, 1, out), ValueError, "end: expected an integer >= 3"),
        ((log.rows, 0, log.end, -1, 1, out), ValueError, "base: expected an integer >= 0"),
        ((log.rows.astype(np.int64), 0, log.end, log.base, 1, out), TypeError, "log_rows: expected int32"),
        (
            (log.rows, 0, log.end, log.base, 1),
            TypeError,
            r"pick_lru\(log_rows, position, end, base, tier, out\) takes 6",
        ),
    ):
        with pytest.raises(error, match=message):
            idx.core.pick_lru(*args)
