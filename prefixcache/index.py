"""Radix index over block hashes: match, insert, pins, LRU order, TTL.

One node per cached block. Because a block hash names its whole prefix (and
namespace), children are found through one flat map `block hash -> node`
(`BlockMap`); the parent pointer of each node spells the path back to its
namespace root, so this is a radix tree stored as a hash table plus parent links.

Nodes are rows in preallocated arrays (struct of arrays), not Python objects:
a Python object per block costs ~350 bytes of metadata, a row ~140 (measured
by benchmarks/index_bench.py).

Invariants:
- `map` maps exactly the live nodes' hashes; a live node's parent is ROOT or a
  live node of the same namespace; `children[n]` counts n's live children.
- `tick[parent] > tick[child]`: `touch` stamps a path leaf->root with rising
  ticks, and every insert is followed by a touch of its path. Ascending tick
  is therefore LRU order that visits descendants before their ancestors
  (leaf-first, the deeper block first on ties). Ticks come from a `TouchLog`,
  so eviction reads that order without sorting.
- `pins[n] > 0` implies `pins[parent] > 0`: leases pin whole paths from root.
- Token ids of every block are kept; a match step is only taken when they
  equal the prompt's, so a hash collision is a counted miss, never wrong KV.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .blockmap import BlockMap
from .hashing import BlockHash
from .kinds import MissReason
from .native import core
from .presence import PresenceTable
from .touchlog import TouchLog

ROOT = -1
_NO_ROWS = np.empty(0, dtype=np.int64)
_INT64 = _NO_ROWS.dtype


_STOPS: dict[int, MissReason | None] = {
    core.STOP_NONE: None,
    core.STOP_NOT_CACHED: MissReason.NOT_CACHED,
    core.STOP_EXPIRED: MissReason.EXPIRED,
    core.STOP_VERIFICATION_FAILED: MissReason.VERIFICATION_FAILED,
}


@dataclass(frozen=True)
class Match:
    """Matched node rows (int64), root first; `stop` is None when every full block matched.

    `found` is the block map's answer for every hash asked (-1 where absent), matched or not:
    a hash past the match that is indexed anyway belongs to another chain (a collision).
    """

    rows: np.ndarray
    stop: MissReason | None
    found: np.ndarray

    @property
    def nodes(self) -> list[int]:
        return list(self.rows.tolist())


class RadixIndex:
    """Metadata of up to `capacity` resident blocks of `block_size` tokens."""

    def __init__(self, capacity: int, block_size: int, digest_size: int = 16) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.parent = np.full(capacity, ROOT, dtype=np.int32)
        self.namespace = np.zeros(capacity, dtype=np.int16)
        self.tier = np.full(capacity, -1, dtype=np.int8)  # -1: row unused
        self.slot = np.zeros(capacity, dtype=np.int32)
        self.tick = np.zeros(capacity, dtype=np.int64)
        self.last_access = np.zeros(capacity, dtype=np.float64)
        self.pins = np.zeros(capacity, dtype=np.int32)
        # Seconds a row outlives the TTL (a store's retention hint beyond it); 0 for most rows, and
        # `retaining` stays False (match passes no array) until a hint sets one.
        self.extra_ttl = np.zeros(capacity, dtype=np.float64)
        self.retaining = False
        self.children = np.zeros(capacity, dtype=np.int32)
        self.tokens = np.zeros((capacity, block_size), dtype=np.uint32)
        self.map = BlockMap(capacity, digest_size)
        self.log = TouchLog(capacity, self.tick, self.tier)
        self.core = core.IndexCore(
            self.map.table,
            self.parent,
            self.namespace,
            self.tier,
            self.slot,
            self.tick,
            self.last_access,
            self.pins,
            self.children,
            self.tokens,
        )
        self._free_rows = array.array("i", range(capacity - 1, -1, -1))
        self.presence: PresenceTable | None = None  # published to same-host engines (presence.py)

    def publish(self, presence: PresenceTable) -> None:
        """Keep `presence` (empty, sized for this capacity) holding exactly the indexed blocks."""
        presence.add(self.map.words[0][self.live()])
        self.presence = presence

    def __len__(self) -> int:
        return len(self.map)

    def hash_of(self, node: int) -> BlockHash:
        assert self.tier[node] >= 0, f"node {node} is not live"
        return BlockHash(self.map.digest(node))

    def node_of(self, block_hash: BlockHash) -> int | None:
        return self.map.get(block_hash)

    # -- matching ---------------------------------------------------------
    def match(self, namespace: int, hashes: list[BlockHash], blocks: np.ndarray, now: float, ttl_s: float) -> Match:
        """Longest verified, unexpired chain for `hashes` (blocks: `[n, block_size]` u32, C-contiguous).
        A pinned row is never expired here (expiry never drops it either); a retained one only
        `extra_ttl[row]` seconds after the TTL (`retain`).

        One call of the compiled core (`IndexCore.match`): it probes every hash, then walks the found
        rows and cuts at the first whose chain (parent, the namespace of the first), tokens or age
        fail; verification wins a tie with expiry.
        """
        if not hashes:
            return Match(_NO_ROWS, None, _NO_ROWS)
        found = np.empty(len(hashes), dtype=np.int64)
        if self.retaining:
            matched, stop = self.core.match(hashes, blocks, namespace, now - ttl_s, found, self.extra_ttl)
        else:
            matched, stop = self.core.match(hashes, blocks, namespace, now - ttl_s, found)
        return Match(found[:matched], _STOPS[stop], found)

    # -- mutation -----------------------------------------------------------
    def add(
        self, namespace: int, parent: int, block_hash: BlockHash, tokens: np.ndarray, tier: int, slot: int, now: float
    ) -> int:
        """Insert one block under `parent`; the caller touches the path afterwards."""
        return self.add_chain(namespace, parent, [block_hash], np.asarray(tokens)[None], tier, [slot], now)[0]

    def add_chain(
        self,
        namespace: int,
        parent: int,
        hashes: list[BlockHash],
        tokens: np.ndarray,
        tier: int,
        slots: Sequence[int],
        now: float,
    ) -> list[int]:
        """Insert consecutive blocks under `parent` (block i+1 the child of block i): two calls of
        the compiled core (the block map's insert, then `IndexCore.add_chain` fills the rows).

        Raises KeyError, changing nothing, if any hash is already indexed or repeats in `hashes`.
        The caller touches the path afterwards.
        """
        count = len(hashes)
        if not count:
            return []
        if count > len(self._free_rows):
            raise RuntimeError("index is full (more blocks than tier slots)")
        nodes = self._free_rows[len(self._free_rows) - count :][::-1].tolist()
        self.map.insert_many(hashes, nodes)  # all or nothing
        return self._fill(nodes, namespace, parent, tokens, tier, slots, now)

    def extend(
        self,
        namespace: int,
        parent: int,
        hashes: list[BlockHash],
        tokens: np.ndarray,
        tier: int,
        slots: Sequence[int],
        now: float,
    ) -> list[int]:
        """Insert the leading blocks of a chain under `parent`, as `add_chain`, up to (not
        including) the first whose hash is already indexed or repeats an earlier one of `hashes`
        (a collision's KV is never replaced): the block map's `insert_prefix` decides, in the same
        probe that places them. Returns the nodes added (maybe none); the caller touches them."""
        count = len(hashes)
        if count > len(self._free_rows):
            raise RuntimeError("index is full (more blocks than tier slots)")
        if not count:
            return []
        nodes = self._free_rows[len(self._free_rows) - count :][::-1].tolist()
        added = self.map.insert_prefix(hashes, nodes)
        if not added:
            return []
        del nodes[added:]
        return self._fill(nodes, namespace, parent, tokens[:added], tier, slots[:added], now)

    def _fill(
        self,
        nodes: list[int],
        namespace: int,
        parent: int,
        tokens: np.ndarray,
        tier: int,
        slots: Sequence[int],
        now: float,
    ) -> list[int]:
        """Take `nodes` (the last free rows, just mapped to their hashes) off the free list and
        fill their rows as a chain under `parent`."""
        del self._free_rows[len(self._free_rows) - len(nodes) :]
        self.extra_ttl[nodes] = 0.0  # a reused row starts without its last block's retention
        self.core.add_chain(
            nodes, parent, namespace, tier, _rows(slots), np.ascontiguousarray(tokens, dtype=np.uint32), now
        )
        if self.presence is not None:
            self.presence.add(self.map.words[0][nodes])
        return nodes

    def remove(self, node: int) -> None:
        """Drop a leaf that no lease pins (prefix closure is the caller's promise)."""
        if self.tier[node] < 0:
            raise RuntimeError(f"node {node} is not live")
        if self.children[node] or self.pins[node]:
            raise RuntimeError(f"node {node} has children or pins; cannot remove")
        if self.presence is not None:
            self.presence.discard(self.map.words[0][[node]])
        self.map.delete(node)
        parent = int(self.parent[node])
        if parent != ROOT:
            self.children[parent] -= 1
        self.tier[node] = -1
        self._free_rows.append(node)

    def remove_many(self, nodes: Sequence[int] | np.ndarray) -> None:
        """Drop distinct unpinned nodes each of whose children is among them (what `remove` of each
        in turn, descendants first, leaves behind): one call of the compiled core for the rows, one
        vectorised store for the block map. Checked before any change; costs O(len(nodes)), not
        O(capacity)."""
        rows = np.asarray(nodes, dtype=np.int64)
        if not rows.size:
            return
        self.core.remove_many(rows)  # raises, changing nothing (KeyError for a repeat)
        if self.presence is not None:
            self.presence.discard(self.map.words[0][rows])
        self.map.delete_many(rows)  # live rows are mapped: cannot fail now
        self._free_rows.frombytes(rows.astype(np.int32).tobytes())

    def touch(self, path: Sequence[int] | np.ndarray, now: float) -> None:
        """Mark a root-first path used now; the root ends with the highest tick."""
        count = len(path)
        if not count:
            return
        position = self.log.claim(count)
        self.core.touch(self.log.rows, _rows(path), position, self.log.base + position, now)

    def pin(self, path: Sequence[int] | np.ndarray) -> None:
        """One more pin on each node of a path (a path holds no node twice)."""
        self.core.pin(_rows(path))

    def unpin(self, path: Sequence[int] | np.ndarray) -> None:
        """One pin less on each node; RuntimeError, changing nothing, if one has none."""
        self.core.unpin(_rows(path))

    def retain(self, path: Sequence[int] | np.ndarray, extra_s: float) -> None:
        """Keep a path's rows `extra_s` seconds past the TTL since their last use (never less than
        they already had)."""
        if extra_s > 0 and len(path):
            rows = np.asarray(path, dtype=np.int64)
            self.extra_ttl[rows] = np.maximum(self.extra_ttl[rows], extra_s)
            self.retaining = True

    def move(self, node: int, tier: int, slot: int) -> None:
        self.tier[node] = tier
        self.slot[node] = slot

    # -- queries --------------------------------------------------------------
    def lru(self, tier: int) -> Iterator[int]:
        """Unpinned nodes of `tier`, least recently used (and deepest) first.

        Lazy: each step reads the current state, so the caller may evict as it goes. A node
        added but not yet touched is not offered (every add is followed by a touch).
        """
        return self.log.scan(lambda nodes: (self.tier[nodes] == tier) & (self.pins[nodes] == 0))

    def lru_leaves(
        self,
        tier: int,
        wanted: int,
        members: Callable[[np.ndarray], np.ndarray] | None = None,
        cut: Callable[[np.ndarray], tuple[np.ndarray, bool]] | None = None,
    ) -> np.ndarray:
        """Up to `wanted` unpinned nodes of `tier` (among `members`, a mask over node rows) that
        evicting the LRU nodes in turn would drop from a last tier, in that order: a node goes once
        it has no children left, so every cached prefix stays contiguous. Read from the touch log
        (O(entries scanned), not O(blocks cached)); the picking is the compiled core's. `cut` sees
        each LRU chunk first and returns the nodes to pick from and whether the scan stops after
        them. Nothing changes but the log's head (leading stale entries).

        Without `members` and `cut` (every plain eviction) the whole scan is one call of the core
        (`IndexCore.pick_lru`); with them, a chunk at a time through Python."""
        out = np.empty(max(wanted, 0), dtype=np.int64)
        count = 0
        if not len(out):
            return out
        if members is None and cut is None:
            log = self.log
            count, log.head = self.core.pick_lru(log.rows, log.head, log.end, log.base, tier, out)
            return out[:count]

        def eligible(nodes: np.ndarray) -> np.ndarray:
            ok = (self.tier[nodes] == tier) & (self.pins[nodes] == 0)
            return np.asarray(ok & members(nodes)) if members is not None else ok

        try:
            for nodes in self.log.scan_chunks(eligible):
                stop = False
                if cut is not None:
                    nodes, stop = cut(nodes)
                count = self.core.pick_leaves(nodes, out, count)
                if stop or count >= len(out):
                    break
        finally:
            self.core.forget_picks(out[:count])
        return out[:count]

    def select(self, mask: np.ndarray) -> list[int]:
        """Live nodes where `mask` holds, descendants before ancestors."""
        rows = np.flatnonzero(mask & (self.tier >= 0))
        return [int(n) for n in rows[np.argsort(self.tick[rows], kind="stable")]]

    def live(self) -> np.ndarray:
        return self.tier >= 0

    def subtree(self, node: int) -> list[int]:
        """`node` and all its descendants, descendants first."""
        members = np.zeros(self.capacity, dtype=bool)
        members[node] = True
        live = self.live()
        while True:
            grown = members | (live & (self.parent >= 0) & members[np.maximum(self.parent, 0)])
            if (grown == members).all():
                break
            members = grown
        return self.select(members)

    def path_to(self, node: int) -> list[int]:
        """Root-first path ending at `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]


def _rows(path: Sequence[int] | np.ndarray) -> list[int] | tuple[int, ...] | np.ndarray:
    """A path as the compiled core takes it: a list or tuple of ints, or an int64 array."""
    if isinstance(path, (list, tuple)) or (isinstance(path, np.ndarray) and path.dtype is _INT64):
        return path  # (`is`: a dtype `==` costs a microsecond; another int64 dtype object is converted, a no-op)
    return np.asarray(path, dtype=np.int64)
