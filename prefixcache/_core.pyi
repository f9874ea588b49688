# Types of the compiled core (prefixcache/_core.c); see that file for the semantics.
import ssl
from collections.abc import Sequence
from typing import Any

import numpy as np

STOP_NONE: int
STOP_NOT_CACHED: int
STOP_EXPIRED: int
STOP_VERIFICATION_FAILED: int
XXHASH_VERSION: str

def xxh3_128(data: bytes, /) -> bytes: ...
def xxh3_chain(root: bytes, tokens: np.ndarray, block_size: int, /) -> list[bytes]: ...

class HashTable:
    def __init__(self, cells: np.ndarray, cell_of: np.ndarray, words: np.ndarray, digest_size: int) -> None: ...
    def get(self, digest: bytes, /) -> int: ...
    def get_many(self, digests: Sequence[bytes], out: np.ndarray, /) -> None: ...
    def insert_many(self, digests: Sequence[bytes], rows: Sequence[int] | np.ndarray, /) -> int: ...
    def insert_prefix(self, digests: Sequence[bytes], rows: Sequence[int] | np.ndarray, /) -> tuple[int, int]: ...
    def delete_many(self, rows: Sequence[int] | np.ndarray, /) -> None: ...
    def place(self, rows: np.ndarray, /) -> int: ...

class IndexCore:
    def __init__(
        self,
        table: HashTable,
        parent: np.ndarray,
        namespace: np.ndarray,
        tier: np.ndarray,
        slot: np.ndarray,
        tick: np.ndarray,
        last_access: np.ndarray,
        pins: np.ndarray,
        children: np.ndarray,
        tokens: np.ndarray,
        /,
    ) -> None: ...
    def match(
        self,
        digests: Sequence[bytes],
        blocks: np.ndarray,
        ns: int,
        oldest: float,
        found: np.ndarray,
        extra: np.ndarray = ...,
        /,
    ) -> tuple[int, int]: ...
    def add_chain(
        self,
        rows: Sequence[int] | np.ndarray,
        parent: int,
        ns: int,
        tier: int,
        slots: Sequence[int] | np.ndarray,
        blocks: np.ndarray,
        now: float,
        /,
    ) -> None: ...
    def touch(
        self, log_rows: np.ndarray, path: Sequence[int] | np.ndarray, position: int, tick: int, now: float, /
    ) -> None: ...
    def pin(self, path: Sequence[int] | np.ndarray, /) -> None: ...
    def unpin(self, path: Sequence[int] | np.ndarray, /) -> None: ...
    def pick_leaves(self, nodes: Sequence[int] | np.ndarray, out: np.ndarray, count: int, /) -> int: ...
    def forget_picks(self, victims: Sequence[int] | np.ndarray, /) -> None: ...
    def pick_lru(
        self, log_rows: np.ndarray, position: int, end: int, base: int, tier: int, out: np.ndarray, /
    ) -> tuple[int, int]: ...
    def remove_many(self, rows: Sequence[int] | np.ndarray, /) -> None: ...

def current_entries(
    log_rows: np.ndarray, tick: np.ndarray, tier: np.ndarray, position: int, stop: int, base: int, out: np.ndarray, /
) -> tuple[int, int]: ...
def copy_rows(dst: np.ndarray, slots: Sequence[int] | np.ndarray, src: np.ndarray, /) -> None: ...
def flip_flags(flags: bytearray | np.ndarray, rows: Sequence[int] | np.ndarray, value: int, /) -> None: ...
def resp_set(
    sock: int | ssl.SSLSocket,
    keys: Sequence[bytes],
    values: Sequence[bytes | bytearray | memoryview | tuple[bytes | bytearray | memoryview, ...]],
    ttls_ms: Sequence[int],
    timeout_s: float | None,
    deadline_s: float | None = None,
    /,
) -> bytes | None: ...
def resp_getex(
    sock: int | ssl.SSLSocket,
    keys: Sequence[bytes],
    ttl_ms: int | None,
    timeout_s: float | None,
    max_value: int | None = None,
    deadline_s: float | None = None,
    reset: bool = False,
    /,
) -> tuple[list[bytearray | None], list[tuple[int, bytes]]]: ...

class RespWriter:
    """The Redis tier's write queue, written to Redis by `run` without the GIL (prefixcache/_resp.c)."""

    lanes: int
    @property
    def set_seconds(self) -> float: ...  # seconds per SET run() or paced() measured (0.0: not yet)
    def __init__(self, lanes: int = 1, /) -> None: ...
    def __len__(self) -> int: ...
    def push(
        self,
        op: object,
        key: bytes | None,
        value: bytes | bytearray | memoryview | tuple[bytes | bytearray | memoryview, ...] | None,
        ttl_ms: int,
        /,
    ) -> None: ...
    def head(self) -> int: ...
    def pop(self, max_batch: int, deadline_s: float | None = None, /) -> list[Any]: ...
    def paced(self, seconds: float, sets: int, past_deadline: bool, /) -> None: ...
    def flight(self, lane: int, /) -> list[Any]: ...
    def finish(self, lane: int, /) -> list[Any]: ...
    def run(
        self,
        fd: int | ssl.SSLSocket,
        timeout_s: float | None,
        max_batch: int,
        lane: int,
        deadline_s: float | None = None,
        /,
    ) -> bytes | None: ...
    def wait_done(self, timeout_s: float, /) -> bool: ...
    def completed(self) -> list[tuple[list[Any], int, float, int]]: ...
    def own_queued(self) -> list[tuple[Any, bytes]]: ...
    def drain(self) -> list[Any]: ...
    def interrupt(self) -> None: ...
    def stop(self, timeout_s: float, /) -> None: ...
    def shutdown(self) -> None: ...
