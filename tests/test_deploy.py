"""Deployment files (deploy/, docs/deploy.md) checked offline against real components.

- Kubernetes manifests: strict schema validation with kubernetes-validate for the
  oldest supported (1.29, native sidecars) and a current release; kustomize renders.
- Every `prefixcache ...` in compose.yaml, the Dockerfile and the manifests parses
  with the real CLI parser (prefixcache_services.cli.build_parser), and the service starts with
  the compose/Kubernetes values and answers the health checks those files define.
- redis.conf and the Redis Cluster ConfigMap run under a real redis-server: eviction
  instead of OOM errors, and the least-privilege ACL user runs the real RedisTier
  (standalone and a 3+3 cluster formed by the Job's own script).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from threading import Thread

import kubernetes_validate
import pytest
import redis
import yaml

from prefixcache.config import parse_size
from tests.support.poll import poll
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.process]

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSIONS = ("1.29.0", "1.33.0")  # 1.29: native sidecars on by default
PLANNED_SUBCOMMANDS = {"serve", "worker", "route", "stats", "top", "inspect", "evict", "flush", "replay", "demo"}
# Stand-ins for the Secrets an operator creates (docs/deploy.md), to expand $(VAR)s.
EXAMPLE_SECRETS = {
    ("prefixcache-redis", "redis-url"): "redis+cluster://prefixcache:0a1b2c3d@redis-cluster:6379",
    ("prefixcache-auth", "token"): "0123456789abcdef0123456789abcdef",
}
DEADLINE_S = 20.0


# ---- loading the files ------------------------------------------------------------------------


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> list[dict]:
    return [doc for path in k8s_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_object(kind: str, name: str) -> dict:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_containers(workload: dict) -> dict[str, dict]:
    spec = workload["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def redis_directives(text: str) -> list[list[str]]:
    """redis.conf lines as argument lists (quotes honoured, comments dropped)."""
    return [shlex.split(line) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def redis_setting(text: str, name: str) -> list[str]:
    values = [d[1:] for d in redis_directives(text) if d[0].lower() == name]
    assert values, f"{name} is not set"
    return values[-1]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", (DEPLOY / "Dockerfile").read_text())
    return [
        (m.group(1).upper(), m.group(2).strip())
        for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
        if not m.group(0).lstrip().startswith("#")
    ]


def quantity(value: str) -> int:
    """Bytes of a Kubernetes quantity ("1280Mi", "3Gi") or a Docker size ("1280m")."""
    units = {"": 1, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value))
    assert match and match.group(2).lower() in units, f"unparsed quantity {value!r}"
    return int(match.group(1)) * units[match.group(2).lower()]


# ---- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} holds no object"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} at {list(error.path)}: {error.message}")


def test_kustomizations_reference_every_manifest_and_render() -> None:
    referenced: list[Path] = []
    for kustomization in K8S.rglob("kustomization.yaml"):
        for entry in yaml.safe_load(kustomization.read_text())["resources"]:
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{kustomization} lists missing {entry}"
            referenced += [target] if target.is_file() else []
    assert sorted(referenced) == [p.resolve() for p in k8s_files()], "each manifest in exactly one kustomization"
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not on PATH: kustomize rendering not checked")
    kinds = {}
    for overlay in ("", "external-redis"):
        out = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
        kinds[overlay] = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert "StatefulSet/redis-cluster" in kinds[""] and "Deployment/prefixcache" in kinds[""]
    assert kinds["external-redis"] == [
        "ConfigMap/prefixcache",
        "Deployment/prefixcache",
        "Deployment/prefixcache-router",
        "PodDisruptionBudget/prefixcache",
        "Service/prefixcache",
        "Service/prefixcache-pods",
        "Service/prefixcache-router",
    ]


def assert_shm_sized_for(shm_bytes: int, host_capacity: int) -> None:
    """The /dev/shm sizing rule (docs/deploy.md): room for the segment and a predecessor's still
    mapped after a restart, and not wildly more (a memory-backed tmpfs counts as memory)."""
    from prefixcache.tiers.shm import dev_shm_bytes_for

    needed = dev_shm_bytes_for(host_capacity)
    assert needed <= shm_bytes <= needed + host_capacity // 2, (
        f"/dev/shm of {shm_bytes} bytes for --host-capacity {host_capacity}: needs {needed} to {needed + host_capacity // 2}"
    )


def assert_docs_give_shm_size(prefix: str, size: str) -> None:
    """docs/deploy.md's sizing section quotes the manifests' /dev/shm size, not an older one."""
    section = (ROOT / "docs" / "deploy.md").read_text().split("## Sizing the tiers")[1].split("\n## ")[0]
    quoted = set(re.findall(re.escape(prefix) + r"(\w+)", section))
    assert quoted == {size}, f"docs/deploy.md quotes {prefix}{sorted(quoted)}, the manifests say {prefix}{size}"


def test_worker_pod_shares_memory_backed_shm_with_the_cache_sidecar() -> None:
    deployment = k8s_object("Deployment", "prefixcache")
    spec = deployment["spec"]["template"]["spec"]
    cache, worker = pod_containers(deployment)["cache"], pod_containers(deployment)["worker"]
    assert cache in spec["initContainers"] and cache["restartPolicy"] == "Always", "cache must be a native sidecar"
    mounts = {
        name: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for name, c in (("cache", cache), ("worker", worker))
    }
    assert mounts["cache"]["/dev/shm"] == mounts["worker"]["/dev/shm"]
    shm = next(v for v in spec["volumes"] if v["name"] == mounts["cache"]["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"
    capacity = parse_size(k8s_object("ConfigMap", "prefixcache")["data"]["PREFIXCACHE_HOST_CAPACITY"])
    assert_shm_sized_for(quantity(shm["emptyDir"]["sizeLimit"]), capacity)
    assert_docs_give_shm_size("sizeLimit: ", shm["emptyDir"]["sizeLimit"])
    # The service reserves the segment's pages at start: they are charged to the sidecar.
    assert quantity(cache["resources"]["limits"]["memory"]) > capacity
    assert (
        quantity(worker["resources"]["limits"]["memory"]) - quantity(worker["resources"]["requests"]["memory"])
        >= capacity
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert cache[probe]["grpc"]["port"] == 50051
        assert worker[probe]["httpGet"] == {"path": "/health", "port": 8000}
    assert cache["readinessProbe"]["grpc"]["service"] == "prefixcache.v1.PrefixCache"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in (cache, worker))
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert f"--metrics-port={annotations['prometheus.io/port']}" in cache["args"]


def test_service_exposes_http_and_metrics_but_not_grpc() -> None:
    ports = {p["name"]: p["port"] for p in k8s_object("Service", "prefixcache")["spec"]["ports"]}
    assert ports == {"http": 8000, "metrics": 9400}


def test_the_router_fronts_the_worker_pods_through_a_headless_service() -> None:
    """`prefixcache route --discover` resolves the headless Service to the worker pods: their HTTP
    port and their cache sidecar's gRPC port; the router's own pods are none of them."""
    workers = k8s_object("Deployment", "prefixcache")
    worker_labels = workers["spec"]["template"]["metadata"]["labels"]
    containers = pod_containers(workers)
    pods = k8s_object("Service", "prefixcache-pods")
    assert pods["spec"]["clusterIP"] == "None", "headless: DNS lists each pod, nothing load-balances"
    assert pods["spec"]["selector"].items() <= worker_labels.items()
    ports = {p["name"]: p["targetPort"] for p in pods["spec"]["ports"]}
    assert ports == {
        "http": containers["worker"]["ports"][0]["containerPort"],
        "grpc": next(p["containerPort"] for p in containers["cache"]["ports"] if p["name"] == "grpc"),
    }
    router = k8s_object("Deployment", "prefixcache-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not pods["spec"]["selector"].items() <= router_labels.items(), "the router is not an engine of its own"
    pdb = k8s_object("PodDisruptionBudget", "prefixcache")
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= router_labels.items()
    (container,) = pod_containers(router).values()
    args = expand(container["args"], container)
    options = dict(a.split("=", 1) for a in args[1:])
    assert args[0] == "route"
    assert options["--discover"] == f"http://prefixcache-pods:{ports['http']}={ports['grpc']}"
    assert options["--tokenizer"] == k8s_object("ConfigMap", "prefixcache")["data"]["PREFIXCACHE_MODEL"]
    assert "--auth-token" in options, "the cache sidecars require the token (--auth-token-file)"
    listen_port = int(options["--listen"].rpartition(":")[2])
    assert container["ports"][0]["containerPort"] == listen_port
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": listen_port}
    assert "httpGet" not in container["livenessProbe"], "a fleet that is down must not restart the router"
    front = k8s_object("Service", "prefixcache-router")
    assert front["spec"]["selector"].items() <= router_labels.items()
    assert [p["targetPort"] for p in front["spec"]["ports"]] == [listen_port]


def test_redis_cluster_is_three_masters_with_one_replica_each() -> None:
    statefulset = k8s_object("StatefulSet", "redis-cluster")
    assert statefulset["spec"]["replicas"] == 6
    headless = k8s_object("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    env = {
        e["name"]: e.get("value") for e in pod_containers(k8s_object("Job", "redis-cluster-create"))["create"]["env"]
    }
    name, service = statefulset["metadata"]["name"], headless["metadata"]["name"]
    assert env["REDIS_CLUSTER_NODES"].split() == [f"{name}-{i}.{service}:6379" for i in range(6)]
    assert env["REDIS_CLUSTER_REPLICAS"] == "1"
    conf = k8s_object("ConfigMap", "redis-cluster")["data"]["redis.conf"]
    assert redis_setting(conf, "cluster-enabled") == ["yes"]
    maxmemory = parse_size(redis_setting(conf, "maxmemory")[0].replace("gb", "GiB").replace("mb", "MiB"))
    limit = quantity(pod_containers(statefulset)["redis"]["resources"]["limits"]["memory"])
    assert limit >= 1.5 * maxmemory, "room for fragmentation and buffers beyond maxmemory"


# ---- the real CLI accepts every invocation ----------------------------------------------------


def expand(args: list[str], container: dict) -> list[str]:
    """Kubernetes $(VAR) expansion from the container's env and envFrom ConfigMaps."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(k8s_object("ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            env[item["name"]] = k8s_object("ConfigMap", ref["configMapKeyRef"]["name"])["data"][
                ref["configMapKeyRef"]["key"]
            ]
        elif "secretKeyRef" in ref:
            env[item["name"]] = EXAMPLE_SECRETS[(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])]
        else:
            env[item["name"]] = item["value"]

    def one(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined in container {container['name']}"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


def invocations() -> dict[str, list[str]]:
    """Every `prefixcache` argument vector in the deploy files, by where it is."""
    found = {
        f"compose:{name}": service["command"]
        for name, service in compose()["services"].items()
        if service.get("image", "").startswith("prefixcache")
    }
    cmd = next(json.loads(args) for instr, args in dockerfile() if instr == "CMD")
    found["Dockerfile:CMD"] = cmd
    for workload in ("prefixcache", "prefixcache-router"):
        for name, container in pod_containers(k8s_object("Deployment", workload)).items():
            found[f"k8s:{workload}/{name}"] = expand(container["args"], container)
    return found


def real_parser():
    try:
        cli = __import__("prefixcache_services.cli", fromlist=["build_parser"])
    except ImportError as error:
        pytest.skip(f"prefixcache_services.cli is not importable yet ({error}); the CLI checks need it")
    return cli.build_parser()


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("where", sorted(invocations()))
def test_invocation_is_accepted_by_the_real_cli(where: str) -> None:
    argv = invocations()[where]
    subcommands = subparsers_of(real_parser())
    assert argv[0] in PLANNED_SUBCOMMANDS, f"{where}: unknown subcommand {argv[0]!r}"
    if argv[0] not in subcommands:
        pytest.skip(f"`prefixcache {argv[0]}` is planned but prefixcache_services.cli does not register it yet")
    known = subcommands[argv[0]]._option_string_actions
    unknown = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--") and a.split("=", 1)[0] not in known]
    assert not unknown, f"{where}: `prefixcache {argv[0]}` has no option(s) {unknown}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            real_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: {' '.join(argv)!r} rejected: {stderr.getvalue()}")


# ---- the service starts with the deployed flags and passes the deployed health checks ---------


def joined(argv: list[str]) -> list[str]:
    """`--flag value` pairs as `--flag=value`, asking the real parser which flags take a value."""
    actions, out, rest = subparsers_of(real_parser())[argv[0]]._option_string_actions, [], list(argv[1:])
    while rest:
        arg = rest.pop(0)
        takes_value = arg.startswith("--") and "=" not in arg and actions[arg].nargs != 0
        out.append(f"{arg}={rest.pop(0)}" if takes_value else arg)
    return out


@contextlib.contextmanager
def running_serve(argv: list[str], tmp_path: Path) -> Iterator[int]:
    """`prefixcache serve` with the given flags, on free loopback ports; yields the gRPC port."""
    rewritten, files = (
        [],
        {
            "--auth-token-file": "token",
            "--redis-password-file": "redis-password",
            "--redis-hmac-key-file": "redis-hmac-key",
        },
    )
    for arg in joined(argv):
        flag, _, value = arg.partition("=")
        if flag in files:
            (tmp_path / files[flag]).write_text("0123456789abcdef0123456789abcdef\n")
            value = str(tmp_path / files[flag])
        value = {"--listen": "127.0.0.1:0", "--metrics-port": "0", "--disk-dir": str(tmp_path / "disk")}.get(
            flag, value
        )
        rewritten.append(f"{flag}={value}" if value else flag)
    if not any(a.startswith("--auth-token") for a in rewritten):
        rewritten.append("--auth-token=0123456789abcdef0123456789abcdef")  # health must not need it
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache_services", "serve", *rewritten],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        port, deadline = None, time.monotonic() + DEADLINE_S
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.1)[0]:
                match = re.search(r"listening on \S+:(\d+)", proc.stdout.readline())
                port = int(match.group(1)) if match else None
        assert port, f"serve did not start: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)


def grpc_health_check(command: list[str], port: int) -> int:
    assert command[:2] == ["CMD", "python"], "exec form, with the image's python"
    code = command[3].replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, *command[2:3], code], capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("where", ["compose:cache", "k8s:prefixcache/cache"])
def test_service_starts_with_deployed_flags_and_passes_health_checks(where: str, tmp_path: Path) -> None:
    subparsers_of(real_parser())
    check = compose()["services"]["cache"]["healthcheck"]["test"]
    with running_serve(invocations()[where], tmp_path) as port:
        assert grpc_health_check(check, port) == 0
        if where.startswith("k8s"):  # what the kubelet's gRPC probes ask, without a token
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            cache = pod_containers(k8s_object("Deployment", "prefixcache"))["cache"]
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    request = health_pb2.HealthCheckRequest(service=cache[probe]["grpc"].get("service", ""))
                    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, probe
    assert grpc_health_check(check, port) != 0, "a stopped service must fail the check"


def test_worker_healthcheck_follows_the_http_status() -> None:
    check = compose()["services"]["worker"]["healthcheck"]["test"]
    status = {"code": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status":"ok"}')

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    code = check[3].replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}")
    results = {}
    try:
        for code_ in (200, 503):
            status["code"] = code_
            results[code_] = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode
    finally:
        server.shutdown()
    assert results[200] == 0 and results[503] != 0


# ---- compose ----------------------------------------------------------------------------------


def test_compose_starts_redis_cache_worker_in_health_order() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", "cache", "worker", "router"}
    assert services["router"]["depends_on"] == {"worker": {"condition": "service_healthy"}}
    router = services["router"]["command"]
    worker_port = services["worker"]["command"][services["worker"]["command"].index("--listen") + 1].rpartition(":")[2]
    cache_port = services["cache"]["command"][services["cache"]["command"].index("--listen") + 1].rpartition(":")[2]
    assert router[router.index("--engine") + 1] == f"http://worker:{worker_port}=cache:{cache_port}"
    assert set(services["router"]["networks"]) <= set(services["worker"]["networks"]) & set(
        services["cache"]["networks"]
    )
    assert services["cache"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {"cache": {"condition": "service_healthy"}}
    assert all(s["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL") for s in services.values())
    worker = services["worker"]["command"]
    assert worker[worker.index("--cache") + 1] == "cache:50051"
    cache = services["cache"]["command"]
    assert cache[cache.index("--redis-url") + 1] == "redis://redis:6379/0"
    assert "./redis.conf:/usr/local/etc/redis/redis.conf:ro" in services["redis"]["volumes"]
    assert "ports" not in services["redis"] and compose()["networks"]["backend"]["internal"] is True
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), "loopback only"
    build = services["cache"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


def test_compose_cache_and_worker_mount_one_tmpfs_volume_at_dev_shm() -> None:
    spec = compose()
    mounts = {name: [v.split(":") for v in spec["services"][name]["volumes"]] for name in ("cache", "worker")}
    shm = {name: [src for src, dst, *_ in m if dst == "/dev/shm"] for name, m in mounts.items()}
    assert shm["cache"] == shm["worker"] and len(shm["cache"]) == 1
    volume = spec["volumes"][shm["cache"][0]]
    assert volume["driver_opts"]["type"] == "tmpfs"
    size = dict(o.split("=") for o in volume["driver_opts"]["o"].split(","))["size"]
    cache = spec["services"]["cache"]["command"]
    assert_shm_sized_for(quantity(size), parse_size(cache[cache.index("--host-capacity") + 1]))
    assert_docs_give_shm_size("size=", size)
    assert set(re.findall(r"size=(\w+)", (DEPLOY / "compose.yaml").read_text())) == {size}, "comments agree"
    for name in ("cache", "worker"):  # a private /dev/shm would hide the segment
        assert "shm_size" not in spec["services"][name] and "/dev/shm" not in spec["services"][name].get("tmpfs", [])


def test_the_disk_tier_directory_is_a_persistent_volume_everywhere() -> None:
    """compose: a named volume; k8s: a hostPath on the node; both mounted where --disk-dir points, a
    directory the image creates for its user (a fresh named volume copies its owner)."""
    cache = compose()["services"]["cache"]
    argv = cache["command"]
    directory = argv[argv.index("--disk-dir") + 1]
    parse_size(argv[argv.index("--disk-capacity") + 1])
    assert any(v.split(":")[1] == directory and v.split(":")[0] in compose()["volumes"] for v in cache["volumes"])
    pod = k8s_object("Deployment", "prefixcache")["spec"]["template"]["spec"]
    container = pod_containers(k8s_object("Deployment", "prefixcache"))["cache"]
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--disk"))
    assert args["--disk-dir"] == directory
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "hostPath" in volume or "persistentVolumeClaim" in volume  # not an emptyDir: it survives the pod
    assert f"install -d -o 10001 -g 10001 -m 0700 {directory}" in (DEPLOY / "Dockerfile").read_text()


# ---- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_installs_cpu_torch_first_and_runs_prefixcache_as_non_root() -> None:
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = [args for instr, args in steps if instr == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch_step]
    assert torch_step < next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    user = [args for instr, args in steps if instr == "USER"]
    last_run = max(i for i, (instr, _) in enumerate(steps) if instr == "RUN")
    assert user and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user[-1]), "numeric non-root uid:gid"
    assert max(i for i, (instr, _) in enumerate(steps) if instr == "USER") > last_run
    exposed = {p for instr, args in steps if instr == "EXPOSE" for p in args.split()}
    assert {"50051", "8000", "9400"} <= exposed
    assert [json.loads(a) for i, a in steps if i == "ENTRYPOINT"] == [["prefixcache"]]


def test_dockerignore_excludes_local_state_but_not_the_sources() -> None:
    patterns = [p for p in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    ignored = lambda name: any(fnmatch.fnmatch(name, p.removeprefix("**/")) for p in patterns)  # noqa: E731
    assert all(ignored(name) for name in (".git", ".venv", ".env", "tests"))
    assert not any(ignored(name) for name in ("prefixcache", "services", "proto", "pyproject.toml", "README.md"))


def test_docs_sizing_table_matches_the_kv_layout() -> None:
    from prefixcache.config import DType, KVLayout
    from prefixcache_services.worker.model import tiny_config

    tiny = tiny_config(vocab_size=1000)
    rows = {
        "Llama-3-8B": KVLayout(32, 8, 128, 16, DType.FLOAT16),
        "built-in `tiny`": KVLayout(
            tiny.num_hidden_layers,
            tiny.num_key_value_heads,
            tiny.hidden_size // tiny.num_attention_heads,
            16,
            DType.FLOAT32,
        ),
        "Llama-3-8B, fp8 KV (`float8_e4m3fn`)": KVLayout(32, 8, 128, 16, DType.FLOAT8_E4M3FN),
    }
    labels = {DType.FLOAT16: "fp16", DType.FLOAT32: "float32", DType.FLOAT8_E4M3FN: "fp8"}
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for model, layout in rows.items():
        per_token, block = layout.block_bytes // 16, layout.block_bytes
        expected = (
            f"| {model} | {layout.layers} × {layout.kv_heads} × {layout.head_dim} | "
            f"{labels[layout.dtype]} | {per_token >> 10} KiB | "
            f"{block >> 10 if block < 1 << 20 else block >> 20} {'KiB' if block < 1 << 20 else 'MiB'} | "
            f"{(1 << 30) // block:,} blocks"
        )
        assert expected in doc, expected


# ---- Redis ------------------------------------------------------------------------------------


def acl_rules(text: str) -> list[str]:
    users = [d for d in redis_directives(text) if d[0] == "user" and d[1] == "prefixcache"]
    assert len(users) == 1 and users[0][2] == "off", "example user present and disabled until given a password"
    return users[0][4:] if users[0][3] == "resetpass" else users[0][3:]


def test_redis_conf_is_an_evicting_cache_without_persistence() -> None:
    text = (DEPLOY / "redis.conf").read_text()
    assert redis_setting(text, "maxmemory-policy") == ["allkeys-lru"]
    assert parse_size(redis_setting(text, "maxmemory")[0].replace("gb", "GiB")) > 0
    assert redis_setting(text, "save") == [""] and redis_setting(text, "appendonly") == ["no"]
    assert redis_setting(text, "protected-mode") == ["yes"]
    assert redis_setting(text, "bind") == ["127.0.0.1", "-::1"]


def test_acl_rules_and_key_prefix_agree_everywhere() -> None:
    rules = acl_rules((DEPLOY / "redis.conf").read_text())
    assert rules == k8s_object("ConfigMap", "redis-cluster")["data"]["prefixcache.acl"].split()
    cache = compose()["services"]["cache"]["command"]
    prefixes = {
        cache[cache.index("--redis-key-prefix") + 1],
        k8s_object("ConfigMap", "prefixcache")["data"]["PREFIXCACHE_REDIS_KEY_PREFIX"],
    }
    assert [f"~{p}:*" for p in prefixes] == [r for r in rules if r.startswith("~")]


@contextlib.contextmanager
def redis_process(argv: list[str], port: int, cwd: Path, env: dict | None = None, **auth) -> Iterator[redis.Redis]:
    log = cwd / "redis.log"
    proc = subprocess.Popen(
        [*argv, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no", "--logfile", str(log)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, **auth)

    def ready() -> bool:
        assert proc.poll() is None, f"redis-server exited: {log.read_text() if log.exists() else ''}"
        with contextlib.suppress(redis.ConnectionError):
            return client.ping()

    try:
        assert poll(ready, DEADLINE_S, 0.02), f"redis on {port} not ready"
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)


def exercise_tier(url: str, password: str) -> None:
    """The real RedisTier, as the ACL user: write, read, delete a namespace, flush."""
    from prefixcache.tiers.redis import RedisOptions, RedisTier

    options = RedisOptions(
        url=url, key_prefix="pfx", ttl_s=60, password=password, socket_timeout_s=1.0, write_timeout_s=1.0
    )
    hashes = [i.to_bytes(16, "big") for i in range(1, 40)]
    with RedisTier(options) as tier:
        assert poll(tier.is_up, DEADLINE_S, 0.02), "tier never connected"
        assert all(tier.submit("ns1", h, b"frame" + h) for h in hashes[:30])
        assert all(tier.submit("ns2", h, b"other" + h) for h in hashes[30:])
        assert tier.wait_idle(DEADLINE_S)
        assert tier.fetch("ns1", hashes[:30]) == [b"frame" + h for h in hashes[:30]]
        tier.delete_namespace("ns1")
        assert tier.wait_idle(DEADLINE_S)
        assert tier.fetch("ns1", hashes[:3]) == [None] * 3 and tier.fetch("ns2", hashes[30:31]) != [None]
        tier.flush()
        assert tier.wait_idle(DEADLINE_S)
        assert tier.fetch("ns2", hashes[30:]) == [None] * 9
        stats = tier.stats()
    assert (stats.writes_failed, stats.read_errors) == (0, 0), stats


def test_redis_conf_runs_the_tier_as_the_acl_user_and_evicts_when_full(tmp_path: Path) -> None:
    port, password = free_port(), "5f1c" * 8
    with redis_process(["redis-server", str(DEPLOY / "redis.conf")], port, tmp_path) as admin:
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert admin.config_get("save") == {"save": ""} and admin.config_get("appendonly") == {"appendonly": "no"}
        admin.execute_command("ACL", "SETUSER", "prefixcache", "on", f">{password}")  # as docs/deploy.md says
        exercise_tier(f"redis://prefixcache@127.0.0.1:{port}/0", password)
        with redis.Redis(port=port, username="prefixcache", password=password) as user:
            for denied in (
                lambda: user.set("other:1", b"x"),
                user.flushall,
                lambda: user.keys("*"),
                lambda: user.config_get("*"),
                user.info,
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    denied()
            admin.config_set("maxmemory", "4mb")
            for i in range(64):  # 16 MiB into a 4 MiB Redis: never an OOM error
                user.psetex(f"pfx:ns:{i}", 60_000, os.urandom(256 << 10))
                user.pexpire(f"pfx:ns:{i}", 120_000, gt=True)  # a hit's TTL refresh, pins, hints
        assert 0 < admin.dbsize() < 64 and admin.info("stats")["evicted_keys"] > 0


def test_k8s_redis_cluster_scripts_form_a_cluster_the_tier_can_use(tmp_path: Path) -> None:
    data = k8s_object("ConfigMap", "redis-cluster")["data"]
    (tmp_path / "conf").mkdir()
    for name, text in data.items():
        (tmp_path / "conf" / name).write_text(text)
    env = {
        "REDIS_ADMIN_PASSWORD": "a1" * 20,
        "REDIS_PREFIXCACHE_PASSWORD": "b2" * 20,
        "REDIS_CONF_DIR": str(tmp_path / "conf"),
    }
    ports = [free_port(cluster_bus=True) for _ in range(6)]
    with contextlib.ExitStack() as stack:
        nodes = []
        for port in ports:
            (tmp_path / str(port)).mkdir()
            node_env = {**env, "REDIS_RUN_DIR": str(tmp_path / str(port))}
            nodes.append(
                stack.enter_context(
                    redis_process(
                        ["sh", str(tmp_path / "conf" / "start.sh")],
                        port,
                        tmp_path / str(port),
                        node_env,
                        username="admin",
                        password=env["REDIS_ADMIN_PASSWORD"],
                    )
                )
            )
        create = {**os.environ, **env, "REDIS_CLUSTER_NODES": " ".join(f"127.0.0.1:{p}" for p in ports)}
        for _attempt in ("create", "again"):  # the second run must find the cluster formed
            done = subprocess.run(
                ["sh", str(tmp_path / "conf" / "create-cluster.sh")],
                env=create,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        assert "already formed" in done.stdout
        roles = [n.info("replication") for n in nodes]
        assert sorted(r["role"] for r in roles) == ["master"] * 3 + ["slave"] * 3
        replicas = [n for n, r in zip(nodes, roles) if r["role"] == "slave"]
        synced = lambda: all(n.info("replication")["master_link_status"] == "up" for n in replicas)  # noqa: E731
        assert poll(synced, DEADLINE_S, 0.02), "replicas never synced: masteruser/masterauth"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=ports[0]).ping()  # default user is off
        exercise_tier(f"redis+cluster://prefixcache@127.0.0.1:{ports[0]}", env["REDIS_PREFIXCACHE_PASSWORD"])
