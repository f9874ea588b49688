"""vLLM's paged KV tensors seen as per-layer key and value views, and block copies in and out.

vLLM 0.32 hands a connector one tensor per attention layer with the *logical* shape
`[num_blocks, kv_heads, block_size, 2 * head_size]`; its physical order is whatever the
attention backend asked for (vLLM's `KVCacheLayout`, applied through strides). How keys and
values share the last axis depends on the backend:

- `TOKEN_STACKED` (vLLM's CPU backend, `CPU_ATTN`, layout LBHNC): each `(block, head)` run of
  `block_size * 2 * head_size` elements is reinterpreted as `[2, block_size, head_size]`:
  all keys of the block, then all values (cpu_attn.py views it as `[.., 2 * block_size, D]`
  and chunks dim 2). Needs that run to be contiguous, which LBHNC guarantees.
- `CONTENT_SPLIT` (CUDA FlashAttention `FLASH_ATTN` and FlashInfer `FLASHINFER`): keys are
  `[..., :head_size]`, values `[..., head_size:]` of each token's row; NHD (`LBNHC`, tokens
  outer) and HND (`LBHNC`/`BLHNC`, heads outer) differ only in strides, which these views keep.
- `LATENT` (MLA: vLLM's CPU backend `CPU_MLA` as `[num_blocks, 1, block_size, width]`, its AMX
  backend `AMX_MLA` and the CUDA MLA backends `FLASHMLA`, `CUTLASS_MLA`, `FLASHINFER_MLA`,
  `TRITON_MLA`, `FLASH_ATTN_MLA` as `[num_blocks, block_size, width]`, token rows): one latent row per token (kv_lora_rank + rope dims, 576
  for DeepSeek-V2/V3), no separate keys and values. The cache stores the row as the canonical
  block's two halves with one "head" (`head_size` = width / 2), i.e. `CONTENT_SPLIT` of a
  one-head view: the bytes of a block are exactly vLLM's, in vLLM's order.

Every way `PagedLayer.keys` / `.values` are strided `[num_blocks, kv_heads, block_size,
head_size]` views of vLLM's own storage, so a block copy is an indexed copy between them and
the cache's canonical block `[layers, 2, kv_heads, block_size, head_size]`: a memcpy-like
gather/scatter on CPU, and the same code moves host->device or device->host on CUDA.

Hybrid models (vLLM's hybrid KV cache manager): each layer belongs to one KV cache group with a
block table of its own, so a copy takes one list of vLLM block ids per group (`GroupBlockIds`).
vLLM puts its null block (id 0) where a group needs no KV, e.g. a sliding-window group before
the window of the hit point; a load skips those positions, so sliding layers move only their
window, and a gather never meets one (the scheduler saves blocks while vLLM still holds them).

Copies out (`gather_later`, `StatePages.gather_later`) return a `HostCopy`: on CUDA the
blocks are gathered on vLLM's stream (ordered after the forward that wrote them and before any
later forward that could reuse them) and copied to pinned host memory on a side stream, so the
step only queues them; the caller waits for the copy off the step. On CPU the copy is made at
once (a thread of its own would take the same cores), and `gather_into` makes it straight into
a cache service's mapped slots where the worker holds a reservation for them.

Invariants: nothing here allocates a second paged cache (views alias vLLM's tensors); bytes
are copied, never converted (a dtype that differs only in name, e.g. fp8 stored as uint8, is
reinterpreted with `view`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...errors import ConfigError

NULL_BLOCK = 0  # vLLM's null block id (BlockPool.null_block): no KV needed at that position
GroupBlockIds = tuple[tuple[int, ...], ...]  # per KV cache group, vLLM block ids in prompt order


class KVPacking(enum.Enum):
    TOKEN_STACKED = "token_stacked"  # CPU_ATTN: per (block, head) [K rows | V rows]
    CONTENT_SPLIT = "content_split"  # FLASH_ATTN, FLASHINFER: per token [K | V]
    LATENT = "latent"  # MLA backends: per token one latent row, stored as two halves


_PACKING_OF_BACKEND = {
    "CPU_ATTN": KVPacking.TOKEN_STACKED,
    "FLASH_ATTN": KVPacking.CONTENT_SPLIT,
    "FLASHINFER": KVPacking.CONTENT_SPLIT,
    "CPU_MLA": KVPacking.LATENT,
    "AMX_MLA": KVPacking.LATENT,  # vLLM's CPU MLA backend on AMX hosts: token rows, as the CUDA ones
    "FLASHMLA": KVPacking.LATENT,
    "CUTLASS_MLA": KVPacking.LATENT,
    "FLASHINFER_MLA": KVPacking.LATENT,
    "TRITON_MLA": KVPacking.LATENT,
    "FLASH_ATTN_MLA": KVPacking.LATENT,
}


def packing_of_backend(name: str) -> KVPacking:
    try:
        return _PACKING_OF_BACKEND[name]
    except KeyError:
        known = ", ".join(sorted(_PACKING_OF_BACKEND))
        raise ConfigError("attention_backend", f"{name!r} is not a backend the connector can copy ({known})") from None


@dataclass(frozen=True)
class PagedLayer:
    keys: torch.Tensor  # [num_blocks, kv_heads, block_size, head_size], a view of vLLM's cache
    values: torch.Tensor
    group: int = 0  # the KV cache group whose block table addresses this layer

    @classmethod
    def of(cls, tensor: torch.Tensor, packing: KVPacking, head_size: int, group: int = 0) -> PagedLayer:
        """`head_size`: the canonical block's head_dim (for LATENT, half the latent row)."""
        if packing is KVPacking.LATENT and tensor.dim() == 3:
            tensor = tensor.unsqueeze(1)  # the CUDA MLA backends' [blocks, block_size, width]: one head
        if tensor.dim() != 4 or tensor.shape[-1] != 2 * head_size:
            raise ConfigError(
                "kv_caches", f"expected [blocks, kv_heads, block_size, {2 * head_size}], got {tuple(tensor.shape)}"
            )
        blocks, heads, block_size, _ = tensor.shape
        if packing is not KVPacking.TOKEN_STACKED:
            return cls(tensor[..., :head_size], tensor[..., head_size:], group)
        sb, sh, sn, sc = tensor.stride()
        if sc != 1 or sn != 2 * head_size:
            raise ConfigError(
                "kv_caches",
                f"CPU paged cache strides {tensor.stride()} are not block-contiguous "
                "(LBHNC); cannot split keys from values",
            )
        shape = (blocks, heads, block_size, head_size)
        strides = (sb, sh, head_size, 1)
        half = block_size * head_size
        keys = tensor.as_strided(shape, strides, tensor.storage_offset())
        values = tensor.as_strided(shape, strides, tensor.storage_offset() + half)
        return cls(keys, values, group)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies saved blocks to host memory, one per CUDA device."""
    return torch.cuda.Stream(device)


class HostCopy:
    """A tensor on its way to host memory. On CUDA the copy runs on a side stream behind what
    vLLM's stream has queued so far, into pinned memory, so the step that asked for it does not
    wait for it; `wait` (off the step) returns the tensor once complete. Elsewhere the tensor is
    on the host already and `wait` returns it at once."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """`dtype`: the bytes viewed as this element type (fp8 held by vLLM as uint8)."""
        self._done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            host = tensor.cpu()
        else:
            stream = _copy_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # its memory is not reused before the copy is done
                self._done = torch.cuda.Event()
                self._done.record(stream)
        self._host = host if dtype is None else host.view(dtype)

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host


# Integer types a load may view the bytes as, widest first: `index_copy_` moves elements, and
# 8-byte ones load a bf16 cache's blocks in 0.84x the time of 2-byte ones on one CPU core (48
# blocks of 12 layers: 2.05 vs 2.43 ms; `index_select`, the gathers, gains nothing).
_WIDE_TYPES = (torch.int64, torch.int32, torch.int16)


def _widest(tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    """The widest of `_WIDE_TYPES` every tensor can be viewed as (None: keep their own)."""
    for dtype in _WIDE_TYPES:
        if dtype.itemsize <= tensors[0].dtype.itemsize:
            return None
        try:
            for tensor in tensors:
                tensor.view(dtype)
        except RuntimeError:  # a row or an offset not a multiple of its size
            continue
        return dtype
    return None


@dataclass(frozen=True)
class LoadPlan:
    """A load of canonical blocks into vLLM's cache, ready to copy layer by layer (`PagedCache.load_layer`)."""

    source: torch.Tensor  # blocks `[n, layers, 2, H, N, D]`, as the copy type (on vLLM's device unless by layer)
    groups: dict[int, tuple[torch.Tensor, torch.Tensor | None]]  # KV group -> (vLLM block ids, source rows or all)
    copies: int  # layer-blocks the load copies (a sliding layer outside its window copies none)


class PagedCache:
    """vLLM's layers in model order, with copies to and from canonical cache blocks."""

    def __init__(self, layers: list[PagedLayer], dtype: torch.dtype | None = None) -> None:
        """`dtype`: the cache's element type of the blocks (default: vLLM's tensors' own). vLLM
        holds an fp8 cache in uint8 tensors (`STR_DTYPE_TO_TORCH_DTYPE["fp8"]`); the cache names
        the format (float8_e4m3fn / float8_e5m2), and the two are the same bytes, viewed."""
        self.layers = layers
        self._groups = {layer.group for layer in layers}
        self.dtype = dtype or layers[0].keys.dtype
        paged = layers[0].keys.dtype
        if paged.itemsize != self.dtype.itemsize:
            raise ConfigError(
                "cache_dtype",
                f"vLLM's paged cache holds {paged} elements, the namespace's "
                f"{self.dtype} is another size; bytes cannot be reinterpreted",
            )
        # Loads move the same bytes as wider elements where every layer's views allow it.
        self._copy_type = _widest([view for layer in layers for view in (layer.keys, layer.values)]) or paged
        self._copy_views = [(layer.keys.view(self._copy_type), layer.values.view(self._copy_type)) for layer in layers]

    @property
    def device(self) -> torch.device:
        return self.layers[0].keys.device

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def load(self, blocks: torch.Tensor, block_ids: GroupBlockIds) -> int:
        """Group g's vLLM block block_ids[g][i] <- canonical block blocks[i] (`[n, layers, 2, H, N, D]`,
        any device), for the layers of group g; null positions are skipped. Returns the blocks'
        layer-copies made (a sliding-window layer outside its window makes none)."""
        plan = self.plan_load(blocks, block_ids)
        for number in range(len(self.layers)):
            self.load_layer(plan, number)
        return plan.copies

    def plan_load(self, blocks: torch.Tensor, block_ids: GroupBlockIds, by_layer: bool = False) -> LoadPlan:
        """`load`'s checks and indexes; the copies are `load_layer`'s, one layer at a time.
        `by_layer` False: the blocks move to vLLM's device now, in one transfer (queued, not
        awaited, on CUDA); True: they stay where they are and each layer's part moves with its
        copy, so on CUDA one layer's host->device transfer can overlap another's compute."""
        source = blocks if by_layer else blocks.to(self.device, non_blocking=True)
        if source.dtype != self.layers[0].keys.dtype:  # fp8 held as uint8: same bytes, never converted
            if source.dtype.itemsize != self.layers[0].keys.dtype.itemsize:
                raise ValueError(f"blocks of {source.dtype} cannot be viewed as vLLM's {self.layers[0].keys.dtype}")
            source = source.view(self.layers[0].keys.dtype)
        if source.dtype != self._copy_type:
            try:
                source = source.view(self._copy_type)
            except RuntimeError:  # not contiguous in its rows: copied as its own elements
                pass
        plans: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for group, ids in enumerate(block_ids):
            if group not in self._groups:
                continue  # a state group (StatePages loads its one block)
            if len(ids) != len(source):
                raise ValueError(f"group {group}: {len(ids)} block ids for {len(source)} blocks")
            kept = [i for i, block in enumerate(ids) if block != NULL_BLOCK]
            if kept:
                rows = None if len(kept) == len(ids) else torch.tensor(kept, dtype=torch.long, device=source.device)
                plans[group] = (self._index([ids[i] for i in kept]), rows)
        copies = sum(len(plans[layer.group][0]) for layer in self.layers if layer.group in plans)
        return LoadPlan(source, plans, copies)

    def load_layer(self, plan: LoadPlan, number: int) -> None:
        """Layer `number`'s part of a planned load (nothing when its group has no block to load)."""
        layer = self.layers[number]
        group = plan.groups.get(layer.group)
        if group is None:
            return
        index, rows = group
        part = plan.source[:, number] if rows is None else plan.source.index_select(0, rows)[:, number]
        part = part.to(self.device, non_blocking=True)  # a plan made `by_layer` moves here
        keys, values = self._copy_views[number] if part.dtype == self._copy_type else (layer.keys, layer.values)
        keys.index_copy_(0, index, part[:, 0])
        values.index_copy_(0, index, part[:, 1])

    def gather(self, block_ids: GroupBlockIds) -> torch.Tensor:
        """Canonical blocks `[n, layers, 2, H, N, D]` (on CPU, in `self.dtype`): layer l of block i is
        read from block_ids[group of l][i]. Every id must be a real block (ValueError on a null)."""
        return self.gather_later(block_ids).wait()

    def gather_later(self, block_ids: GroupBlockIds) -> HostCopy:
        """`gather`, with the copy to host memory left running on CUDA (`HostCopy`)."""
        first = self.layers[0].keys
        out = torch.empty(
            (len(block_ids[0]), len(self.layers), 2, *first.shape[1:]), dtype=first.dtype, device=self.device
        )
        self.gather_into(block_ids, out)
        return HostCopy(out, self.dtype)  # uint8-held fp8 -> the namespace's float8 type, same bytes

    def gather_into(self, block_ids: GroupBlockIds, out: torch.Tensor) -> None:
        """`gather` into `out` (`[n, layers, 2, H, N, D]` on vLLM's device, of its dtype or one of
        the same size), e.g. a cache service's mapped slots: one copy from vLLM's blocks."""
        indexes: dict[int, torch.Tensor] = {}
        for group in self._groups:  # a state group's ids are not KV (StatePages)
            if NULL_BLOCK in block_ids[group]:
                raise ValueError(f"group {group} no longer holds every block to gather")
            indexes[group] = self._index(block_ids[group])
        paged = self.layers[0].keys.dtype
        if out.dtype != paged:
            out = out.view(paged)  # fp8 held by vLLM as uint8: same bytes
        for number, layer in enumerate(self.layers):  # index_select: no faster on wider elements
            index = indexes[layer.group]
            torch.index_select(layer.keys, 0, index, out=out[:, number, 0])
            torch.index_select(layer.values, 0, index, out=out[:, number, 1])


class StatePages:
    """vLLM's state layers (Mamba, GDN) as raw pages, with copies to and from state blocks.

    vLLM places every layer's page for block b at `offset + l * layer_stride + b * block_stride`
    bytes of one backing allocation (its `KVCacheTensor`); a state page holds the layer's conv
    and SSM states at one block boundary, padded to an attention layer's page. The pages are
    viewed here as `[num_blocks, page_bytes]` uint8 rows of that allocation, whatever typed
    views vLLM's own state code uses, and a state block `[n, layers, 2, H, N, D]` of the
    namespace's dtype is those bytes reinterpreted (groups.py checks the sizes agree).
    """

    def __init__(self, pages: list[torch.Tensor], groups: Sequence[int]) -> None:
        self.pages = pages  # per state layer, [num_blocks, page_bytes] uint8 views of vLLM's cache
        self.groups = tuple(groups)  # the KV cache group of each

    @classmethod
    def of(
        cls, kv_caches: dict[str, torch.Tensor], kv_cache_config: object, names: Sequence[str], groups: Sequence[int]
    ) -> StatePages:
        placements = {
            name: (tensor, index)
            for tensor in getattr(kv_cache_config, "kv_cache_tensors", ())
            for index, name in enumerate(tensor.layers)
        }
        pages = []
        page_bytes = {
            name: spec.page_size_bytes
            for group in kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
            for name, spec in (
                getattr(group.kv_cache_spec, "kv_cache_specs", None)
                or dict.fromkeys(group.layer_names, group.kv_cache_spec)
            ).items()
        }
        for name in names:
            if name not in placements or name not in kv_caches:
                raise ConfigError("kv_caches", f"no KV cache tensor places state layer {name}")
            tensor, index = placements[name]
            held = kv_caches[name]
            held = held[0] if isinstance(held, (list, tuple)) else held
            storage = torch.empty(0, dtype=torch.uint8, device=held.device).set_(held.untyped_storage())
            blocks = kv_cache_config.num_blocks  # type: ignore[attr-defined]
            start = tensor.offset + index * tensor.layer_stride
            if start + (blocks - 1) * tensor.block_stride + page_bytes[name] > storage.numel():
                raise ConfigError("kv_caches", f"state layer {name}'s pages lie outside its allocation")
            pages.append(storage.as_strided((blocks, page_bytes[name]), (tensor.block_stride, 1), start))
        return cls(pages, groups)

    def gather(self, block_ids: Mapping[int, int]) -> torch.Tensor:
        """`[1, layers, page_bytes]` uint8 (on CPU): state layer l's page at block_ids[its group]."""
        return self.gather_later(block_ids).wait()

    def gather_later(self, block_ids: Mapping[int, int]) -> HostCopy:
        """`gather`, with the copy to host memory left running on CUDA (`HostCopy`)."""
        out = torch.empty((1, len(self.pages), self.pages[0].shape[1]), dtype=torch.uint8, device=self.pages[0].device)
        for number, (page, group) in enumerate(zip(self.pages, self.groups, strict=True)):
            out[0, number] = page[block_ids[group]]
        return HostCopy(out)

    def load(self, block: torch.Tensor, block_ids: Mapping[int, int]) -> None:
        """State layer l's page at block_ids[its group] <- block `[1, layers, ...]` (its bytes, any dtype)."""
        source = block.to(self.pages[0].device).contiguous().view(torch.uint8).reshape(1, len(self.pages), -1)
        if source.shape[2] != self.pages[0].shape[1]:
            raise ValueError(
                f"a state block of {source.shape[2]} bytes per layer, vLLM's pages hold {self.pages[0].shape[1]}"
            )
        for number, (page, group) in enumerate(zip(self.pages, self.groups, strict=True)):
            if block_ids.get(group, NULL_BLOCK) == NULL_BLOCK:
                raise ValueError(f"group {group} has no block for the state")
            page[block_ids[group]].copy_(source[0, number])
