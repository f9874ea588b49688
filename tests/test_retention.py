"""Retention hints and pin priorities as callers give them (prefixcache/retention.py): OpenAI's
`prompt_cache_retention` values, vLLM's `kv_transfer_params`, and errors that name the field."""

from __future__ import annotations

import pytest

from prefixcache.config import TenantQuota
from prefixcache.errors import InvalidArgument
from prefixcache.retention import StoreHints, check_priority, parse_retention, store_hints


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, None), ("in_memory", None), ("24h", 86_400.0), ("30m", 1800.0), (90, 90.0)]
)
def test_openais_retention_values_and_durations_are_seconds(value, seconds) -> None:
    assert parse_retention(value) == seconds


@pytest.mark.parametrize("value", ["forever", "-1h", "", True, [1], float("inf"), -5])
def test_a_bad_retention_names_its_field(value) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_retention(value)
    assert caught.value.field == "prompt_cache_retention"


def test_kv_transfer_params_carry_the_hints_and_leave_other_keys_alone() -> None:
    params = {"prompt_cache_retention": "2h", "prompt_cache_max_tokens": 4096, "do_remote_prefill": True}
    assert store_hints(params) == StoreHints(7200.0, 4096)
    assert store_hints(None) == store_hints({}) == StoreHints()
    for bad, field in (
        ({"prompt_cache_max_tokens": -1}, "prompt_cache_max_tokens"),
        ({"prompt_cache_max_tokens": "10"}, "prompt_cache_max_tokens"),
        ({"prompt_cache_retention": "soon"}, "prompt_cache_retention"),
        ("24h", "kv_transfer_params"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            store_hints(bad)
        assert caught.value.field == field


def test_pin_priorities_are_0_to_100() -> None:
    assert [check_priority(p) for p in (0, 55, 100)] == [0, 55, 100]
    for bad in (-1, 101, 1.0, True, "5"):
        with pytest.raises(InvalidArgument) as caught:
            check_priority(bad)
        assert caught.value.field == "priority"


def test_a_quota_spec_bounds_retention_and_names_a_bad_one() -> None:
    quota = TenantQuota.parse("host=1GiB,retention=24h")
    assert (quota.host, quota.retention, quota.limited) == (1 << 30, 86_400.0, True)
    assert TenantQuota.parse("retention=1h").limited is False  # a retention bound counts no bytes
    assert TenantQuota().retention == 0.0  # by default hints keep nothing past the TTLs
    with pytest.raises(InvalidArgument) as caught:
        TenantQuota.parse("retention=someday")
    assert caught.value.field == "tenant_quota.retention"
