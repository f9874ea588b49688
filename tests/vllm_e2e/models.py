"""Random-weight checkpoints of the architectures the connector supports, built from configs.

Each builder saves a 4-layer, hidden-256 model with `save_pretrained` (bfloat16, seeded) so
vLLM's CPU build can load it with `skip_tokenizer_init`; nothing is downloaded. `build(name,
root)` builds a checkpoint once per directory and reuses it afterwards (tests and benchmarks
share them within a run). The geometry is chosen so that the interesting part of each
architecture is exercised by prompts of a few hundred tokens: sliding windows of 64-128
tokens (2-4 vLLM CPU blocks of 32), MLA's 512 + 64 latent (the only head size vLLM's CPU MLA
kernel compiles).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 512
HIDDEN = 256
LAYERS = 4
# What every checkpoint shares: 4 query heads over 2 KV heads, long positions, varied greedy outputs.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=512,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.1,
)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _gemma3() -> Any:
    # Gemma 3's 5:1 local:global pattern, shortened to 3:1 over four layers; window 64 tokens.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **COMMON,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(config)


def _mistral_sliding() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        **COMMON,
        sliding_window=96,
        tie_word_embeddings=True,
    )
    return MistralForCausalLM(config)


def _gpt_oss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **{**COMMON, "intermediate_size": 256},
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
    )
    return GptOssForCausalLM(config)


def _deepseek_v2() -> Any:
    # MLA: kv_lora_rank 512 + rope 64 = the 576-wide latent vLLM's CPU MLA kernel compiles for.
    # Dense MLPs in every layer (first_k_dense_replace = LAYERS): vLLM's CPU MoE router asserted
    # on a tiny expert configuration.
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=128,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=LAYERS,
        rope_scaling=None,
    )
    return DeepseekV2ForCausalLM(config)


def _qwen3_next() -> Any:
    # Gated DeltaNet (linear attention, recurrent state) in 3 of 4 layers, full attention in the
    # fourth; a 4-expert MoE (vLLM's Qwen3-Next needs its MoE layers). Linear heads of 64: the
    # size vLLM's CPU GDN kernel compiles. vLLM raises the block size to 256 tokens so that an
    # attention page holds a state page.
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **{**COMMON, "intermediate_size": 256},
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    return Qwen3NextForCausalLM(config)


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "gemma3": _gemma3,
    "mistral_sliding": _mistral_sliding,
    "gpt_oss": _gpt_oss,
    "deepseek_v2": _deepseek_v2,
    "qwen3_next": _qwen3_next,
}


def build(name: str, root: Path) -> Path:
    """The checkpoint `name` under `root` (built on first use, reused afterwards)."""
    import torch

    directory = root / name
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(1234)
    BUILDERS[name]().to(torch.bfloat16).save_pretrained(directory)
    return directory
