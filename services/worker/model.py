"""Loading the worker's model: the built-in tiny Llama, or a local causal-LM checkpoint.

Owns `load_model`, the identity of the loaded weights (`weights_digest`) and the process's
torch thread count.

Invariants:
- The returned model is in eval mode with gradients off; nothing is fetched from a hub.
- "tiny" is a randomly initialised `LlamaForCausalLM` (4 layers, hidden 256, 8 query heads,
  2 KV heads, head_dim 32, SwiGLU 688, tied embeddings, cl100k vocabulary, 16k positions):
  its weights are a pure function of the seed (initialised in float32 under a forked RNG
  seeded with `seed`, then cast), so every process loading the same spec holds bitwise
  identical weights. The global torch RNG is left untouched.
- `weights_digest` names the weights: for tiny, sha256 over the recipe (config, seed, dtype)
  and the resulting weight bytes (so two software stacks whose random init differ get
  different digests instead of silently sharing KV); for a path, sha256 streamed over
  config.json and the weight files. Same weights => same digest; it feeds the cache namespace.
- Only models with plain per-layer KV are accepted (see `compat`); the KV layout is read
  off a real forward pass.
- Attention defaults to `attention.PREFIX_EXACT`, the length-invariant kernel that makes
  cached and recomputed KV bitwise identical in bfloat16 (see `attention`).
- A process that imports this module runs oneDNN capped below AMX (`ONEDNN_MAX_CPU_ISA`, unless
  set): AMX bf16 matmuls pick their blocking from the row count (a row of a 144-row call differs
  from the same row in a 257-row one, K >= 640; measured on an AMX Xeon), which would break that
  exactness; the AVX-512 BF16 kernels below are row-invariant. oneDNN reads the cap at its first
  primitive, after this import; `engine.rows_invariant` checks it took. Never in a vLLM process:
  vLLM's CPU kernels need the AMX state that only oneDNN's AMX path enables (capped: SIGILL).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from prefixcache.config import MODEL_DTYPES, DType, KVLayout

from .attention import register_prefix_exact_attention
from .chat import ChatMessage, ChatMLTemplate, ChatRenderer, HFChatTemplate
from .compat import check_plain_kv, probe_kv_layout
from .tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

# Read by oneDNN at its first primitive, so in time after torch is imported (see above).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

logger = logging.getLogger(__name__)

TINY_SPEC = "tiny"
TINY_MODEL_ID = "prefixcache-tiny-llama"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_dtype(name: str) -> DType:
    """The dtype a model computes (and keeps its KV) in: one of `MODEL_DTYPES`."""
    parsed = next((dtype for dtype in MODEL_DTYPES if dtype.value == name), None)
    if parsed is None:
        raise ValueError(f"dtype {name!r} is not one of {[d.value for d in MODEL_DTYPES]}")
    return parsed


class Attention(enum.Enum):
    """Attention kernels; only PREFIX_EXACT gives bitwise cached == recomputed (bfloat16)."""

    PREFIX_EXACT = "prefix_exact_sdpa"
    SDPA = "sdpa"
    EAGER = "eager"


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Tokenizer
    render_chat: ChatRenderer
    model_id: str
    weights_digest: str
    kv: KVLayout  # read off a forward pass; its block_size is the default until the cache link sets the service's
    stop_token_ids: frozenset[int]
    max_positions: int | None
    attention: Attention


def tiny_config(vocab_size: int, attention: Attention = Attention.PREFIX_EXACT) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        # 0.1, not Llama's 0.02: at 0.02 the random residual stream is dominated by the input
        # embedding, so the tied head echoes one token forever and greedy-equality checks
        # become vacuous; at 0.1 greedy output varies token to token.
        initializer_range=0.1,
        # PreTrainedConfig's kwargs are accepted at runtime; the dataclass signature omits them
        attn_implementation=attention.value,  # type: ignore[call-arg]
    )


def _state_digest(model: PreTrainedModel, recipe: dict) -> str:
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.data_ptr() in seen:  # tied weights are hashed once
            continue
        seen.add(tensor.data_ptr())
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def checkpoint_digest(path: Path) -> str:
    """sha256 streamed over config.json and the weight files of a checkpoint directory."""
    files = sorted(
        p for p in path.iterdir() if p.is_file() and (p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES)
    )
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"{path} has no weight files ({', '.join(_WEIGHT_SUFFIXES)})")
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.name}:{p.stat().st_size}:".encode())
        with p.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


_Model = TypeVar("_Model", bound=PreTrainedModel)


def _freeze(model: _Model) -> _Model:
    model.eval()
    model.requires_grad_(False)
    return model


def _load_tiny(dtype: DType, seed: int, attention: Attention) -> LoadedModel:
    tokenizer = TiktokenTokenizer()
    config = tiny_config(tokenizer.vocab_size, attention)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # transformers wraps `to` with @wraps(nn.Module.to), whose type loses the bound self
    model = _freeze(model.to(dtype.torch))  # type: ignore[arg-type]
    recipe = {"spec": TINY_SPEC, "seed": seed, "dtype": dtype.value, "config": _config_recipe(config)}
    template = ChatMLTemplate(tokenizer)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        render_chat=template.render,
        model_id=TINY_MODEL_ID,
        weights_digest=_state_digest(model, recipe),
        kv=probe_kv_layout(model),
        stop_token_ids=template.stop_token_ids,
        max_positions=config.max_position_embeddings,
        attention=attention,
    )


def _config_recipe(config: LlamaConfig) -> dict:
    recipe = config.to_diff_dict()
    for volatile in ("transformers_version", "_attn_implementation", "attn_implementation"):
        recipe.pop(volatile, None)
    return recipe


def _no_chat_template(messages: Sequence[ChatMessage]) -> list[int]:
    raise ValueError("the checkpoint's tokenizer has no chat_template; use completions")


def _stop_ids(model: PreTrainedModel, tokenizer: HFTokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(i for i in ids if i is not None)


def _load_path(path: Path, dtype: DType, attention: Attention) -> LoadedModel:
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    check_plain_kv(config)  # before reading gigabytes of weights
    tokenizer = HFTokenizer(path)
    text = config.get_text_config(decoder=True)
    if tokenizer.vocab_size > text.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model embeds {text.vocab_size}")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=dtype.torch, attn_implementation=attention.value
    )
    model = _freeze(model)
    render = HFChatTemplate(tokenizer).render if tokenizer.hf.chat_template else _no_chat_template
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        render_chat=render,
        model_id=path.resolve().name,
        weights_digest=checkpoint_digest(path),
        kv=probe_kv_layout(model),
        stop_token_ids=_stop_ids(model, tokenizer),
        max_positions=getattr(text, "max_position_embeddings", None),
        attention=attention,
    )


def load_model(
    spec: str = TINY_SPEC,
    dtype: str = "float32",
    seed: int = 0,
    attention: Attention = Attention.PREFIX_EXACT,
) -> LoadedModel:
    """Load "tiny" or the causal-LM checkpoint in local directory `spec`."""
    parsed = model_dtype(dtype)
    if attention is Attention.PREFIX_EXACT:
        register_prefix_exact_attention()
    if spec == TINY_SPEC:
        loaded = _load_tiny(parsed, seed, attention)
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ValueError(f"model spec {spec!r} is neither {TINY_SPEC!r} nor a local checkpoint directory")
        loaded = _load_path(path, parsed, attention)
    logger.info(
        "loaded model %s (%s, %s, digest %s): %s",
        loaded.model_id,
        loaded.kv.dtype.value,
        attention.value,
        loaded.weights_digest[:12],
        loaded.kv,
    )
    return loaded


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))


def configure_torch_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads` or to the CPUs actually available.

    torch defaults to the host's core count, which oversubscribes a CPU-limited container
    and fights co-located processes (cache server, Redis). Call once at worker start-up.
    """
    n = threads if threads is not None else available_cpus()
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    torch.set_num_threads(n)
    logger.info("torch intra-op threads: %d", n)
    return n
