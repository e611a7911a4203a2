"""The int8 KV cache: int8 keys/values with a per-token, per-head fp16 scale, dequantized inside attention.

On CPU, short queries (decode, verify) run the fused kernel, which reads the int8 blocks and their scales
itself; prefill, and every query where the kernel is off or unbuilt, attends over a dequantized copy.
"""

from __future__ import annotations

import torch

from sluice import kernels
from sluice.engine.kv_memory import kv_zeros
from sluice.engine.models.llama import ModelConfig
from sluice.kernels import device_path
from sluice.kernels.cpu_attention import paged_attention_cpu
from sluice.kernels.dispatch import fused_int8_attention
from sluice.kernels.kv_int8 import SCALE_DTYPE, compact_metadata, dequantize_blocks, write_kv_int8


def kv_token_bytes(c: ModelConfig) -> int:
    """Bytes one token's int8 keys and values take across all layers, scales included."""
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * c.num_layers * c.num_kv_heads * (c.head_dim + scale)


class StepBlocks:
    """The blocks this step reads and its renumbered metadata, computed once and shared by all layers."""

    __slots__ = ("meta", "used", "compact", "fused")

    def __init__(self) -> None:
        self.meta = self.used = self.compact = self.fused = None

    def of(self, meta, num_blocks: int, device: torch.device):
        """(blocks to dequantize, their renumbered metadata, the fused kernel's arguments or None) of this step."""
        if self.meta is not meta:
            fused = fused_int8_attention(device)
            self.used, self.compact, self.fused = compact_metadata(meta, num_blocks, fused)
            self.meta = meta
        return self.used, self.compact, self.fused


class Int8LayerKVCache:
    """One layer's int8 slice of the pool: quantizes in `write`; attends with the fused kernel or over
    dequantized blocks."""

    __slots__ = ("k", "v", "k_scale", "v_scale", "dtype", "step")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, step: StepBlocks) -> None:
        self.k, self.v = (kv_zeros(shape, torch.int8, device) for _ in range(2))
        self.k_scale, self.v_scale = (kv_zeros(shape[:3], SCALE_DTYPE, device) for _ in range(2))
        self.dtype, self.step = dtype, step

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if kernels.flat_layout(self.k.device):
            device_path.store_kv(self.k, self.v, k, v, slot_mapping, self.k_scale, self.v_scale)
            return
        write_kv_int8(self.k, self.k_scale, k, slot_mapping)
        write_kv_int8(self.v, self.v_scale, v, slot_mapping)

    def attend(self, q, k, v, meta, scale) -> torch.Tensor:
        if isinstance(meta, kernels.FlatMetadata):
            return device_path.attention(q, self.k, self.v, meta, scale, self.k_scale, self.v_scale)
        used, compact, fused = self.step.of(meta, self.k.shape[1], q.device)
        if compact.short_groups or compact.long_seqs:
            keys = dequantize_blocks(self.k, self.k_scale, used, q.dtype)
            vals = dequantize_blocks(self.v, self.v_scale, used, q.dtype)
            out = kernels.paged_attention(q, k, v, keys, vals, compact, scale)
        else:  # a decode/verify-only step: the kernel writes every row
            out = torch.empty_like(q)
        if fused is not None:
            paged_attention_cpu(q, self.k, self.v, out, *fused, scale, self.k_scale, self.v_scale)
        return out


def int8_kv_cache(dtype: torch.dtype):
    """A ModelRunner cache_factory making int8 layer caches that attend in `dtype`."""
    step = StepBlocks()

    def factory(num_blocks: int, block_size: int, c: ModelConfig, kv_dtype, device) -> Int8LayerKVCache:
        assert kv_dtype == torch.int8
        return Int8LayerKVCache((c.num_kv_heads, num_blocks, block_size, c.head_dim), dtype, device, step)

    return factory
