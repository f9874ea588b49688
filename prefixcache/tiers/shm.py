"""Shared-memory segments a service owns: pages reserved up front, an owner record, reclaim after a kill.

A segment is a file in `SHM_DIR` (/dev/shm, where shm_open(3) puts POSIX shared memory) laid
out as [data, rounded up to a page][owner record, one page]. Workers map it by name and use
only the data part (`host.MappedSegment`), so the record at the end is invisible to them.

Invariants:
- Every page of a segment is allocated before `OwnedSegment` returns (posix_fallocate): a
  /dev/shm too small for it fails here, at start, with one line naming the directory, its size
  and free space and `--host-capacity`; no later write, by the service or by any process that
  maps the segment, can fault for a page the tmpfs cannot supply (SIGBUS).
- With `prefault`, the owner also maps every data page before `OwnedSegment` returns: the tmpfs
  zeroes a reserved page at its first touch (~9 µs a page on a 2-vCPU VM), so without it the
  first commits into each fresh page pay that; with it, start-up does (~2.3 s per GiB there).
- The owner holds an exclusive flock(2) on the segment for as long as it lives; the kernel drops
  it when the owner exits, however it dies, and across PID namespaces (containers sharing one
  tmpfs). A segment is *live* exactly while that lock is held. The record (pid, the pid's start
  time, listen address, ...) says who owned it, for operators; liveness never rests on a pid,
  which a restarted container or a busy machine reuses.
- A segment whose owner is gone is reclaimed by unlinking its name: a worker still mapping it
  keeps reading and writing its pages until it unmaps them, and the tmpfs frees them then.
  A live segment is never unlinked by anyone but its owner. An owner that exits without
  closing it (but is not killed) unlinks the name at exit; a killed owner's stays until then.
- The service's control socket is a file beside its segment (`control_socket_path`). Whoever
  removes a dead owner's segment removes that owner's socket file first, under the segment's
  lock, so a successor's socket is never the one removed; and its presence table
  (`presence_path`, a segment with a lock of its own), if that one's owner is gone too.
- This module imports no torch: `prefixcache shm list|clean` and test janitors stay fast.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import json
import logging
import mmap
import os
import stat as statmod
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PAGE = mmap.PAGESIZE
RECORD_BYTES = PAGE
MAGIC = b"prefixcache-segment-v1\n"
NAME_PREFIX = "prefixcache-"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def segment_bytes(data_bytes: int) -> int:
    """Bytes a segment takes in the tmpfs: its data rounded up to a page, plus the owner record."""
    return -(-data_bytes // PAGE) * PAGE + RECORD_BYTES


def dev_shm_bytes_for(host_capacity: int) -> int:
    """The smallest /dev/shm for a service with this host capacity: its own segment, plus its
    predecessor's, which workers still map (and the tmpfs still holds) after a restart until they
    re-attach, so that a restarted service can reserve its segment at once."""
    return 2 * segment_bytes(host_capacity)


def segment_name_for(host: str, port: int) -> str:
    """The default segment name of a service listening on host:port: a successor on the same
    address finds (and, once its owner is gone, reclaims) its predecessor's segment."""
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in host.strip("[]"))
    return f"{NAME_PREFIX}{safe}-{port}"


def check_name(name: str, field_name: str = "shm_name") -> str:
    if not name or "/" in name or name in (".", "..") or len(name) > 200 or "\0" in name:
        raise ConfigError(field_name, f"{name!r} is not a shared-memory name (1-200 characters, no '/')")
    return name


def _proc_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot): with the pid, it names a
    process uniquely, so a reused pid is not taken for the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class OwnerRecord:
    pid: int
    ppid: int
    start_ticks: int
    boot_id: str
    owner: str  # what the owner serves, e.g. its listen address ("" when unknown)
    data_bytes: int
    created: float  # unix time

    @classmethod
    def of_this_process(cls, owner: str, data_bytes: int) -> OwnerRecord:
        pid = os.getpid()
        return cls(pid, os.getppid(), _proc_start_ticks(pid) or 0, _boot_id(), owner, data_bytes, time.time())

    def encode(self) -> bytes:
        raw = MAGIC + json.dumps(asdict(self), sort_keys=True).encode()
        if len(raw) > RECORD_BYTES:
            raise ConfigError("shm_name", "owner record does not fit in one page (owner string too long)")
        return raw.ljust(RECORD_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> OwnerRecord | None:
        if not raw.startswith(MAGIC):
            return None
        try:
            fields = json.loads(raw[len(MAGIC) :].rstrip(b"\0"))
            return cls(**fields)
        except (ValueError, TypeError):
            return None

    def pid_matches(self) -> bool:
        """The recorded pid is this very process, alive in this PID namespace (not a reused pid)."""
        return self.boot_id == _boot_id() and _proc_start_ticks(self.pid) == self.start_ticks

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"pid {self.pid}{' serving ' + self.owner if self.owner else ''}, created {started}"


def read_record(fd: int) -> OwnerRecord | None:
    size = os.fstat(fd).st_size
    if size < RECORD_BYTES:
        return None
    return OwnerRecord.decode(os.pread(fd, RECORD_BYTES, size - RECORD_BYTES))


def _locked_by_someone(fd: int) -> bool:
    """True when another open file holds the owner's lock (this probe leaves it as it was)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


@dataclass(frozen=True)
class SegmentInfo:
    """One prefixcache segment in a directory, as `prefixcache shm list` shows it."""

    name: str
    path: Path
    record: OwnerRecord
    alive: bool
    size: int  # bytes, owner record included
    resident: int  # bytes of tmpfs pages allocated to it (all of them once reserved)


def _open_existing(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None


def inspect_segment(path: Path) -> SegmentInfo | None:
    """The segment at `path`, or None when it is not a prefixcache segment (or is gone)."""
    try:
        fd = _open_existing(path)
    except OSError:
        return None  # another user's file, a directory, a socket...
    if fd is None:
        return None
    try:
        info = os.fstat(fd)
        record = read_record(fd) if statmod.S_ISREG(info.st_mode) else None
        if record is None:
            return None
        return SegmentInfo(path.name, path, record, _locked_by_someone(fd), info.st_size, info.st_blocks * 512)
    finally:
        os.close(fd)


def list_segments(directory: Path = SHM_DIR) -> list[SegmentInfo]:
    """Every prefixcache segment in `directory` this process can read, by name."""
    found = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        info = inspect_segment(Path(entry.path))
        if info is not None:
            found.append(info)
    return found


class SegmentInUse(ConfigError):
    """The segment's owner is alive: nobody but it may remove the segment."""

    def __init__(self, path: Path, record: OwnerRecord | None) -> None:
        who = record.describe() if record else "a process that has not written its record yet"
        super().__init__(
            "shm_name",
            f"shared memory {path} belongs to a running service ({who}); "
            "stop it, or give this one another --shm-name or --listen address",
        )
        self.path = path


def remove_if_dead(path: Path) -> OwnerRecord | None:
    """Unlinks the prefixcache segment at `path` if its owner is gone; its record, None if no such file.

    Raises `SegmentInUse` for a live owner and ConfigError for a file that is not a prefixcache
    segment. Unlinking removes only the name: mappings of the segment stay valid.
    """
    try:
        fd = _open_existing(path)
    except PermissionError:
        raise ConfigError(
            "shm_name",
            f"{path} exists and this user cannot open it (another user's segment?); choose another --shm-name",
        ) from None
    if fd is None:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SegmentInUse(path, read_record(fd)) from None
        record = read_record(fd)
        if record is None:
            raise ConfigError(
                "shm_name", f"{path} exists and is not a prefixcache segment; remove it or choose another --shm-name"
            )
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # still the file we locked, not a successor's
                with contextlib.suppress(FileExistsError):  # under the lock: no successor bound it yet
                    remove_dead_socket(control_socket_path(path))
                with contextlib.suppress(ConfigError):  # a live successor's stays (SegmentInUse)
                    remove_if_dead(presence_path(path))
                os.unlink(path)
        except FileNotFoundError:
            pass
        except PermissionError:  # another user's file in the sticky /dev/shm
            raise ConfigError(
                "shm_name",
                f"{path} belongs to another user and cannot be removed by this one; choose another --shm-name",
            ) from None
        return record
    finally:
        os.close(fd)


def control_socket_path(segment: Path) -> Path:
    """The service's control socket beside its segment (services/cache_server/control_socket.py)."""
    return segment.with_name(f"{segment.name}.sock")


def presence_path(segment: Path) -> Path:
    """The service's presence table beside its segment (prefixcache/presence.py), a segment of its own."""
    return segment.with_name(f"{segment.name}.held")


def remove_dead_socket(path: Path) -> None:
    """Unlink the socket file this user left at `path`: a dead service's, when the caller knows
    that no live service owns the segment it sits beside. Any other file there raises
    FileExistsError and stays."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not statmod.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        raise FileExistsError(errno.EEXIST, "not this user's socket; left in place", str(path))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _reserve(fd: int, total: int, path: Path) -> None:
    """Allocate every page now, or fail with one line an operator can act on."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as error:
        where = path.parent
        try:
            vfs = os.statvfs(where)
            space = f"{where} is {mib(vfs.f_blocks * vfs.f_frsize)} with {mib(vfs.f_bavail * vfs.f_frsize)} free"
        except OSError:
            space = f"{where} cannot be measured"
        if error.errno == errno.ENOSPC:
            raise ConfigError(
                "host_capacity",
                f"{where} cannot hold the host tier's {mib(total)} segment "
                f"({space}); lower --host-capacity or enlarge {where} (docs/deploy.md, "
                "'Shared memory sizing')",
            ) from None
        if error.errno == errno.ENOMEM:
            raise ConfigError(
                "host_capacity",
                f"out of memory reserving the host tier's {mib(total)} segment in "
                f"{where} ({space}); lower --host-capacity or raise the memory limit",
            ) from None
        raise ConfigError("host_capacity", f"cannot reserve {mib(total)} in {where}: {error.strerror}") from None


def _unlink_if_ours(path: Path, inode: int) -> bool:
    """Unlink `path` if it is still our file `inode` (held open by us, so not reused); False if
    another file has replaced it. FileNotFoundError if the name is gone."""
    if os.stat(path).st_ino != inode:
        return False
    os.unlink(path)
    return True


def _unlink_at_exit(path: Path, inode: int, pid: int) -> None:
    """At interpreter exit, remove the name of a segment this process still owns (not in a forked
    child, which runs its copy of the handler)."""
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            _unlink_if_ours(path, inode)


class OwnedSegment:
    """A segment this process created, reserved and locked; `buf` is its data part.

    `close()` unmaps it and unlinks the name (tolerating a name already removed, e.g. by an
    operator), then drops the lock. It is idempotent. A process that exits without it unlinks
    the name at exit.
    """

    def __init__(
        self, name: str, data_bytes: int, owner: str = "", directory: Path = SHM_DIR, prefault: bool = False
    ) -> None:
        self.name = check_name(name)
        self.path = Path(directory) / name
        self.size = segment_bytes(data_bytes)
        self.data_bytes = self.size - RECORD_BYTES
        self._unlinked = False
        self._fd = self._create(OwnerRecord.of_this_process(owner, self.data_bytes))
        try:
            self._map = mmap.mmap(self._fd, self.size)
            if prefault:  # a write to each page maps it (a new segment is all zeros: nothing changes)
                view = memoryview(self._map)
                view[: self.data_bytes : PAGE] = bytes(len(range(0, self.data_bytes, PAGE)))
                view.release()
        except BaseException:
            self._discard()
            raise
        self.buf = memoryview(self._map)[: self.data_bytes]
        # A process that exits without close() (a script, an unhandled error) still removes its
        # name; only a kill leaves it, to the name's next owner or `prefixcache shm clean`.
        self._inode = os.fstat(self._fd).st_ino
        self._at_exit = functools.partial(_unlink_at_exit, self.path, self._inode, os.getpid())
        atexit.register(self._at_exit)

    def _create(self, record: OwnerRecord) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(3):
            try:
                fd = os.open(self.path, flags, 0o600)
                break
            except FileExistsError:
                previous = remove_if_dead(self.path)
                if previous is not None:
                    log.warning(
                        "reclaimed shared memory %s of a service that is gone (%s; its pages are freed "
                        "once no worker maps them)",
                        self.path,
                        previous.describe(),
                    )
        else:
            raise ConfigError("shm_name", f"{self.path} keeps reappearing; is another service starting with it?")
        self._fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while an inspector's probe holds it
            os.ftruncate(fd, self.data_bytes + RECORD_BYTES)
            os.pwrite(fd, record.encode(), self.data_bytes)
            started = time.monotonic()
            _reserve(fd, self.size, self.path)
            log.info(
                "shared memory %s: %s reserved in %.0f ms",
                self.path,
                mib(self.size),
                (time.monotonic() - started) * 1000,
            )
        except BaseException:
            self._discard()
            raise
        return fd

    def _discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def unlink(self) -> None:
        """Remove the name (idempotent), not the mapping: workers and a successor then see no
        segment by that name, while this process may still hold views of the memory."""
        if self._fd < 0 or self._unlinked:
            return
        self._unlinked = True
        atexit.unregister(self._at_exit)
        try:
            if not _unlink_if_ours(self.path, self._inode):
                log.warning("shared memory %s was replaced by another file; leaving that one", self.path)
        except FileNotFoundError:
            log.warning("shared memory %s was already removed; nothing to unlink", self.path)

    def close(self) -> None:
        if self._fd < 0:
            return
        self.buf.release()
        self._map.close()
        self.unlink()
        os.close(self._fd)  # releases the owner's lock, after the name is gone
        self._fd = -1
