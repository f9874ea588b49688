"""The Redis tier next to LMCache's C++ RESP connector: same server, same workload, in lockstep.

The peers' harness (../shared/peers/redis_kv_bench.py) and benchmarks/redis_bench.py run one after
the other, seconds to minutes apart; on a shared machine the load moves in between, and a ratio of
two such figures carries that drift. Here one LMCache process (the peers' venv, driven over a pipe)
and the tier take turns run by run against one redis-server: each round is one LMCache run and one
tier run, in alternating order, and the figure to read is the median of the per-round ratios.

A run is the peers' harness's: FLUSHALL (untimed), put `--bytes-per-run` of distinct keys in
batches of `--batch-bytes`, then get them all back, GB/s of payload (1e9 B/s) for each.
- LMCache: `RESPConnector.batched_put` / `batched_get` of raw chunks (8 C++ worker threads,
  LMCache's default), exactly as the harness drives them (its `LMCacheCtx`).
- tier: what the cache's write-through does per block (`RemoteLink.write_through`): `frame_parts`
  (the header, with the xxh3_64 of the payload; the payload itself not copied) and
  `RedisTier.submit` of the parts, the payload sent from where it lies (one buffer per block, as
  slots of a host tier: 128 MiB of distinct payloads, like LMCache's chunks), until the writer has
  stored the batch (`wait_idle`); then `RedisTier.fetch` of each batch (frame-size hint: GETEX
  round trips of at most `max_fetch_bytes`) and `decode_block` of every frame (framing, key
  binding, tokens, checksum). `--copy` measures puts of owned frames instead (`encode_block`: the
  payload copied into each frame, as a block leaving the slot tiers is spilled).
Round 0 is a warm-up for both (the harness discards one too) and is not counted.

    PYTHONPATH=. python benchmarks/redis_peer_bench.py [--rounds 5] [--sizes 64KiB,2MiB] [--copy] [--write-lanes N] [--json-out F]

Needs the peers' LMCache venv (`../shared/peers/setup.sh`); `--peer-python` and `--peers-dir` say
where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefixcache.codec import decode_block, encode_block, frame_parts  # noqa: E402
from prefixcache.config import DType, KVLayout  # noqa: E402
from prefixcache.tiers.redis import RedisOptions, RedisTier  # noqa: E402

# The peers' block shapes (redis_kv_bench.SIZES), as the cache's layouts of the same bytes.
LAYOUTS = {
    "64KiB": KVLayout(layers=16, kv_heads=1, head_dim=64, block_size=16, dtype=DType.FLOAT16),
    "2MiB": KVLayout(layers=32, kv_heads=8, head_dim=128, block_size=16, dtype=DType.FLOAT16),
}
NS = "bench00000000000"
PARENT = bytes(16)

# Runs in the peers' venv: LMCache set up by the harness's own LMCacheCtx, then one JSON line per
# command read from stdin ("run <round>" -> {"put": GB/s, "get": GB/s}; "quit").
_PEER = r"""
import asyncio, json, sys, time, types
sys.path.insert(0, sys.argv[1])
import redis_kv_bench as h
from lmcache.v1.storage_backend.connector.redis_connector import RESPConnector
port, size_name, per_run, batch_bytes = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
nbytes, shape = h.SIZES[size_name]
args = types.SimpleNamespace(port=port, bytes_per_run=per_run, batch_bytes=batch_bytes, resp_threads=8)
ctx = h.LMCacheCtx(args, nbytes, shape)
objs = []
for i in range(ctx.nkeys):
    o = ctx.be.allocate(ctx.md.get_shapes(), ctx.md.get_dtypes(), ctx.fmt)
    o.tensor.view(-1).view(ctx.torch.int32)[:2] = i
    objs.append(o)
async def make():
    return RESPConnector("127.0.0.1", port, ctx.loop, ctx.be, num_threads=args.resp_threads)
conn = ctx.run(make())
print(json.dumps({"ready": ctx.nkeys}), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "quit":
        break
    h.flushall(port)
    keys = ctx.keys(int(cmd[1]))
    t0 = time.perf_counter()
    for s in range(0, ctx.nkeys, ctx.batch):
        ctx.run(conn.batched_put(keys[s:s + ctx.batch], objs[s:s + ctx.batch]))
    t1 = time.perf_counter()
    bad = 0
    for s in range(0, ctx.nkeys, ctx.batch):
        got = ctx.run(conn.batched_get(keys[s:s + ctx.batch]))
        for j, g in enumerate(got):
            if g is None or int(g.tensor.view(-1).view(ctx.torch.int32)[1]) != s + j:
                bad += 1
            if g is not None:
                g.ref_count_down()
    t2 = time.perf_counter()
    total = ctx.nkeys * nbytes
    print(json.dumps({"put": total / (t1 - t0) / 1e9, "get": total / (t2 - t1) / 1e9, "bad": bad}), flush=True)
conn.pq_executor.shutdown(wait=True)
conn.client.close()
ctx.close()
"""


def _peers_dir() -> Path:
    """../shared/peers beside the checkout (a worktree may sit a level deeper)."""
    for base in (ROOT, ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "peers" / "redis_kv_bench.py").exists():
            return base / "shared" / "peers"
    return ROOT.parent / "shared" / "peers"


class Peer:
    """The LMCache process: one run per `run` call, on the same server as the tier."""

    def __init__(self, python: str, peers_dir: Path, port: int, size: str, per_run: int, batch_bytes: int) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # LMCache's own logging; shown if it fails
        self.process = subprocess.Popen(
            [python, "-c", _PEER, str(peers_dir), str(port), size, str(per_run), str(batch_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.keys = int(self._reply()["ready"])

    def _reply(self) -> dict[str, float]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-2000:]
            raise RuntimeError(f"the LMCache process exited ({self.process.wait()}):\n{tail}")
        return dict(json.loads(line))

    def run(self, round_no: int) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"run {round_no}\n")
        self.process.stdin.flush()
        reply = self._reply()
        if reply["bad"]:
            raise RuntimeError(f"LMCache read back {reply['bad']} bad chunks")
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()  # the Popen this object started, by its pid
                self.process.wait()


class TierRun:
    """The same runs through the tier: frames encoded on the caller, verified on the way back."""

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        per_run: int,
        batch_bytes: int,
        copy: bool = False,
        write_lanes: int | None = None,
    ) -> None:
        import redis

        self.layout = layout
        self.n = max(8, per_run // layout.block_bytes)
        self.batch = max(1, batch_bytes // layout.block_bytes)
        self.encode = encode_block if copy else frame_parts
        self.done: list[int] = []  # what the tier said it is done with (RemoteLink unpins those paths)
        slots = np.random.default_rng(0).integers(0, 256, (self.n, layout.block_bytes), dtype=np.uint8)
        self.payloads = [memoryview(slot) for slot in slots]  # the blocks' slots: one buffer each
        self.tokens = [np.full(layout.block_size, i % 50_000, dtype="<u4") for i in range(self.n)]
        self.plain = redis.Redis.from_url(url)
        self.tier = RedisTier(
            RedisOptions(
                url=url,
                key_prefix="bench",
                socket_timeout_s=30,
                write_timeout_s=30,
                max_queue_bytes=2 * batch_bytes + (64 << 20),
                **({} if write_lanes is None else {"write_lanes": write_lanes}),
            )
        )

    def run(self, round_no: int) -> dict[str, float]:
        self.plain.flushall()
        hashes = [(round_no << 32 | i).to_bytes(16, "big") for i in range(self.n)]
        layout, tier = self.layout, self.tier
        encode, done = self.encode, partial(self.done.append, round_no)
        self.done.clear()
        t0 = time.perf_counter()
        for start in range(0, self.n, self.batch):
            for i in range(start, min(self.n, start + self.batch)):
                frame = encode(layout, NS, hashes[i], PARENT, self.tokens[i], self.payloads[i])
                if not tier.submit(NS, hashes[i], frame, done=done):
                    raise RuntimeError("the tier refused a write: raise max_queue_bytes")
            if not tier.wait_idle(600):
                raise RuntimeError("the tier's writer did not drain")
        t1 = time.perf_counter()
        if len(self.done) != self.n:
            raise RuntimeError(f"the tier called done for {len(self.done)} of {self.n} writes")
        for start in range(0, self.n, self.batch):
            batch = hashes[start : start + self.batch]
            for offset, frame in enumerate(tier.fetch(NS, batch, frame_bytes=layout.block_bytes)):
                if frame is None:
                    raise RuntimeError("the tier missed a block it stored")
                decode_block(frame, layout, NS, batch[offset], PARENT, self.tokens[start + offset])
        t2 = time.perf_counter()
        stats = tier.stats()
        if stats.spills_dropped or stats.writes_failed or stats.read_errors:
            raise RuntimeError(f"the tier dropped or failed operations: {stats}")
        total = self.n * layout.block_bytes
        return {"put": total / (t1 - t0) / 1e9, "get": total / (t2 - t1) / 1e9}

    def close(self) -> None:
        self.tier.close()
        self.plain.flushall()
        self.plain.close()


def bench_size(args: argparse.Namespace, url: str, port: int, size: str) -> dict[str, object]:
    layout = LAYOUTS[size]
    peer = Peer(args.peer_python, Path(args.peers_dir), port, size, args.bytes_per_run, args.batch_bytes)
    tier = TierRun(url, layout, args.bytes_per_run, args.batch_bytes, copy=args.copy, write_lanes=args.write_lanes)
    if peer.keys != tier.n:
        raise RuntimeError(f"LMCache runs {peer.keys} keys, the tier {tier.n}")
    rounds: list[dict[str, float]] = []
    try:
        for round_no in range(args.rounds + 1):
            order = [("lmcache", peer.run), ("tier", tier.run)]
            figures: dict[str, float] = {"load": os.getloadavg()[0]}
            for name, run in order if round_no % 2 else order[::-1]:
                for op, value in run(round_no).items():
                    if op in ("put", "get"):
                        figures[f"{name}_{op}"] = value
            if round_no:  # round 0 warms both up
                rounds.append(figures)
            print(
                f"{size} round {round_no}{' (warm-up)' if not round_no else ''}: load {figures['load']:.1f}  "
                + "  ".join(f"{k} {v:.2f}" for k, v in figures.items() if k != "load"),
                file=sys.stderr,
            )
    finally:
        peer.close()
        tier.close()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    return {
        "block": size,
        "keys": tier.n,
        "frames": "copied" if args.copy else "parts",
        "write_lanes": tier.tier.options.write_lanes,
        "rounds": rounds,
        "lmcache_put": median("lmcache_put"),
        "lmcache_get": median("lmcache_get"),
        "tier_put": median("tier_put"),
        "tier_get": median("tier_get"),
        "put_ratio": statistics.median(r["tier_put"] / r["lmcache_put"] for r in rounds),
        "get_ratio": statistics.median(r["tier_get"] / r["lmcache_get"] for r in rounds),
        "load": [round(min(r["load"] for r in rounds), 1), round(max(r["load"] for r in rounds), 1)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,2MiB", help=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (one more warms up)")
    parser.add_argument("--bytes-per-run", type=int, default=128 << 20)
    parser.add_argument("--batch-bytes", type=int, default=32 << 20, help="the peers' harness default")
    parser.add_argument("--peer-python", default=str(Path.home() / ".cache/prefixcache-peers/lmcache/bin/python"))
    parser.add_argument("--peers-dir", default=str(_peers_dir()), help="where redis_kv_bench.py is")
    parser.add_argument("--copy", action="store_true", help="put owned frames (encode_block), not parts")
    parser.add_argument("--write-lanes", type=int, help="the tier's writer connections (default: RedisOptions')")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)

    from tests.support.redis_server import RedisServer  # the helper the tests use

    server = RedisServer(Path(tempfile.mkdtemp(prefix="redis-peer-bench-"))).start()
    try:
        rows = [bench_size(args, server.url, server.port, size) for size in args.sizes.split(",")]
    finally:
        server.stop()
    print("| block | LMCache RESP put | tier put | put ratio | LMCache RESP get | tier get | get ratio | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        low, high = r["load"]
        print(
            f"| {r['block']} | {r['lmcache_put']:.2f} | {r['tier_put']:.2f} | {r['put_ratio']:.2f} "
            f"| {r['lmcache_get']:.2f} | {r['tier_get']:.2f} | {r['get_ratio']:.2f} | {low}-{high} |"
        )
    report = {"unit": "GB/s of payload (1e9 bytes/s), medians over rounds", "args": vars(args), "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
