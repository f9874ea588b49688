"""Redis write errors never switch Redis reads off, and never put Redis bytes in the log (issue 15.5, 15.6).

A real service over a real redis-server. Prompts are written through to Redis, then Redis is
filled (`maxmemory 1`, `maxmemory-policy noeviction`): every write is refused with OOM while
reads still work. In a tight loop the service stores new prompts (three refused writes in a row,
more than the breaker's threshold) and looks up
prompts that only Redis holds (its host tier holds four blocks): every lookup must be served,
none skipped, and the stats must say that writes are down and reads up. The log is captured:
it names the error kind and a key's prefix only, never the command, a full key or payload bytes.
"""

from __future__ import annotations

import logging

import pytest

from prefixcache.client import CacheClient
from tests.support.isolation import serve
from tests.support.poll import poll
from tests.support.service import layout_of, prompt, random_kv

pytestmark = [pytest.mark.redis, pytest.mark.process]

pytest_plugins = ["tests.support.redis_server"]
BLOCK_BYTES = layout_of().block_bytes  # 3840


def test_full_redis_refuses_writes_but_lookups_keep_hitting_redis(private_redis, caplog):
    layout = layout_of()
    prompts = [prompt(2, start=1000 * (i + 1)) for i in range(6)]
    caplog.set_level(logging.DEBUG, logger="prefixcache")
    with (
        serve(
            "--block-size",
            "16",
            "--host-capacity",
            str(4 * BLOCK_BYTES),
            "--redis-url",
            private_redis.url,
            "--redis-key-prefix",
            "health",
            "--redis-timeout-ms",
            "2000",
        ) as server,
        CacheClient(server.address, timeout_s=20) as client,
    ):
        client.attach("m", layout)
        for i, tokens in enumerate(prompts):
            assert client.store(tokens, random_kv(2, layout, seed=i)).stored == 2
        raw = private_redis.client()
        assert poll(lambda: len(raw.keys("health:*")) >= 12, 10)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", "1")
        served = 0
        remote_tier = server.backend.cache.remote_link.tier
        for j in range(60):
            for k in range(3):  # refused writes, each its own batch, more in a row than the breaker allows
                client.store(prompt(2, start=100_000 + 1000 * (3 * j + k)), random_kv(2, layout, seed=j))
                assert remote_tier.wait_idle(5)
            hit = client.lookup(prompts[j % 4], take_lease=False)  # pushed out of the host tier: Redis only
            served += hit.hit_tokens == 32
        remote = client.stats().snapshot.remote
    assert served == 60, served
    assert remote["reads_up"] == 1 and remote["writes_up"] == 0, remote
    assert remote["reads_skipped"] == 0 and remote["writes_failed"] >= 3 and remote["hits"] >= 120, remote
    messages = [record.getMessage() for record in caplog.records]
    down = [m for m in messages if "writes" not in m and "is down" in m]
    assert not down, down  # the link (reads) never went down
    assert any("is down" in m and "OutOfMemoryError OOM" in m for m in messages), messages
    for message in messages:
        assert "\x00" not in message and "SET" not in message and "maxmemory" not in message, message
        assert not any(
            len(word) >= 32 and all(c in "0123456789abcdef" for c in word) for word in message.replace(":", " ").split()
        ), message  # no whole block hash
