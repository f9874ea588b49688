"""The host tier's shared memory against real processes and a real, deliberately small tmpfs.

- A host tier larger than /dev/shm never starts (one line naming /dev/shm, its size and free
  space and --host-capacity), and one that starts has every page: a worker writing all of it
  while the tmpfs is otherwise full does not SIGBUS.
- A service killed with its whole process group leaves its segment; the next service on the same
  address reclaims it (one segment, not two; the dead one's pages are freed once unmapped, and a
  process still mapping them keeps working meanwhile). A live service's segment is never taken.
- `prefixcache shm clean` removes only dead owners' segments.
- A SIGKILLed pytest session leaves no redis-server, no service and no segment behind.

Each scenario runs in a private mount namespace with its own tmpfs at /dev/shm (`PrivateShm`:
`unshare -m` as root, `unshare -r -m` otherwise), seen from here through /proc/PID/root, so
sizes and usage are exact and nothing touches the machine's /dev/shm. Where no namespace can be
made, those tests skip and say why.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.client import CacheClient
from prefixcache.tiers.shm import SHM_DIR, list_segments, segment_name_for
from prefixcache_services import cli
from tests.support import lifetime
from tests.support.poll import poll
from tests.support.redis_server import free_port
from tests.support.service import layout_of

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
READY = "prefixcache serve: listening on "
MiB = 1 << 20


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


class PrivateShm:
    """A tmpfs of `size_mib` at /dev/shm in a mount namespace of its own, held by a sleeping process."""

    def __init__(self, size_mib: int) -> None:
        unshare = ["unshare", "--mount", "--propagation", "private"]
        self.user_ns = os.geteuid() != 0
        if self.user_ns:
            unshare[1:1] = ["--user", "--map-root-user"]
        script = f"mount -t tmpfs -o size={size_mib}m,mode=1777 tmpfs /dev/shm && echo ready && exec sleep 3600"
        self.holder = lifetime.popen(
            [*unshare, "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            error = self.holder.stderr.read() if self.holder.wait(10) is not None else ""
            raise OSError(f"no private tmpfs: {error.strip() or line!r}")
        self.dir = Path(f"/proc/{self.holder.pid}/root/dev/shm")  # the namespace's /dev/shm, seen from here

    def command(self, args: list[str]) -> list[str]:
        """`args` run inside the namespace (nsenter execs them: their pid is the process's)."""
        join = ["-U", "--preserve-credentials", "-m"] if self.user_ns else ["-m"]
        return ["nsenter", "-t", str(self.holder.pid), *join, "--", *args]

    def used(self) -> int:
        vfs = os.statvfs(self.dir)
        return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(10)


@pytest.fixture
def private_shm(request) -> Iterator[PrivateShm]:
    size = getattr(request, "param", 64)
    try:
        shm = PrivateShm(size)
    except OSError as error:
        pytest.skip(
            f"needs a private mount namespace with its own tmpfs (root, or unprivileged user namespaces): {error}"
        )
    yield shm
    shm.close()


class Serve:
    """`prefixcache serve` in the namespace, in a process group of its own (what systemd kills)."""

    def __init__(self, shm: PrivateShm, log: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log = log
        with log.open("a") as err:
            self.process = lifetime.popen(
                shm.command(
                    [
                        sys.executable,
                        "-m",
                        "prefixcache_services",
                        "serve",
                        "--listen",
                        f"127.0.0.1:{self.port}",
                        "--grace",
                        "1s",
                        *flags,
                    ]
                ),
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float = 60.0) -> Serve:
        line = self.process.stdout.readline()  # the first stdout line, printed once listening
        assert line.startswith(READY), f"no readiness line (exit {self.process.poll()}): {self.stderr()}"
        return self

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_group(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def exit_code(self, timeout_s: float = 60.0) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill_group()


def _shm_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`prefixcache shm ...` through the CLI's entry point: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["shm", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _segments(shm: PrivateShm) -> dict[str, dict]:
    """What `prefixcache shm list --json` reports, by name."""
    return {
        info.name: {
            "pid": info.record.pid,
            "alive": info.alive,
            "size_bytes": info.size,
            "resident_bytes": info.resident,
        }
        for info in list_segments(shm.dir)
    }


# -- no SIGBUS: the pages are reserved, or the service does not start ---------------------------


def test_a_host_tier_larger_than_dev_shm_refuses_to_start_with_one_line(private_shm, tmp_path) -> None:
    service = Serve(private_shm, tmp_path / "serve.log", "--host-capacity", "256MiB")
    assert service.exit_code() == 2
    lines = [line for line in service.stderr().splitlines() if line.startswith("prefixcache serve: error:")]
    assert len(lines) == 1, service.stderr()
    assert "/dev/shm" in lines[0] and "64.0 MiB" in lines[0] and "--host-capacity" in lines[0], lines[0]
    assert os.listdir(private_shm.dir) == [] and private_shm.used() == 0  # nothing half-reserved is left


def test_a_started_host_tier_has_every_page_so_no_writer_can_sigbus(private_shm, tmp_path) -> None:
    service = Serve(private_shm, tmp_path / "serve.log", "--host-capacity", "40MiB").wait_ready()
    try:
        name = segment_name_for("127.0.0.1", service.port)
        assert _segments(private_shm)[name]["resident_bytes"] >= 40 * MiB  # reserved, not sparse
        second = Serve(private_shm, tmp_path / "second.log", "--host-capacity", "40MiB")
        assert second.exit_code() == 2 and "free" in second.stderr()  # 24 MiB left: refused, not started
        # Fill the rest of the tmpfs, then write every byte of the segment from another process, as a
        # co-located worker writes its reserved slots: without the reservation this dies with SIGBUS.
        filler = private_shm.dir / "filler"
        with filler.open("wb", buffering=0) as out, pytest.raises(OSError):
            for _ in range(64):
                out.write(b"\1" * MiB)
        writer = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import mmap, sys\nwith open(sys.argv[1], 'r+b') as f:\n"
                    "    m = mmap.mmap(f.fileno(), 0)\n    m[:] = b'\\x07' * len(m)\n    m.close()"
                ),
                str(private_shm.dir / name),
            ],
            check=False,
            timeout=60,
        )
        assert writer.returncode == 0, f"the writer died: {writer.returncode}"  # -7 is SIGBUS
        assert service.process.poll() is None
    finally:
        service.stop()


# -- a killed service's segment is reclaimed by its successor; a live one's never -----------------


@pytest.mark.parametrize("private_shm", [128], indirect=True)
def test_a_service_killed_with_its_group_is_reclaimed_by_the_next_on_its_address(private_shm, tmp_path) -> None:
    first = Serve(private_shm, tmp_path / "first.log", "--host-capacity", "32MiB").wait_ready()
    name = segment_name_for("127.0.0.1", first.port)
    path = private_shm.dir / name
    with path.open("r+b") as handle:  # a worker's mapping of the segment, kept across the kill
        mapping = mmap.mmap(handle.fileno(), 32 * MiB)
    mapping[:8] = b"kept KV!"
    with CacheClient(f"127.0.0.1:{first.port}") as client:  # the first Attach builds the cache...
        client.attach("model", layout_of(), same_host=False)
    assert (private_shm.dir / f"{name}.held").exists()  # ...and its presence table (presence.py)
    first.kill_group()
    assert _segments(private_shm)[name]["alive"] is False  # what SIGKILL of the group leaves
    assert _segments(private_shm)[f"{name}.held"]["alive"] is False
    dead_socket = os.stat(private_shm.dir / f"{name}.sock").st_ino  # its control socket, left too
    dead_table = os.stat(private_shm.dir / f"{name}.held").st_size  # reclaimed (unmapped) by the successor
    used_with_the_dead_one = private_shm.used() - dead_table
    assert used_with_the_dead_one >= 32 * MiB

    second = Serve(private_shm, tmp_path / "second.log", "--host-capacity", "32MiB", port=first.port).wait_ready()
    try:
        segments = _segments(private_shm)
        assert list(segments) == [name], segments  # the same name, no second one beside it, no dead table
        assert segments[name]["pid"] == second.pid and segments[name]["alive"] is True
        assert "reclaimed shared memory" in second.stderr()
        assert os.stat(private_shm.dir / f"{name}.sock").st_ino != dead_socket  # removed, bound anew
        # The old pages live on while mapped (the mapping still works, no SIGBUS) and go with it.
        assert mapping[:8] == b"kept KV!"
        mapping[8:16] = b"writable"
        assert private_shm.used() >= used_with_the_dead_one + 32 * MiB
        mapping.close()
        assert poll(lambda: private_shm.used() < used_with_the_dead_one + 2 * MiB, 10)  # the dead one's freed
    finally:
        second.stop()
    assert os.listdir(private_shm.dir) == []  # SIGTERM unlinks its own segment and socket


def test_a_live_services_segment_is_never_taken_by_a_second_instance(private_shm, tmp_path) -> None:
    first = Serve(private_shm, tmp_path / "first.log", "--host-capacity", "8MiB").wait_ready()
    try:
        name = segment_name_for("127.0.0.1", first.port)
        inode = os.stat(private_shm.dir / name).st_ino
        others = [
            Serve(private_shm, tmp_path / f"other-{attempt}.log", "--host-capacity", "8MiB", "--shm-name", name)
            for attempt in range(3)
        ]  # at once: none may win a race for the name either
        same_address = Serve(private_shm, tmp_path / "same.log", "--host-capacity", "8MiB", port=first.port)
        for other in others:
            assert other.exit_code() == 2
            error = [line for line in other.stderr().splitlines() if "error:" in line]
            assert len(error) == 1 and "belongs to a running service" in error[0] and f"pid {first.pid}" in error[0]
        assert same_address.exit_code() == 2 and "cannot listen" in same_address.stderr()
        assert os.stat(private_shm.dir / name).st_ino == inode and first.process.poll() is None
        assert list(_segments(private_shm)) == [name]
    finally:
        first.stop()


def test_shm_clean_removes_only_dead_owners_segments(private_shm, tmp_path, capsys) -> None:
    live = Serve(private_shm, tmp_path / "live.log", "--host-capacity", "8MiB")
    dead = Serve(private_shm, tmp_path / "dead.log", "--host-capacity", "8MiB", "--shm-name", "pfx-dead")
    try:
        live.wait_ready()
        dead.wait_ready().kill_group()
        (private_shm.dir / "not-ours").write_bytes(b"x" * 8192)  # another program's shared memory
        live_name = segment_name_for("127.0.0.1", live.port)
        segments = _segments(private_shm)
        assert {n: (s["alive"], s["size_bytes"] > 8 * MiB) for n, s in segments.items()} == {
            live_name: (True, True),
            "pfx-dead": (False, True),
        }
        code, table, _ = _shm_cli(capsys, "list", "--dir", str(private_shm.dir))
        assert code == 0 and "alive" in table and "dead" in table and str(live.pid) in table
        code, out, _ = _shm_cli(capsys, "list", "--json", "--dir", str(private_shm.dir))
        assert {entry["name"]: entry["alive"] for entry in json.loads(out)} == {live_name: True, "pfx-dead": False}

        code, _, err = _shm_cli(capsys, "clean", live_name, "--dir", str(private_shm.dir))
        assert code == 2 and "running service" in err
        assert (private_shm.dir / "pfx-dead.sock").is_socket()  # the dead one's control socket
        code, out, _ = _shm_cli(capsys, "clean", "--dir", str(private_shm.dir))
        assert code == 0 and "removed pfx-dead" in out, out
        # ...goes with its segment; the live one's stays, as does another program's file.
        assert sorted(os.listdir(private_shm.dir)) == sorted([live_name, f"{live_name}.sock", "not-ours"])
        assert live.process.poll() is None
    finally:
        live.stop()
        dead.stop()


# -- a SIGKILLed test session leaves nothing behind ---------------------------------------------


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie waiting for a reaper is gone already


def test_a_sigkilled_pytest_session_leaves_no_process_and_no_segment(tmp_path) -> None:
    report = tmp_path / "victim.json"
    inner = lifetime.popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-s",
            str(ROOT / "tests" / "session_victim.py"),
            "--basetemp",
            str(tmp_path / "inner"),
        ],
        cwd=ROOT,
        env=dict(_env(), PFX_VICTIM_REPORT=str(report)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert poll(lambda: report.exists() or inner.poll() is not None, 180), "the inner session never got going"
        assert inner.poll() is None, inner.stdout.read().decode(errors="replace")
        victim = json.loads(report.read_text())
        assert all(_running(pid) for pid in victim["pids"].values()), victim
        assert all((SHM_DIR / name).exists() for name in victim["segments"]), victim
        inner.send_signal(signal.SIGKILL)  # the pytest process alone: no teardown, no finalizers
        inner.wait(10)
        assert poll(lambda: not any(_running(pid) for pid in victim["pids"].values()), 20), victim
        assert poll(lambda: not any((SHM_DIR / name).exists() for name in victim["segments"]), 40), (
            victim,
            [s.name for s in list_segments()],
        )
        assert poll(lambda: not _running(victim["janitor"]), 40)  # its work done, the janitor is gone too
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait(10)


# -- in this process: closing after an operator's rm, and the lock as the liveness test ---------


def test_closing_a_host_tier_whose_segment_file_was_removed_finishes(caplog) -> None:
    from prefixcache.config import DType, KVLayout
    from prefixcache.tiers.host import HostTier

    host = HostTier(KVLayout(2, 2, 8, 4, DType.FLOAT32), 1 << 20)
    (SHM_DIR / host.segment_name).unlink()  # `rm /dev/shm/<segment>` while the service runs
    host.close()
    assert "already removed" in caplog.text
    host.close()  # idempotent


def test_a_segment_is_live_exactly_while_its_owner_holds_it() -> None:
    from prefixcache.errors import ConfigError
    from prefixcache.tiers.shm import OwnedSegment, SegmentInUse, remove_if_dead

    name = f"pfx-test-lock-{os.getpid()}"
    segment = OwnedSegment(name, 3 * MiB, owner="test")
    try:
        info = {i.name: i for i in list_segments()}[name]
        assert info.alive and info.record.pid == os.getpid() and info.record.pid_matches()
        assert info.resident >= 3 * MiB  # reserved, not sparse
        with pytest.raises(SegmentInUse):
            OwnedSegment(name, MiB)  # a second owner, even in this process (another open file)
        with pytest.raises(SegmentInUse):
            remove_if_dead(segment.path)
    finally:
        segment.close()
    assert not segment.path.exists()
    foreign = SHM_DIR / f"pfx-test-foreign-{os.getpid()}"
    foreign.write_bytes(b"\0" * 8192)
    try:
        with pytest.raises(ConfigError, match="not a prefixcache segment"):
            OwnedSegment(foreign.name, MiB)
        assert foreign.exists()
    finally:
        foreign.unlink()


def _mapped_kib(path: Path) -> int:
    """Rss of this process's mapping of `path` (/proc/self/smaps), in KiB."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            return next(int(entry.split()[1]) for entry in lines[i + 1 :] if entry.startswith("Rss:"))
    raise AssertionError(f"{path} is not mapped")


def test_a_prefaulted_segment_has_every_data_page_mapped_and_still_reads_zeros() -> None:
    """`host_prefault`: every data page is mapped at start (no first-touch fault on a commit);
    without it, none is until written. The segment's bytes are unchanged (zeros)."""
    from prefixcache.config import CacheConfig
    from prefixcache.errors import ConfigError
    from prefixcache.tiers.shm import OwnedSegment

    for prefault, at_least, at_most in ((True, 4 * MiB, None), (False, 0, MiB // 4)):
        segment = OwnedSegment(f"pfx-test-prefault-{os.getpid()}-{prefault}", 4 * MiB, prefault=prefault)
        try:
            resident = _mapped_kib(segment.path) * 1024
            assert resident >= at_least and (at_most is None or resident <= at_most), (prefault, resident)
            assert not any(segment.buf[:: mmap.PAGESIZE]) and not any(segment.buf[-64:])
        finally:
            segment.close()
    with pytest.raises(ConfigError, match="host_prefault: must be true or false, got 'yes'"):
        CacheConfig(host_prefault="yes")  # type: ignore[arg-type]


_EXIT_WITHOUT_CLOSE = r"""
import os, sys
from prefixcache.tiers.shm import OwnedSegment
segment = OwnedSegment(sys.argv[1], 1 << 20, owner="test")
child = os.fork()
if child == 0:
    sys.exit(0)  # a forked child's normal exit runs its copy of the at-exit handler
os.waitpid(child, 0)
print(segment.path.exists(), flush=True)
"""


def test_an_owner_that_exits_without_closing_removes_its_segment_but_a_forked_child_does_not() -> None:
    path = SHM_DIR / f"pfx-test-exit-{os.getpid()}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, path.name],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "True", "the forked child's exit removed its parent's live segment"
        assert not path.exists(), "the owner's exit left its segment"
    finally:
        path.unlink(missing_ok=True)  # a failed run leaves nothing behind either
