"""Length-invariant causal attention, so cached and recomputed KV agree bit for bit.

Owns the attention function the worker registers with transformers (`PREFIX_EXACT`).

Why it exists: a prefix's KV is computed inside one prompt and reused inside another of a
different length, and the suffix is then computed without the prefix's queries. Stock
kernels pick their tiling from the sequence lengths, so a query row's floating-point
summation order depends on how many tokens share the forward pass. PyTorch's CPU
flash-attention kernel uses one kv tile of the whole length up to 512 keys and 512-key tiles
above; its q blocks are 32/64/256 rows depending on the query count, and the last, short q
block (and the causal diagonal block, cut at the diagonal) goes through differently rounded
code. Measured with the tiny model in bfloat16, stock `sdpa` gave 1-ulp different KV for a
reused prefix in ~1 of 5 random prompt pairs of 300-1800 tokens (`eager` too, above ~1k
tokens), occasionally flipping a greedy token.

What it does, so that each query row is computed by the identical kernel call whatever the
prompt length or how much of it was cached:
- keys/values are zero-padded to a multiple of `KV_TILE` (512, the kernel's kv tile) and
  the padding masked, so kv tiles are always the same, aligned at position 0;
- queries are cut into `Q_CHUNK`-row chunks aligned at absolute positions (multiples of 16);
  each chunk is one batch item (its own single q block in the kernel), attending over all
  kv tiles up to the end of its own tile with an explicit causal mask. Chunks whose tiles
  coincide run as one batched SDPA call. Tiles past a chunk's own are fully masked for it;
  they are skipped (they would add exact zeros);
- GQA is handled inside SDPA (`enable_gqa`), no repeated KV.
Because cached prefixes end on block boundaries, a suffix starts on a chunk boundary when
`block_size % Q_CHUNK == 0` (the default block_size 16 qualifies): then every chunk, and so
every row, is the same in a full prefill and in a cached one. Cost: ~2x stock `sdpa` at 4k
tokens (small q blocks, explicit mask), still well under a second for the tiny model.

Invariants and limits:
- single sequence, no padding: query i sits at absolute position kv_len - q_len + i;
- plain causal full attention only: softcapping, attention sinks, sliding windows and
  non-causal modules raise `ValueError`;
- bfloat16 on CPU: cached == recomputed bit for bit (verified on random prompt pairs of up
  to 3k tokens, 1 and 2 threads), given row-invariant matmuls: oneDNN's AMX kernels are not,
  so the worker caps oneDNN below them (worker/model.py; `engine.rows_invariant` checks). float32 is not bit-exact on CPU whatever the attention
  (MKL sgemm and vectorised elementwise kernels such as SiLU round differently with the
  row count and thread split): logits differ by ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

PREFIX_EXACT = "prefix_exact_sdpa"
KV_TILE = 512
Q_CHUNK = 16
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sliding_window")


def _padded_length(kv_len: int) -> int:
    return max(KV_TILE, -(-kv_len // KV_TILE) * KV_TILE)


def _reject_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{PREFIX_EXACT} attention does not support {name}")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{PREFIX_EXACT} attention only supports causal attention")
    if dropout:
        raise ValueError(f"{PREFIX_EXACT} attention is inference-only (dropout={dropout})")


def prefix_exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [b, h, q, d] inputs -> ([b, q, h, d], None).

    `attention_mask` is ignored (it is None: no mask function is registered for this
    implementation); the causal mask is derived from the lengths.
    """
    _reject_unsupported(module, dropout, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    first = kv_len - q_len  # absolute position of query 0
    padded = _padded_length(kv_len)
    if padded != kv_len:
        key = F.pad(key, (0, 0, 0, padded - kv_len))
        value = F.pad(value, (0, 0, 0, padded - kv_len))
    outs = [
        _attend(query[:, :, start - first : end - first], key, value, start, rows, scaling)
        for start, end, rows in _spans(first, kv_len)
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _spans(first: int, end: int) -> list[tuple[int, int, int]]:
    """Cut absolute query positions [first, end) into (start, stop, rows_per_chunk) spans.

    A span is either one partial Q_CHUNK-aligned chunk, or a run of whole chunks inside one
    KV tile (run as one batched call, one chunk per batch item).
    """
    spans = []
    start = first
    while start < end:
        chunk_end = (start // Q_CHUNK + 1) * Q_CHUNK
        if start % Q_CHUNK or chunk_end > end:
            stop = min(chunk_end, end)
            spans.append((start, stop, stop - start))
        else:
            tile_end = (start // KV_TILE + 1) * KV_TILE
            stop = min(tile_end, end // Q_CHUNK * Q_CHUNK)
            spans.append((start, stop, Q_CHUNK))
        start = stop
    return spans


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    first: int,
    rows: int,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of queries at absolute positions first.. ([1, h, n * rows, d]), chunk by
    chunk as batch items, over the whole KV tiles up to the span's tile, explicit mask."""
    _, heads, total, dim = query.shape
    items = total // rows
    n_keys = _padded_length(first + total)
    chunks = query.view(heads, items, rows, dim).transpose(0, 1)
    positions = torch.arange(first, first + total, device=query.device).view(items, 1, rows, 1)
    mask = torch.arange(n_keys, device=query.device).view(1, 1, 1, n_keys) <= positions
    out = F.scaled_dot_product_attention(
        chunks,
        key[:, :, :n_keys].expand(items, -1, -1, -1),
        value[:, :, :n_keys].expand(items, -1, -1, -1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(1, heads, total, dim)


def register_prefix_exact_attention() -> str:
    """Register the function with transformers (idempotent) and return its name."""
    AttentionInterface.register(PREFIX_EXACT, prefix_exact_attention)
    return PREFIX_EXACT
