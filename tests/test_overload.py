"""Overload (issue 15.4): past --max-concurrent-rpcs new work is refused with RESOURCE_EXHAUSTED
and a retry hint, while health checks and Release are never refused for load.

A real server with `max_concurrent_rpcs=16` is held full by 16 Fetch streams nobody reads
(each holds a stream thread, so the load is exact, not a timing guess); then 64 clients at
once send a Lookup, a health Check and a Release each, and the test checks every answer.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixcache.client.errors import RETRY_METADATA, retry_after_s
from prefixcache.rpc import cache_pb2 as pb
from prefixcache.rpc import cache_pb2_grpc as pb_grpc
from prefixcache_services.cache_server.servicer import SERVICE_NAME
from tests.support.poll import poll
from tests.support.service import CODE, layout_of, prompt, random_kv, running_servers

pytestmark = pytest.mark.process

LIMIT, CLIENTS = 16, 64


def test_health_and_release_are_never_refused_while_new_work_is():
    layout = layout_of()
    with running_servers() as start:
        server = start(host_capacity=64 << 20, workers=1, stream_workers=LIMIT + 4, max_concurrent_rpcs=LIMIT)
        client = start.client(server)
        client.attach("m", layout)
        tokens = prompt(4096)
        client.store(tokens, random_kv(4096, layout, seed=5))  # 15 MiB: a Fetch outruns any window
        ns = client.attachment.namespace_id
        stream_leases = [client.lookup(tokens) for _ in range(LIMIT)]
        leases = [client.lookup(tokens) for _ in range(CLIENTS)]
        channel = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
        streams = [
            channel.unary_stream(f"/{SERVICE_NAME}/Fetch")(
                pb.FetchRequest(lease_id=hit.lease_id, max_chunk_bytes=1 << 20).SerializeToString(), timeout=60
            )
            for hit in stream_leases
        ]
        for stream in streams:
            next(stream)  # started: each now holds a stream thread, the rest is never read
        assert poll(lambda: server.admission.held() >= LIMIT, 10)
        barrier = threading.Barrier(CLIENTS)

        def one_client(i: int) -> tuple:
            with grpc.insecure_channel(server.address) as own:
                stub = pb_grpc.PrefixCacheStub(own)
                barrier.wait(20)
                try:
                    stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens, take_lease=False), timeout=20)
                    looked = (CODE.OK, None)
                except grpc.RpcError as error:
                    hint = dict(error.trailing_metadata() or ()).get(RETRY_METADATA)
                    assert retry_after_s(error) == int(hint) / 1000  # what CacheClient.release waits
                    looked = (error.code(), hint)
                health = health_pb2_grpc.HealthStub(own).Check(health_pb2.HealthCheckRequest(), timeout=20)
                stub.Release(pb.ReleaseRequest(lease_id=leases[i].lease_id), timeout=20)
                return looked, health.status

        with futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(one_client, range(CLIENTS)))  # a refused Release or Check raises here
        assert all(status == health_pb2.HealthCheckResponse.SERVING for _, status in answers)
        refused = [hint for (code, hint), _ in answers if code is CODE.RESOURCE_EXHAUSTED]
        assert len(refused) == CLIENTS, answers  # the streams hold every slot: all new work is refused
        assert all(hint is not None and int(hint) > 0 for hint in refused)
        assert server.backend.stats().active_leases == LIMIT  # every Release landed: the streams' leases remain
        for stream in streams:
            stream.cancel()
        assert poll(lambda: server.admission.held() == 0, 10)
        assert client.lookup(tokens, take_lease=False).hit_tokens == 4096 * 16  # admitted again
        channel.close()
