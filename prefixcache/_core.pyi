# Types of the compiled core (prefixcache/_core.c); see that file for the semantics.
from collections.abc import Sequence

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
    def insert_many(self, digests: Sequence[bytes], rows: np.ndarray, /) -> int: ...
    def place(self, rows: np.ndarray, /) -> int: ...

def match(
    table: HashTable,
    digests: Sequence[bytes],
    parent: np.ndarray,
    namespace: np.ndarray,
    tokens: np.ndarray,
    last_access: np.ndarray,
    blocks: np.ndarray,
    ns: int,
    oldest: float,
    found: np.ndarray,
    /,
) -> tuple[int, int]: ...
