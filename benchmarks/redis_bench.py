"""Redis tier throughput vs. plain redis-py, same bytes, same server, same run.

For 64 KiB and 2 MiB blocks it measures GB/s of payload (1e9 bytes/s):
- tier put: what the cache's write-through does, frame_parts (header + xxh3_64; the payload
  sent from where it lies, not copied) and RedisTier.submit on the caller thread, until the
  background writer has stored everything;
- tier writer: the same with frames encoded beforehand (the writer alone);
- tier get: RedisTier.fetch of `batch` hashes with the frame-size hint the cache
  gives (pipelined GETEX, round trips of at most `max_fetch_bytes`) and
  decode_block (framing, key binding, checksum) of every frame;
- plain put/get: redis-py SET/GET of the raw payload, one command per round trip
  ("seq") and pipelined `batch` deep ("pipe").
Ratios compare the tier with the faster plain variant. Variants take turns every
--chunk-mib of blocks (the first one rotating), so load from elsewhere on the
machine slows all of them alike; each figure is total bytes over total time.
Pipelines never span a turn, so "pipe" is at most chunk/block deep.

    PYTHONPATH=. python benchmarks/redis_bench.py [--total-mib 128] [--repeats 3] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis

# Run from anywhere without PYTHONPATH: this checkout's packages (and tests/support/redis_server.py) first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixcache.codec import FrameParts, decode_block, encode_block, frame_parts
from prefixcache.config import DType, KVLayout
from prefixcache.tiers.redis import RedisOptions, RedisTier

LAYOUTS = {
    "64KiB": KVLayout(layers=8, kv_heads=2, head_dim=64, block_size=16, dtype=DType.FLOAT16),
    "2MiB": KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype=DType.FLOAT16),  # Llama-3-8B
}
NS = "bench00000000000"
PARENT = bytes(16)
DISTINCT_PAYLOADS = 8
TTL_MS = 3_600_000


@dataclass(frozen=True)
class Row:
    block: str
    blocks: int
    plain_put_seq: float
    plain_put_pipe: float
    tier_put: float
    tier_writer: float
    plain_get_seq: float
    plain_get_pipe: float
    tier_get: float
    encode_us_per_block: float

    @property
    def put_ratio(self) -> float:
        return self.tier_put / max(self.plain_put_seq, self.plain_put_pipe)

    @property
    def writer_ratio(self) -> float:
        return self.tier_writer / max(self.plain_put_seq, self.plain_put_pipe)

    @property
    def get_ratio(self) -> float:
        return self.tier_get / max(self.plain_get_seq, self.plain_get_pipe)


def interleaved_gbps(
    work: Workload,
    variants: dict[str, Callable[[int, int], None]],
    repeats: int,
    reset: Callable[[], None],
    warmup: int = 0,
) -> dict[str, float]:
    """Payload GB/s of each variant, interleaved chunk by chunk (rotating which goes first),
    after `warmup` untimed repeats (as the peers' harness discards its first run: Redis's
    allocator then reuses pages it already faulted in, for every variant alike).

    Fine-grained interleaving matters on a shared machine: load from elsewhere then
    slows every variant alike instead of whichever ran during a busy second.
    """
    seconds = {name: 0.0 for name in variants}
    names = list(variants)
    for repeat in range(warmup + repeats):
        reset()
        for index, start in enumerate(range(0, work.n, work.chunk)):
            stop = min(work.n, start + work.chunk)
            for name in names[index % len(names) :] + names[: index % len(names)]:
                began = time.perf_counter()
                variants[name](start, stop)
                if repeat >= warmup:
                    seconds[name] += time.perf_counter() - began
    nbytes = repeats * work.n * work.layout.block_bytes
    return {name: nbytes / total / 1e9 for name, total in seconds.items()}


class Workload:
    """n blocks of one layout, and the plain and tier operations over a range of them.

    Each put variant writes its own keys (plain seq, plain pipe, tier put, tier
    writer) so no variant overwrites another's values; reads use plain-pipe and
    tier-writer keys.
    """

    def __init__(self, layout: KVLayout, url: str, n: int, batch: int, chunk_bytes: int) -> None:
        rng = np.random.default_rng(0)
        self.layout, self.n, self.batch = layout, n, batch
        self.chunk = max(1, min(n, chunk_bytes // layout.block_bytes))
        self.payloads = [
            rng.integers(0, 256, layout.block_bytes, dtype=np.uint8).tobytes() for _ in range(DISTINCT_PAYLOADS)
        ]
        self.hashes = [i.to_bytes(16, "big") for i in range(n)]
        self.tokens = [np.full(layout.block_size, i % 50_000, dtype="<u4") for i in range(n)]
        self.plain = redis.Redis.from_url(url, socket_timeout=10)
        self.seq_keys = [f"plain-seq:{h.hex()}" for h in self.hashes]
        self.pipe_keys = [f"plain-pipe:{h.hex()}" for h in self.hashes]
        nbytes = n * layout.block_bytes
        self.tier = RedisTier(
            RedisOptions(
                url=url,
                key_prefix="bench",
                max_batch=batch,
                socket_timeout_s=10,
                write_timeout_s=10,
                max_queue_bytes=2 * nbytes + (64 << 20),
            )
        )
        self.frames = [self.encode(i) for i in range(n)]

    def payload(self, i: int) -> bytes:
        return self.payloads[i % DISTINCT_PAYLOADS]

    def encode(self, i: int) -> bytes:
        return encode_block(self.layout, NS, self.hashes[i], PARENT, self.tokens[i], self.payload(i))

    def plain_put_seq(self, start: int, stop: int) -> None:
        for i in range(start, stop):
            self.plain.set(self.seq_keys[i], self.payload(i), px=TTL_MS)

    def plain_put_pipe(self, start: int, stop: int) -> None:
        for first in range(start, stop, self.batch):
            pipe = self.plain.pipeline(transaction=False)
            for i in range(first, min(stop, first + self.batch)):
                pipe.set(self.pipe_keys[i], self.payload(i), px=TTL_MS)
            pipe.execute()

    def parts(self, i: int) -> FrameParts:
        return frame_parts(self.layout, NS, self.hashes[i], PARENT, self.tokens[i], self.payload(i))

    def _submit_all(self, namespace: str, start: int, stop: int, frame_of: Callable[[int], bytes | FrameParts]) -> None:
        for i in range(start, stop):
            if not self.tier.submit(namespace, self.hashes[i], frame_of(i)):
                raise RuntimeError("tier refused a spill: raise max_queue_bytes for the benchmark")
        if not self.tier.wait_idle(600):
            raise RuntimeError("tier writer did not drain")

    def tier_put(self, start: int, stop: int) -> None:
        self._submit_all(NS + "-put", start, stop, self.parts)

    def tier_writer(self, start: int, stop: int) -> None:
        self._submit_all(NS, start, stop, self.frames.__getitem__)

    def plain_get_seq(self, start: int, stop: int) -> None:
        if any(self.plain.get(key) is None for key in self.pipe_keys[start:stop]):
            raise RuntimeError("plain GET missed")

    def plain_get_pipe(self, start: int, stop: int) -> None:
        for first in range(start, stop, self.batch):
            pipe = self.plain.pipeline(transaction=False)
            for key in self.pipe_keys[first : min(stop, first + self.batch)]:
                pipe.get(key)
            if any(value is None for value in pipe.execute()):
                raise RuntimeError("plain pipelined GET missed")

    def tier_get(self, start: int, stop: int) -> None:
        for first in range(start, stop, self.batch):
            chunk = self.hashes[first : min(stop, first + self.batch)]
            for offset, frame in enumerate(self.tier.fetch(NS, chunk, frame_bytes=self.layout.block_bytes)):
                if frame is None:
                    raise RuntimeError("tier fetch missed")
                decode_block(frame, self.layout, NS, chunk[offset], PARENT, self.tokens[first + offset])

    def encode_us(self) -> float:
        start = time.perf_counter()
        for i in range(self.n):
            self.encode(i)
        return (time.perf_counter() - start) / self.n * 1e6

    def close(self) -> None:
        self.tier.close()
        self.plain.flushall()
        self.plain.close()


def bench_block(
    name: str, layout: KVLayout, url: str, total_bytes: int, batch: int, repeats: int, chunk_bytes: int, warmup: int
) -> Row:
    work = Workload(layout, url, max(batch, total_bytes // layout.block_bytes), batch, chunk_bytes)
    try:
        figures = interleaved_gbps(
            work,
            {
                "plain_put_seq": work.plain_put_seq,
                "plain_put_pipe": work.plain_put_pipe,
                "tier_put": work.tier_put,
                "tier_writer": work.tier_writer,
            },
            repeats,
            reset=work.plain.flushall,
            warmup=warmup,
        )
        figures |= interleaved_gbps(
            work,
            {"plain_get_seq": work.plain_get_seq, "plain_get_pipe": work.plain_get_pipe, "tier_get": work.tier_get},
            repeats,
            reset=lambda: None,
        )
        stats = work.tier.stats()
        if stats.spills_dropped or stats.writes_failed or stats.read_errors:
            raise RuntimeError(f"the tier dropped or failed operations: {stats}")
        return Row(block=name, blocks=work.n, encode_us_per_block=work.encode_us(), **figures)
    finally:
        work.close()


def print_table(rows: list[Row]) -> None:
    print(
        f"{'block':>6} | {'put GB/s: plain seq':>19} {'pipe':>5} {'tier':>5} {'ratio':>5} {'writer':>6} {'ratio':>5}"
        f" | {'get GB/s: plain seq':>19} {'pipe':>5} {'tier':>5} {'ratio':>5} | {'encode us/block':>15}"
    )
    for r in rows:
        print(
            f"{r.block:>6} | {r.plain_put_seq:19.2f} {r.plain_put_pipe:5.2f} {r.tier_put:5.2f} {r.put_ratio:5.0%}"
            f" {r.tier_writer:6.2f} {r.writer_ratio:5.0%} | {r.plain_get_seq:19.2f} {r.plain_get_pipe:5.2f}"
            f" {r.tier_get:5.2f} {r.get_ratio:5.0%} | {r.encode_us_per_block:15.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this server instead of starting one (it gets FLUSHALLed!)")
    parser.add_argument("--total-mib", type=int, default=128, help="payload MiB per timed run")
    parser.add_argument("--batch", type=int, default=64, help="blocks per pipelined round trip")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed put repeats first (the peers' harness: 1)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="interleaving grain: MiB per variant turn")
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval for this process (default: Python's 5 ms)"
    )
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    server = None
    url = args.redis_url
    if url is None:
        from tests.support.redis_server import RedisServer  # the helper the tests use

        server = RedisServer(tempfile.mkdtemp(prefix="redis-bench-")).start()
        url = server.url
    try:
        rows = [
            bench_block(
                name, layout, url, args.total_mib << 20, args.batch, args.repeats, args.chunk_mib << 20, args.warmup
            )
            for name, layout in LAYOUTS.items()
        ]
    finally:
        if server is not None:
            server.stop()
    print_table(rows)
    report = {
        "unit": "GB/s of payload (1e9 bytes/s)",
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "chunk_mib": args.chunk_mib,
        "switch_interval_s": sys.getswitchinterval(),
        "rows": [
            asdict(r)
            | {
                "put_ratio": round(r.put_ratio, 3),
                "writer_ratio": round(r.writer_ratio, 3),
                "get_ratio": round(r.get_ratio, 3),
            }
            for r in rows
        ],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
