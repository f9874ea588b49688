"""Fuzz of the compiled RESP reply reader (prefixcache/_resp.c), which parses bytes from the network.

Random and mutated reply streams (bit flips, truncations, inserted and repeated bytes, lengths
made huge or negative, stray RESP types) are fed to `resp_getex` (GET + PEXPIRE ... GT, and
GETEX) and `resp_set` through a socket
pair whose peer then hangs up. Each call must either return what the stream says (checked for
the unmutated streams) or raise one of the faults the module documents (ValueError,
TimeoutError, ConnectionError, OSError), never crash, hang past its deadline or allocate beyond
`max_value`. Seeded, so a failure reproduces; issue 33.
"""

from __future__ import annotations

import random
import socket
import time

import pytest

from prefixcache.native import core

pytestmark = pytest.mark.unit

FAULTS = (ValueError, TimeoutError, ConnectionError, OSError)
MAX_VALUE = 1 << 16
CASES = 6000


def _reply(rng: random.Random, count: int, extend: bool) -> tuple[bytes, list[bytes | None], list[int]]:
    """A well-formed read pipeline reply (with `extend`, each GET's followed by its PEXPIRE's: an
    integer, or an error at the key's position + count): the bytes, the values, the error positions."""
    out, values, errors = bytearray(), [], []
    refresh_errors = []
    for i in range(count):
        if extend and i:
            if rng.random() < 0.1:
                out += b"-NOPERM this user has no permissions to run the 'pexpire' command\r\n"
                refresh_errors.append(count + i - 1)
            else:
                out += rng.choice((b":1\r\n", b":0\r\n"))
        kind = rng.random()
        if kind < 0.6:
            value = rng.randbytes(rng.choice((0, 1, 7, 100, 4096, MAX_VALUE)))
            out += b"$%d\r\n%s\r\n" % (len(value), value)
            values.append(value)
        elif kind < 0.8:
            out += b"$-1\r\n" if rng.random() < 0.5 else b"_\r\n"
            values.append(None)
        else:
            out += b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
            values.append(None)
            errors.append(i)
    if extend:
        out += b":1\r\n"
    return bytes(out), values, sorted(errors + refresh_errors, key=lambda p: (p % count if p >= count else p, p))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data) + 1)
        choice = rng.randrange(7)
        if choice == 0 and data:  # flip a bit
            at = min(at, len(data) - 1)
            data[at] ^= 1 << rng.randrange(8)
        elif choice == 1:  # truncate
            del data[at:]
        elif choice == 2:  # insert random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif choice == 3:  # a huge, negative or junk length
            data[at:at] = rng.choice((b"$1099511627776\r\n", b"$-7\r\n", b"$99999999999999999999999\r\n", b"$\r\n"))
        elif choice == 4:  # another RESP type
            data[at:at] = rng.choice((b":1\r\n", b"*2\r\n", b"+OK\r\n", b"%1\r\n", b"\r\n", b"$3\r\nab"))
        elif choice == 5 and data:  # repeat a slice
            end = min(len(data), at + rng.randint(1, 64))
            data[at:at] = data[max(0, at - 1) : end]
        else:  # a long line without CRLF
            data[at:at] = b"+" + b"x" * rng.randint(1, 70_000)
    return bytes(data)


def _fed(data: bytes) -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.settimeout(0.5)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    theirs.settimeout(2)
    theirs.sendall(data)
    theirs.shutdown(socket.SHUT_WR)  # then EOF: a short stream is a closed connection, not a wait
    return ours, theirs


def test_random_and_mutated_getex_replies_return_or_raise_a_documented_fault() -> None:
    rng = random.Random(33)
    outcomes = {"returned": 0, "fault": 0}
    slowest = 0.0
    for case in range(CASES):
        count = rng.randint(1, 6)
        extend = case % 2 == 0  # GET + PEXPIRE ... GT; else GETEX (`reset`)
        data, values, errors = _reply(rng, count, extend)
        mutated = case % 5 != 0  # every fifth stream as sent, to check what comes back
        if mutated:
            data = _mutate(rng, data) if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 200))
        ours, theirs = _fed(data[:900_000])
        start = time.monotonic()
        try:
            got, got_errors = core.resp_getex(
                ours.fileno(), [b"k%d" % i for i in range(count)], 1000, 0.5, MAX_VALUE, 1.0, not extend
            )
        except FAULTS:
            outcomes["fault"] += 1
        else:
            outcomes["returned"] += 1
            assert len(got) == count and all(v is None or len(v) <= MAX_VALUE for v in got)
            if not mutated:
                assert [None if v is None else bytes(v) for v in got] == values, case
                assert [position for position, _ in got_errors] == errors, case
        finally:
            slowest = max(slowest, time.monotonic() - start)
            ours.close()
            theirs.close()
    assert outcomes["returned"] >= CASES // 5 and outcomes["fault"] > CASES // 2, outcomes
    assert slowest < 1.5, slowest  # the deadline (1 s) bounds every call


def test_random_and_mutated_set_replies_return_or_raise_a_documented_fault() -> None:
    rng = random.Random(34)
    for case in range(CASES // 3):
        count = rng.randint(1, 4)
        data = b"".join(rng.choice((b"+OK\r\n", b"-OOM command not allowed\r\n")) for _ in range(count))
        if case % 5:
            data = _mutate(rng, data)
        ours, theirs = _fed(data)
        try:
            result = core.resp_set(ours.fileno(), [b"k"] * count, [b"v"] * count, [1000] * count, 0.5, 1.0)
        except FAULTS:
            continue
        finally:
            ours.close()
            theirs.close()
        assert result is None or (isinstance(result, bytes) and len(result) <= 512)


@pytest.mark.slow
@pytest.mark.process
def test_the_fuzz_passes_under_asan_and_ubsan() -> None:
    """The same fuzz against a build with AddressSanitizer and UBSan (scripts/sanitize_resp.sh,
    ~10-20 s on 2 cores): an out-of-bounds read or undefined behaviour in the reader aborts it."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=False)
    if shutil.which("gcc") is None or not Path(asan.stdout.strip()).is_file():
        pytest.skip("needs gcc with libasan")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["bash", str(root / "scripts" / "sanitize_resp.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout
