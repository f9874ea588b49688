"""Real `redis-server` processes for tests: a standalone server and a local three-master cluster.

Servers listen on free loopback ports (optionally TLS-only), keep no data on disk (`--save ""
--appendonly no`), and can be SIGKILLed and restarted on the same port. Readiness
is always polled with a bounded deadline (never a blind sleep). Every server dies with the
process that started it, even if that process is SIGKILLed (tests/support/lifetime.py).

Fixtures (register with `pytest_plugins = ["tests.support.redis_server"]` in a conftest,
or import them into a test module):
- `redis_server`: one server shared by the test session (isolate with key prefixes);
- `private_redis`: a server of one test's own, free to kill, pause or reconfigure;
- `redis_cluster`: a three-master Redis Cluster shared by the session.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.support import lifetime

READY_TIMEOUT_S = 10.0
_POLL_S = 0.01


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(f"{binary} not found on PATH; install Redis >= 6.2 (e.g. apt-get install redis-server)")
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, for cluster nodes, a free bus port at +10000)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if not cluster_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def _pong(port: int, tls: ssl.SSLContext | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as raw:
            sock = tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    openssl = _require("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for args in (
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=prefixcache-test-ca",
        ],
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
        [
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "1",
            "-extfile",
            "san.cnf",
        ],
    ):
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=30)
    return files


class RedisServer:
    """One redis-server process on a fixed loopback port; restartable on that port."""

    def __init__(
        self, workdir: Path, port: int | None = None, extra_args: Sequence[str] = (), tls: TlsFiles | None = None
    ) -> None:
        self.binary = _require("redis-server")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.tls = tls
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.cert),
            "--tls-key-file",
            str(self.tls.key),
            "--tls-ca-cert-file",
            str(self.tls.ca),
            "--tls-auth-clients",
            "no",
        ]

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> RedisServer:
        args = [
            self.binary,
            *self._listen_args(),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
            *self.extra_args,
        ]
        self.process = lifetime.popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Killed at interpreter exit too, should a test die before its teardown; and by the kernel
        # should this process die without running finalizers (lifetime.popen).
        weakref.finalize(self, lifetime.kill, self.process, READY_TIMEOUT_S)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        tls = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None
        while not _pong(self.port, tls):
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s: {self._log_tail()}")
            time.sleep(_POLL_S)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would; returns once the process is gone."""
        if self.process is not None:
            lifetime.kill(self.process, READY_TIMEOUT_S)

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        self.kill()
        self.start(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            lifetime.stop(self.process, 5)

    def client(self, **kwargs) -> redis.Redis:
        """A plain client for assertions and fault injection (not the code under test)."""
        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 1.0)
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def pause(self, millis: int) -> None:
        """CLIENT PAUSE <millis> ALL: the server accepts connections but answers nothing."""
        with self.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", millis, "ALL")

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


class RedisClusterProcesses:
    """A local Redis Cluster of `masters` primaries and no replicas, all on loopback."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = Path(workdir)
        self.nodes = []
        for _ in range(masters):
            port = free_port(cluster_bus=True)
            args = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "2000",
            )
            self.nodes.append(RedisServer(self.workdir / f"node-{port}", port, args))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [_require("redis-cli"), "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            timeout=timeout_s,
            capture_output=True,
        )
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float) -> None:
        """Until every node reports `cluster_state:ok` (after start, or a node's restart)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            with node.client() as client:
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster not ok after {timeout_s}s")
                    time.sleep(_POLL_S)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
