"""Helpers of tests/test_isolation.py: a credentials file, services built from `serve` flags,
tenant clients, KV that only a byte-exact copy matches, and a two-sample rank test.

Services are built exactly as `prefixcache serve FLAGS` builds them (`options_from` over the
real argument parser), run in this process, and are reached over a real loopback gRPC channel.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from prefixcache.client import CacheClient
from prefixcache.config import KVLayout
from prefixcache_services.cache_server.command import options_from
from prefixcache_services.cache_server.server import CacheServer, build_server
from prefixcache_services.cli import build_parser

LAYOUT = KVLayout(layers=2, kv_heads=1, head_dim=16, block_size=16, dtype="float16")  # 2 KiB blocks
BLOCK = LAYOUT.block_size
SALT = "shared-team-salt"


@dataclass(frozen=True)
class Tokens:
    acme: str
    globex: str
    ops: str  # admin


def write_credentials(directory: Path, extra: str = "", local: Sequence[str] = ("acme",)) -> tuple[Path, Tokens]:
    """A 0600 credentials file: tenants acme and globex, admin ops (acme's token stored hashed);
    the tenants in `local` may use the same-host data plane, `extra` goes on both tenants' lines."""
    tokens = Tokens(*(f"tok-{name}-{secrets.token_hex(16)}" for name in ("acme", "globex", "ops")))
    acme_digest = hashlib.sha256(tokens.acme.encode()).hexdigest()
    flags = {name: f"{'local ' if name in local else ''}{extra}" for name in ("acme", "globex")}
    path = directory / "credentials"
    path.write_text(
        f"# test tenants\nsha256:{acme_digest} acme {flags['acme']}\n{tokens.globex} globex "
        f"{flags['globex']}\n{tokens.ops} ops admin\n"
    )
    os.chmod(path, 0o600)
    return path, tokens


@contextlib.contextmanager
def serve(*flags: str) -> Iterator[CacheServer]:
    """A service built from `prefixcache serve --listen 127.0.0.1:0 FLAGS`, stopped afterwards."""
    args = build_parser().parse_args(["serve", "--listen", "127.0.0.1:0", "--grace", "1s", *flags])
    server = build_server(options_from(args))
    try:
        yield server
    finally:
        server.shutdown(0)


@contextlib.contextmanager
def tenant_clients(server: CacheServer, tokens: Sequence[str], same_host: Sequence[bool]) -> Iterator[list]:
    """One attached `CacheClient` per token (model "m", LAYOUT), closed afterwards."""
    clients = []
    try:
        for token, local in zip(tokens, same_host):
            client = CacheClient(server.address, auth_token=token, timeout_s=20)
            clients.append(client)
            client.attach("m", LAYOUT, same_host=local)
        yield clients
    finally:
        for client in clients:
            client.close()


def prompt(blocks: int, rng: random.Random, extra: int = 3) -> list[int]:
    """Random token ids of one varint width (3 bytes), so equal lengths mean equal message sizes."""
    return [rng.randrange(1 << 15, 1 << 21) for _ in range(blocks * BLOCK + extra)]


def random_kv(blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (blocks, *LAYOUT.block_shape), dtype=torch.int16, generator=generator)
    return bits.view(torch.float16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def mann_whitney_p(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie correction).

    Accurate for samples of a few dozen and more; the test asks whether one sample tends to be
    larger than the other, whatever the distributions' shapes (latencies are skewed).
    """
    n1, n2 = len(x), len(y)
    values = np.concatenate([np.asarray(x, dtype=float), np.asarray(y, dtype=float)])
    order = values.argsort(kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ranks = np.bincount(inverse, weights=ranks)[inverse] / counts[inverse]  # ties share their mean rank
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1)))
    if variance <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(variance)  # with continuity correction
    return math.erfc(max(z, 0.0) / math.sqrt(2))
