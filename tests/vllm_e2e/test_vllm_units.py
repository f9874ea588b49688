"""The connector's pure parts, in the vLLM environment: extra-config validation, the namespace,
and the paged-KV views checked against the very reinterpretations vLLM's backends apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefixcache.config import DType, KVLayout
from prefixcache.errors import ConfigError
from prefixcache.integrations.vllm.config import (
    ConnectorSettings,
    check_layer_scales,
    kv_dtype_of,
    kv_scale_of,
    weights_digest,
)
from prefixcache.integrations.vllm.layers import LayerLoads, layer_by_layer
from prefixcache.integrations.vllm.paged import (
    KVPacking,
    PagedCache,
    PagedLayer,
    packing_of_backend,
)

pytestmark = pytest.mark.unit

H, N, D, BLOCKS, LAYERS = 2, 32, 16, 9, 3


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({}, "cache"),
        ({"cache": "nohost"}, "cache"),
        ({"cache": "h:1", "hit_policy": "sometimes"}, "hit_policy"),
        ({"cache": "h:1", "timeout_s": 0}, "timeout_s"),
        ({"cache": "h:1", "timeout_s": "1"}, "timeout_s"),
        ({"cache": "h:1", "lookup_timeout_s": -1}, "lookup_timeout_s"),
        ({"cache": "h:1", "cachesalt": "x"}, "cachesalt"),
        ({"cache": "h:1", "auth_token": "a", "auth_token_file": "/x"}, "auth_token_file"),
        ({"cache": "h:1", "auth_token_file": "/nonexistent/token"}, "auth_token_file"),
        ({"cache": "h:1", "cache_salt_source": "config"}, "cache_salt"),
        ({"cache": "h:1", "same_host": "yes"}, "same_host"),
        ({"cache": "h:1", "weights_digest": "md5"}, "weights_digest"),
        ({"cache": "h:1", "layer_loads": True}, "layer_loads"),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.parse(extra)
    assert error.value.field == field


def test_token_file_and_salt_sources(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    settings = ConnectorSettings.parse({"cache": "h:1", "auth_token_file": str(tmp_path / "token")})
    assert settings.auth_token == "s3cret" and settings.salt_for("tenant-a") == "tenant-a"
    assert settings.salt_for(None) is None
    fixed = ConnectorSettings.parse({"cache": "h:1", "cache_salt": "team", "cache_salt_source": "config"})
    assert fixed.salt_for("tenant-a") == "team"
    assert ConnectorSettings.parse({"cache": "h:1", "cache_salt_source": "none"}).salt_for("tenant-a") is None


def test_kv_dtype_follows_vllm_cache_dtype() -> None:
    assert kv_dtype_of("auto", torch.bfloat16).value == "bfloat16"
    assert kv_dtype_of("auto", torch.float16).value == "float16"
    with pytest.raises(ConfigError) as error:
        kv_dtype_of("turboquant", torch.bfloat16)
    assert error.value.field == "cache_dtype"


def test_fp8_cache_dtypes_and_their_scale_source_split_the_namespace() -> None:
    from vllm.config import CacheConfig

    assert kv_dtype_of("fp8", torch.bfloat16) is DType.FLOAT8_E4M3FN
    assert kv_dtype_of("fp8_e4m3", torch.bfloat16) is DType.FLOAT8_E4M3FN
    assert kv_dtype_of("fp8_e5m2", torch.bfloat16) is DType.FLOAT8_E5M2

    def config(cache_dtype: str, quantization: str | None = None, scheme: dict | None = None, skip=()):
        hf = SimpleNamespace(quantization_config={"kv_cache_scheme": scheme} if quantization else None)
        return SimpleNamespace(
            cache_config=CacheConfig(cache_dtype=cache_dtype, kv_cache_dtype_skip_layers=list(skip)),
            model_config=SimpleNamespace(quantization=quantization, hf_config=hf),
        )

    assert kv_scale_of(config("auto")) == ""
    unit = kv_scale_of(config("fp8"))
    assert unit == "scales=unit"
    assert {kv_scale_of(config(d)) for d in ("fp8", "fp8_e4m3", "fp8_e5m2")} == {unit}  # the dtype splits e5m2
    static = kv_scale_of(config("fp8", "compressed-tensors", {"num_bits": 8, "strategy": "tensor"}))
    head = kv_scale_of(config("fp8", "compressed-tensors", {"num_bits": 8, "strategy": "attn_head"}))
    assert len({unit, static, head}) == 3 and static.startswith("scales=checkpoint:compressed-tensors:")
    with pytest.raises(ConfigError) as error:
        kv_scale_of(config("fp8", skip=["0"]))
    assert error.value.field == "kv_cache_dtype_skip_layers"
    check_layer_scales(unit, {"l0": (1.0, 1.0)})
    check_layer_scales(static, {"l0": (0.02, 0.5)})  # checkpoint scales: covered by the weights digest
    with pytest.raises(ConfigError) as error:
        check_layer_scales(unit, {"l0": (1.0, 1.0), "l1": (0.5, 1.0)})
    assert error.value.field == "kv_scale" and "l1" in str(error.value)


@pytest.mark.parametrize("dtype", [DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2])
def test_fp8_held_as_uint8_round_trips_byte_for_byte(dtype: DType) -> None:
    # vLLM allocates an fp8 cache as uint8; blocks leave and enter it as the namespace's float8 type.
    storage = torch.randint(0, 256, (BLOCKS, H, N, 2 * D), dtype=torch.uint8)
    paged = PagedCache(
        [PagedLayer.of(storage[:, :, :, :].clone(), KVPacking.TOKEN_STACKED, D) for _ in range(LAYERS)], dtype.torch
    )
    blocks = paged.gather(((4, 1),))
    assert blocks.dtype == dtype.torch
    other = PagedCache(
        [PagedLayer.of(torch.zeros_like(storage), KVPacking.TOKEN_STACKED, D) for _ in range(LAYERS)], dtype.torch
    )
    other.load(blocks, ((3, 7),))
    for a, b in zip(paged.layers, other.layers, strict=True):
        assert torch.equal(a.keys[[4, 1]], b.keys[[3, 7]]) and torch.equal(a.values[[4, 1]], b.values[[3, 7]])
    assert torch.equal(other.gather(((3, 7),)).view(torch.uint8), blocks.view(torch.uint8))  # no conversion
    with pytest.raises(ConfigError) as error:
        PagedCache(paged.layers, torch.bfloat16)
    assert error.value.field == "cache_dtype"


def test_weights_digest_changes_with_the_weights_not_the_path(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(bytes(range(256)) * 20000)  # > 3 MiB: sampled
    assert weights_digest(str(tmp_path / "a")) == weights_digest(str(tmp_path / "b")) != ""
    data = bytearray((tmp_path / "b" / "model.safetensors").read_bytes())
    data[10] ^= 1
    (tmp_path / "b" / "model.safetensors").write_bytes(bytes(data))
    assert weights_digest(str(tmp_path / "a")) != weights_digest(str(tmp_path / "b"))
    assert weights_digest(str(tmp_path / "a"), "full") != weights_digest(str(tmp_path / "a"))
    assert weights_digest("org/model-on-a-hub") == ""


def _vllm_cpu_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_attn.py: view [B, H, N, 2D] as [B, H, 2N, D], chunk dim 2."""
    blocks, heads, n, _ = t.shape
    return t.view((blocks, heads, n * 2, -1)).chunk(2, dim=2)


def _vllm_flash_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn.py: transpose(1, 2) then split the last axis; returned as [B, H, N, D]."""
    k, v = t.transpose(1, 2).split(D, dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


def _paged(packing: KVPacking, physical_nhd: bool) -> list[torch.Tensor]:
    layers = []
    for _ in range(LAYERS):
        if physical_nhd:  # NHD: memory [B, N, H, 2D], logical [B, H, N, 2D] by strides
            layers.append(torch.zeros(BLOCKS, N, H, 2 * D, dtype=torch.bfloat16).transpose(1, 2))
        else:
            layers.append(torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16))
    return layers


@pytest.mark.parametrize(
    ("packing", "nhd", "views"),
    [
        (KVPacking.TOKEN_STACKED, False, _vllm_cpu_views),
        (KVPacking.CONTENT_SPLIT, False, _vllm_flash_views),  # HND
        (KVPacking.CONTENT_SPLIT, True, _vllm_flash_views),  # NHD
    ],
)
def test_a_loaded_block_is_what_the_backend_reads_and_gathers_back_bit_exact(packing, nhd, views) -> None:
    layout = KVLayout(layers=LAYERS, kv_heads=H, head_dim=D, block_size=N, dtype="bfloat16")
    tensors = _paged(packing, nhd)
    cache = PagedCache([PagedLayer.of(t, packing, D) for t in tensors])
    blocks = torch.randn(2, *layout.block_shape).to(torch.bfloat16)
    assert cache.load(blocks, ((5, 2),)) == 2 * LAYERS
    for number, t in enumerate(tensors):
        keys, values = views(t)
        for i, block_id in enumerate([5, 2]):
            assert torch.equal(keys[block_id], blocks[i, number, 0])
            assert torch.equal(values[block_id], blocks[i, number, 1])
        untouched = [b for b in range(BLOCKS) if b not in (5, 2)]
        assert not keys[untouched].any() and not values[untouched].any()
    assert torch.equal(cache.gather(((2, 5),)), blocks.flip(0))


@pytest.mark.parametrize(
    ("head_dim", "dtype", "copy_type"),
    [(8, torch.bfloat16, torch.int64), (6, torch.bfloat16, torch.int32), (3, torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize("packing", [KVPacking.TOKEN_STACKED, KVPacking.CONTENT_SPLIT])
def test_copies_move_the_same_bytes_as_the_widest_elements_the_rows_allow(head_dim, dtype, copy_type, packing) -> None:
    """A 16-byte row moves as int64, a 12-byte one as int32, a 6-byte one as itself; the bytes
    that land and come back are the same in every case (and blocks handed over as a strided view
    still land, widened or, when their rows are not contiguous, as their own elements)."""
    layout = KVLayout(layers=LAYERS, kv_heads=H, head_dim=head_dim, block_size=N, dtype="bfloat16")
    tensors = [torch.zeros(BLOCKS, H, N, 2 * head_dim, dtype=dtype) for _ in range(LAYERS)]
    cache = PagedCache([PagedLayer.of(t, packing, head_dim) for t in tensors])
    assert cache._copy_type == copy_type
    blocks = torch.randn(3, *layout.block_shape).to(dtype)
    assert cache.load(blocks, ((4, 1, 6),)) == 3 * LAYERS
    assert torch.equal(cache.gather(((4, 1, 6),)), blocks)
    strided = torch.randn(3, *layout.block_shape[:-1], 2 * head_dim).to(dtype)[..., :head_dim]
    cache.load(strided, ((2, 3, 5),))
    assert torch.equal(cache.gather(((2, 3, 5),)), strided)
    interleaved = torch.randn(3, *layout.block_shape, 2).to(dtype)[..., 0]  # rows of stride 2: not widened
    cache.load(interleaved, ((7, 8, 2),))
    assert torch.equal(cache.gather(((7, 8, 2),)), interleaved)


def test_a_save_copies_its_blocks_out_before_vllm_can_reuse_them() -> None:
    """What `gather_later` hands the save thread is a copy of the blocks as they were when the
    step queued the save, never a view of vLLM's tensors: a block vLLM frees and reuses after
    that step does not change it (on CUDA the copy is ordered on vLLM's stream; here it is
    made at once)."""
    layout = KVLayout(layers=LAYERS, kv_heads=H, head_dim=D, block_size=N, dtype="bfloat16")
    tensors = _paged(KVPacking.TOKEN_STACKED, False)
    cache = PagedCache([PagedLayer.of(t, KVPacking.TOKEN_STACKED, D) for t in tensors])
    blocks = torch.randn(2, *layout.block_shape).to(torch.bfloat16)
    cache.load(blocks, ((5, 2),))
    copy = cache.gather_later(((5, 2),))
    for tensor in tensors:
        tensor.fill_(7)  # the next steps reuse both blocks
    assert torch.equal(copy.wait(), blocks)


def test_hybrid_groups_load_only_the_blocks_vllm_allocated_and_gather_per_group() -> None:
    # Layer 0 in a sliding-window group (vLLM's null block 0 before the window), layer 1 full.
    layout = KVLayout(layers=2, kv_heads=H, head_dim=D, block_size=N, dtype="bfloat16")
    tensors = [torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(2)]
    cache = PagedCache([PagedLayer.of(t, KVPacking.TOKEN_STACKED, D, group) for group, t in enumerate(tensors)])
    blocks = torch.randn(3, *layout.block_shape).to(torch.bfloat16)
    ids = ((0, 0, 6), (1, 2, 3))  # sliding group: only the last block is in the window
    assert cache.load(blocks, ids) == 1 + 3
    keys, _ = _vllm_cpu_views(tensors[0])
    assert torch.equal(keys[6], blocks[2, 0, 0]) and not keys[[1, 2, 3, 4, 5, 7]].any()
    keys, values = _vllm_cpu_views(tensors[1])
    for i, block_id in enumerate((1, 2, 3)):
        assert torch.equal(keys[block_id], blocks[i, 1, 0]) and torch.equal(values[block_id], blocks[i, 1, 1])
    gathered = cache.gather(((6,), (3,)))
    assert torch.equal(gathered[0], blocks[2])
    with pytest.raises(ValueError, match="group 0"):
        cache.gather(ids)  # a freed (null) block is never read as KV


@pytest.mark.parametrize("cuda_shape", [False, True])
def test_mla_latent_rows_are_stored_as_two_halves_bit_exact(cuda_shape: bool) -> None:
    # CPU_MLA: [blocks, 1, N, 576]; the CUDA MLA backends: [blocks, N, 576]. One latent row per token.
    width = 576
    storage = torch.randn(BLOCKS, N, width).to(torch.bfloat16)
    tensor = storage if cuda_shape else storage.unsqueeze(1)
    cache = PagedCache([PagedLayer.of(tensor, KVPacking.LATENT, width // 2)])
    blocks = cache.gather(((3, 5),))
    assert blocks.shape == (2, 1, 2, 1, N, width // 2)
    assert torch.equal(torch.cat([blocks[0, 0, 0, 0], blocks[0, 0, 1, 0]], dim=-1), storage[3])
    target = torch.zeros_like(storage)
    PagedCache([PagedLayer.of(target if cuda_shape else target.unsqueeze(1), KVPacking.LATENT, width // 2)]).load(
        blocks, ((1, 2),)
    )
    assert torch.equal(target[1], storage[3]) and torch.equal(target[2], storage[5]) and not target[3:].any()


def test_backends_the_connector_cannot_copy_fail_by_name() -> None:
    assert packing_of_backend("CPU_ATTN") is KVPacking.TOKEN_STACKED
    assert packing_of_backend("FLASHINFER") is KVPacking.CONTENT_SPLIT
    assert packing_of_backend("CPU_MLA") is KVPacking.LATENT
    assert packing_of_backend("FLASHMLA") is KVPacking.LATENT
    with pytest.raises(ConfigError) as error:
        packing_of_backend("TURBOQUANT_ATTN")
    assert error.value.field == "attention_backend"


def test_the_library_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, prefixcache, prefixcache.client, prefixcache.integrations; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120, check=False).returncode == 0


def _kv_cache_config(*groups: tuple[list[str], object]) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups]
    )


def test_groups_of_a_hybrid_sliding_window_model_share_one_layout_in_model_order() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from prefixcache.integrations.vllm.groups import KVGroups

    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = _kv_cache_config(
        (["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], sliding),
        (["model.layers.1.self_attn.attn", "model.layers.10.self_attn.attn"], full),
    )
    groups = KVGroups.of(config, "Gemma3ForCausalLM")
    assert groups.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10))
    assert groups.layer_groups == (0, 1, 0, 1) and groups.block_size == 32 and not groups.has_state
    assert groups.kinds == ("sliding_window(64)", "full") and (groups.kv_heads, groups.head_size) == (2, 64)
    short = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="group 1 has 16-token blocks, group 0 has 32") as error:
        KVGroups.of(_kv_cache_config((["model.layers.0.a"], sliding), (["model.layers.1.a"], short)), "Gemma3")
    assert error.value.field == "kv_cache_groups"


def _mamba(mode: str = "align", speculative: int = 0) -> object:
    from vllm.v1.kv_cache_interface import MambaSpec

    # conv [768 x 3] bf16 + ssm [4 x 64 x 64] fp32, padded to a 256-token bf16 attention page of 2 x 64 heads
    return MambaSpec(
        block_size=256,
        shapes=((768, 3), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=2 * 256 * 2 * 64 * 2,
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative,
    )


def test_groups_of_a_hybrid_state_model_put_state_pages_in_attention_slots() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixcache.integrations.vllm.groups import KVGroups

    full = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = _kv_cache_config(
        (["model.layers.3.self_attn.attn"], full),
        (["model.layers.0.linear_attn"], _mamba()),
        (["model.layers.1.linear_attn"], _mamba()),
    )
    groups = KVGroups.of(config, "Qwen3NextForCausalLM")
    assert groups.layer_names == ("model.layers.3.self_attn.attn",) and groups.layer_groups == (0,)
    assert groups.state_names == ("model.layers.0.linear_attn", "model.layers.1.linear_attn")
    assert groups.state_groups == (1, 2) and groups.has_state and groups.page_bytes == 2 * 256 * 2 * 64 * 2
    assert groups.state_kind.startswith("state-") and "768x3+4x64x64-bfloat16+float32" in groups.state_kind
    assert "x1" in groups.describe() and groups.describe().count("state-") == 2
    for spec, field, words in (
        (_mamba("none"), "mamba_cache_mode", "enable_prefix_caching=True"),
        (_mamba(speculative=1), "num_speculative_blocks", "speculative decoding"),
    ):
        with pytest.raises(ConfigError) as error:
            KVGroups.of(
                _kv_cache_config((["model.layers.3.self_attn.attn"], full), (["model.layers.0.linear_attn"], spec)),
                "Qwen3NextForCausalLM",
            )
        assert error.value.field == field and "Qwen3NextForCausalLM" in str(error.value) and words in str(error.value)
    small = FullAttentionSpec(block_size=256, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="pages, the attention layers"):
        KVGroups.of(
            _kv_cache_config((["model.layers.3.a"], small), (["model.layers.0.linear_attn"], _mamba())),
            "Qwen3NextForCausalLM",
        )


def test_state_pages_round_trip_bytes_where_vllm_places_them() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from prefixcache.integrations.vllm.paged import StatePages

    page, blocks = 64, 6
    # two state layers sharing one allocation block-outermost (layer_stride one page, block_stride two), at an offset
    tensor = KVCacheTensor(
        size=16 + blocks * 2 * page, layers=["l.0.s", "l.1.s"], layer_stride=page, block_stride=2 * page, offset=16
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.bfloat16)  # a 64-byte page
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(["l.0.s"], spec), KVCacheGroupSpec(["l.1.s"], spec)],
    )
    raw = torch.arange(tensor.size, dtype=torch.int16).to(torch.int8)
    pages = StatePages.of({"l.0.s": raw, "l.1.s": raw[5:]}, config, ["l.0.s", "l.1.s"], [0, 1])
    got = pages.gather({0: 2, 1: 4})
    assert torch.equal(got[0, 0], raw[16 + 2 * 2 * page :][:page].view(torch.uint8))
    assert torch.equal(got[0, 1], raw[16 + page + 4 * 2 * page :][:page].view(torch.uint8))
    before = raw.clone()
    pages.load(got.view(torch.bfloat16), {0: 5, 1: 1})  # any dtype: its bytes
    assert torch.equal(raw[16 + 5 * 2 * page :][:page], before[16 + 2 * 2 * page :][:page])
    assert torch.equal(raw[16 + page + 1 * 2 * page :][:page], before[16 + page + 4 * 2 * page :][:page])
    changed = (raw != before).nonzero().flatten()
    assert changed.numel() and all(
        16 + 5 * 2 * page <= i < 16 + 5 * 2 * page + page or 16 + page + 2 * page <= i < 16 + page + 2 * page + page
        for i in changed.tolist()
    )
    with pytest.raises(ValueError, match="no block for the state"):
        pages.load(got, {0: 0, 1: 1})


def test_a_state_is_named_by_the_digest_of_its_whole_prefix() -> None:
    from prefixcache.integrations.vllm.states import DIGEST_TOKENS, state_tokens

    prefix = list(range(1, 65))
    named = state_tokens(prefix, 32)
    assert len(named) == 32 and named[DIGEST_TOKENS:] == [0] * (32 - DIGEST_TOKENS)
    assert state_tokens(list(prefix), 32) == named  # deterministic across processes (no hash seed)
    assert state_tokens(prefix[:-1] + [999], 32) != named and state_tokens(prefix[:32], 32) != named
    with pytest.raises(ConfigError, match="16-token blocks"):
        state_tokens(prefix, 8)


def test_groups_refuse_unknown_kinds_and_mixed_geometries_naming_the_model_class() -> None:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec, MLAAttentionSpec

    from prefixcache.integrations.vllm.groups import KVGroups

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as error:
        KVGroups.of(
            _kv_cache_config((["model.layers.3.self_attn.attn"], full), (["model.layers.0.cross_attn"], cross)),
            "WhisperForConditionalGeneration",
        )
    message = str(error.value)
    assert error.value.field == "kv_cache_groups"
    assert "WhisperForConditionalGeneration" in message and "CrossAttentionSpec" in message
    assert "without the connector" in message
    wide = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="different KV geometries"):
        KVGroups.of(_kv_cache_config((["model.layers.0.a"], full), (["model.layers.1.a"], wide)), "Gemma4ForCausalLM")
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    groups = KVGroups.of(_kv_cache_config((["model.layers.0.self_attn.attn"], mla)), "DeepseekV2ForCausalLM")
    assert groups.latent and (groups.kv_heads, groups.head_size) == (1, 288)


def test_an_untested_vllm_version_fails_on_import_by_name() -> None:
    from prefixcache.integrations.vllm import _check_vllm

    for good in ("0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2.dev5+g1234"):
        _check_vllm(good)
    for bad in ("0.31.9", "0.34.0", "1.0.0"):
        with pytest.raises(ImportError, match=f"found vLLM {bad}"):
            _check_vllm(bad)
    with pytest.raises(ImportError, match="cannot read"):
        _check_vllm("not-a-version")


def test_layer_by_layer_copies_land_before_each_layers_wait_returns() -> None:
    """The CPU pipeline (layer_loads: on): a thread copies the step's loads layer by layer while
    the "forward" waits for each layer in model order; when `wait(layer)` returns, every block of
    that layer is in place (the copies are large enough that an early return would find layers
    half copied; repeated to catch a race), and `finish` leaves no copy in flight."""
    layers, blocks_total, heads, tokens, dim = 8, 96, 4, 32, 64
    tensors = [torch.zeros(blocks_total, heads, tokens, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
    cache = PagedCache([PagedLayer.of(t, KVPacking.TOKEN_STACKED, dim) for t in tensors])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    failed: list[set[int]] = []
    pipeline = LayerLoads(cache, names, failed.append)
    layout = KVLayout(layers=layers, kv_heads=heads, head_dim=dim, block_size=tokens, dtype="bfloat16")
    generator = torch.Generator().manual_seed(3)
    try:
        for step in range(40):
            ids = [tuple(range(1 + 40 * part, 41 + 40 * part)) for part in (0, 1)]  # two loads of 40 blocks
            sources = [torch.randn(40, *layout.block_shape, generator=generator).to(torch.bfloat16) for _ in ids]
            for source, block_ids in zip(sources, ids, strict=True):
                pipeline.add(cache.plan_load(source, (block_ids,)), block_ids)
            pipeline.start()
            for number, name in enumerate(names):
                pipeline.wait(name)
                keys, values = _vllm_cpu_views(tensors[number])
                for source, block_ids in zip(sources, ids, strict=True):
                    assert torch.equal(keys[list(block_ids)], source[:, number, 0]), (step, number)
                    assert torch.equal(values[list(block_ids)], source[:, number, 1]), (step, number)
            pipeline.wait("not.an.attention.layer")  # passes
            pipeline.finish()
        assert failed == []
    finally:
        pipeline.close()


def test_a_layer_copy_that_fails_marks_its_blocks_for_vllm_to_recompute() -> None:
    tensors = [torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(LAYERS)]
    cache = PagedCache([PagedLayer.of(t, KVPacking.TOKEN_STACKED, D) for t in tensors])
    layout = KVLayout(layers=LAYERS, kv_heads=H, head_dim=D, block_size=N, dtype="bfloat16")
    failed: list[set[int]] = []
    pipeline = LayerLoads(cache, [f"l{i}" for i in range(LAYERS)], failed.append)
    try:
        good = torch.randn(1, *layout.block_shape).to(torch.bfloat16)
        pipeline.add(
            cache.plan_load(torch.randn(2, *layout.block_shape).to(torch.bfloat16), ((3, BLOCKS + 5),)), (3, BLOCKS + 5)
        )
        pipeline.add(cache.plan_load(good, ((7,),)), (7,))
        pipeline.start()
        for i in range(LAYERS):
            pipeline.wait(f"l{i}")  # never raises into the forward
        pipeline.finish()
        assert failed == [{3, BLOCKS + 5}]  # once, at its first layer; the other load still lands
        keys, values = _vllm_cpu_views(tensors[LAYERS - 1])
        assert torch.equal(keys[7], good[0, LAYERS - 1, 0]) and torch.equal(values[7], good[0, LAYERS - 1, 1])
    finally:
        pipeline.close()
    with pytest.raises(ValueError, match="2 layer names for 3 layers"):
        LayerLoads(cache, ["a", "b"], failed.append)


def test_layer_by_layer_where_it_pays() -> None:
    assert layer_by_layer("auto", torch.device("cuda", 0)) and not layer_by_layer("auto", torch.device("cpu"))
    assert layer_by_layer("on", torch.device("cpu")) and not layer_by_layer("off", torch.device("cuda", 0))
    assert ConnectorSettings.parse({"cache": "h:1"}).layer_loads == "auto"


def test_every_connector_counter_is_described_and_named_in_the_docs() -> None:
    """Each counter the connector exports has a help text, and docs/vllm.md "Metrics" names it."""
    from prefixcache.integrations.vllm.stats import _DESCRIPTIONS, FIELDS

    assert set(_DESCRIPTIONS) == set(FIELDS)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    metrics = docs[docs.index("## Metrics") :].split("\n## ", 1)[0]
    assert [name for name in FIELDS if f"`_{name}`" not in metrics and f"prefixcache_{name}`" not in metrics] == []


def test_the_copy_benchmark_runs_and_its_loads_put_the_stored_blocks_in_place(tmp_path: Path) -> None:
    """benchmarks/vllm_copy_cost.py, small: it asserts each round that the loads put the stored
    bytes in vLLM's blocks and that a save in place stores them, and reports every copy it times."""
    out = tmp_path / "copy.json"
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "vllm_copy_cost.py"),
            "--blocks",
            "4",
            "--layers",
            "2",
            "--rounds",
            "2",
            "--json-out",
            str(out),
        ],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        check=True,
        timeout=300,
        capture_output=True,
    )
    summary = json.loads(out.read_text())
    assert set(summary["rows"]) == {
        "load, staged",
        "load, direct",
        "save: gather",
        "save: store",
        "save in place: gather",
        "save in place: commit",
    }
    assert all(row["p50_us"] > 0 for row in summary["rows"].values())
    assert summary["direct_over_staged"] > 0 and summary["in_place_over_staged"] > 0
