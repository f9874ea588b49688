"""A client whose service restarted never reads or writes the old shared memory as the new one's.

Namespace ids are derived from the model and layout, so after a restart on the same port any
client's Attach recreates the same id and an old client's next Reserve or Lookup succeeds
against the new service. Its mapping is still the old segment (the new service made a new
file, under the same name when `--shm-name` is pinned): copying into it would publish bytes the
new service never received, and reading it would return the old service's bytes for the new
service's slots. The client checks the mapping before it trusts a slot (`MappedSegment.current`)
and fails with CacheUnavailable instead, so its caller re-attaches.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.client import CacheClient
from prefixcache.client.errors import CacheUnavailable
from prefixcache.config import KVLayout
from tests.support.worker_procs import CacheService

pytestmark = pytest.mark.process

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")


def _kv(blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, *LAYOUT.block_shape), generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("pinned_name", [True, False])
def test_a_stale_mapping_is_never_read_or_written_after_a_restart(tmp_path, pinned_name: bool) -> None:
    name = "pfx-test-pinned-restart" if pinned_name else None
    service = CacheService(tmp_path / "s", extra_args=["--block-size", "16"], fixed_shm_name=name).start()
    old = CacheClient(service.address)
    new = CacheClient(service.address)
    try:
        old.attach("m", LAYOUT, "r1", same_host=True)
        assert old.attachment.shared_memory
        first = list(range(1, 33))
        old.store(first, _kv(2, 1))
        service.restart()
        new.attach("m", LAYOUT, "r1", same_host=True)  # the same namespace id, on the new service
        assert new.attachment.namespace_id == old.attachment.namespace_id
        second = list(range(100, 132))
        with pytest.raises(CacheUnavailable, match="shared memory was replaced"):
            old.store(second, _kv(2, 2))
        assert new.lookup(second, take_lease=False).hit_tokens == 0  # nothing was published
        third = list(range(200, 232))
        kv = _kv(2, 3)
        new.store(third, kv)
        hit = old.lookup(third)
        assert hit.hit_tokens == 32
        with pytest.raises(CacheUnavailable, match="shared memory was replaced"):
            old.read(hit)
        fresh = new.lookup(third)
        assert torch.equal(new.read(fresh), kv)  # the new client reads the new segment's bytes
        new.release(fresh)
    finally:
        old.close()
        new.close()
        service.stop()
