"""The paged KV cache: the one owner of the pool's storage, its layout, the int8 scales and bytes per token.

The pool is one cache per layer, keys and values each [Hkv, blocks, block_size, D] in the KV dtype; an int8
pool adds a per-token, per-head scale [Hkv, blocks, block_size] (kernels.int8_heads.SCALE_DTYPE) to each. A
token at position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`
(`slots`). Which blocks a sequence holds (allocation, ref counts, the prefix cache) is engine.block_manager's;
how much the pool may take is `pool_blocks`'s; what lives in the blocks and where is this module's.

Storage costs nothing until used: `torch.zeros` of a large pool writes every page at start-up (slow on a VM
whose host backs guest memory lazily) and commits memory that short requests never reach. On CPU the pool is a
private anonymous memory map instead: the kernel hands out a zero page on first touch, so the pool reads
exactly as `torch.zeros` (no garbage a masked attention slot could turn into NaN) while start-up touches
nothing. No `MADV_HUGEPAGE`: with the usual `defrag=madvise` every huge-page fault compacts memory
synchronously, far slower than the small-page faults it replaces. Elsewhere the pool is `torch.zeros` (a
device memset is fast).

The int8 cache quantizes in `write`; on CPU, short queries (decode, verify) run the fused kernel, which reads
the int8 blocks and their scales itself; prefill, and every query where the kernel is off or unbuilt, attends
over a dequantized copy of the blocks it reads.
"""

from __future__ import annotations

import mmap
from typing import Protocol

import torch

from sluice import kernels
from sluice.kernels import device_path
from sluice.kernels.cpu_attention import paged_attention_cpu
from sluice.kernels.kv_int8 import SCALE_DTYPE, compact_metadata, dequantize_blocks, write_kv_int8

CPU_KV_DEFAULT_GB = 4.0


class KVShape(Protocol):
    """What the pool's layout reads of a model's config (engine.models.llama.ModelConfig)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class PoolBudget(Protocol):
    """What the pool's size reads of the engine's config (engine.config.EngineConfig)."""

    block_size: int
    kv_cache_memory_gb: float | None
    gpu_memory_utilization: float
    max_num_seqs: int


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of `shape` whose CPU pages are committed only when first written or read."""
    device = torch.device(device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the map alive


def bytes_per_token(c: KVShape, kv_dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take across all layers in a `kv_dtype` pool (int8: scales
    included)."""
    size = torch.empty((), dtype=kv_dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if kv_dtype == torch.int8 else 0
    return 2 * c.num_layers * c.num_kv_heads * (c.head_dim * size + scale)


def pool_blocks(config: PoolBudget, c: KVShape, kv_dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> int:
    """Blocks in the KV pool: the configured budget, else what is free on the GPU (after the weights load)
    or enough for max_num_seqs full-length sequences on CPU, capped at CPU_KV_DEFAULT_GB."""
    per_token = bytes_per_token(c, kv_dtype)
    per_block = per_token * config.block_size
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * 1024**3)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(max(free - total * (1 - config.gpu_memory_utilization), 0))
    else:
        budget = int(min(per_token * config.max_num_seqs * max_model_len, CPU_KV_DEFAULT_GB * 1024**3))
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes")
    return int(num_blocks)


def slots(block_table: list[int], positions: range, block_size: int) -> list[int]:
    """The pool slots of a sequence's `positions`, through its block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class LayerKVCache:
    """One layer's slice of a plain pool: writes this step's keys/values, attends over the rest; `flat`: the
    step plan's layout (kernels.dispatch), whose store skips padding slots (-1)."""

    __slots__ = ("k", "v", "flat")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, flat: bool = False) -> None:
        self.k, self.v, self.flat = k, v, flat

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.flat:
            device_path.store_kv(self.k, self.v, k, v, slot_mapping)
        else:
            kernels.write_kv(self.k, self.v, k, v, slot_mapping)

    def attend(self, q, k, v, meta, scale) -> torch.Tensor:
        return kernels.paged_attention(q, k, v, self.k, self.v, meta, scale)


class StepBlocks:
    """The blocks this step reads and its renumbered metadata, computed once and shared by all layers."""

    __slots__ = ("meta", "used", "compact", "fused")

    def __init__(self) -> None:
        self.meta = self.used = self.compact = self.fused = None

    def of(self, meta, num_blocks: int):
        """(blocks to dequantize, their renumbered metadata, the fused kernel's arguments or None) of this
        step: the fused kernel takes the short queries where the step plan built `meta` for it."""
        if self.meta is not meta:
            self.used, self.compact, self.fused = compact_metadata(meta, num_blocks,
                                                                   meta.fused_short is not None)
            self.meta = meta
        return self.used, self.compact, self.fused


class Int8LayerKVCache:
    """One layer's int8 slice of the pool: quantizes in `write`; attends with the fused kernel or over
    dequantized blocks."""

    __slots__ = ("k", "v", "k_scale", "v_scale", "dtype", "step", "flat")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, step: StepBlocks,
                 flat: bool) -> None:
        self.k, self.v = (kv_zeros(shape, torch.int8, device) for _ in range(2))
        self.k_scale, self.v_scale = (kv_zeros(shape[:3], SCALE_DTYPE, device) for _ in range(2))
        self.dtype, self.step, self.flat = dtype, step, flat

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.flat:
            device_path.store_kv(self.k, self.v, k, v, slot_mapping, self.k_scale, self.v_scale)
            return
        write_kv_int8(self.k, self.k_scale, k, slot_mapping)
        write_kv_int8(self.v, self.v_scale, v, slot_mapping)

    def attend(self, q, k, v, meta, scale) -> torch.Tensor:
        if isinstance(meta, kernels.FlatMetadata):
            return device_path.attention(q, self.k, self.v, meta, scale, self.k_scale, self.v_scale)
        used, compact, fused = self.step.of(meta, self.k.shape[1])
        if compact.short_groups or compact.long_seqs:
            keys = dequantize_blocks(self.k, self.k_scale, used, q.dtype)
            vals = dequantize_blocks(self.v, self.v_scale, used, q.dtype)
            out = kernels.paged_attention(q, k, v, keys, vals, compact, scale)
        else:  # a decode/verify-only step: the kernel writes every row
            out = torch.empty_like(q)
        if fused is not None:
            paged_attention_cpu(q, self.k, self.v, out, *fused, scale, self.k_scale, self.v_scale)
        return out


def layer_caches(c: KVShape, num_blocks: int, block_size: int, kv_dtype: torch.dtype, dtype: torch.dtype,
                 device: torch.device, flat: bool = False) -> list[LayerKVCache] | list[Int8LayerKVCache]:
    """The pool: one cache per layer of `num_blocks` blocks; an int8 pool attends in the model's `dtype`;
    `flat`: the step plan's layout (kernels.dispatch.StepPlan.flat)."""
    shape = (c.num_kv_heads, num_blocks, block_size, c.head_dim)
    if kv_dtype == torch.int8:
        step = StepBlocks()  # shared by the layers: a step's blocks are found once
        return [Int8LayerKVCache(shape, dtype, device, step, flat) for _ in range(c.num_layers)]
    return [LayerKVCache(kv_zeros(shape, kv_dtype, device), kv_zeros(shape, kv_dtype, device), flat)
            for _ in range(c.num_layers)]
