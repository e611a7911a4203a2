"""Int8 KV cache helpers: per-token, per-head absmax scales; dequantize only the blocks a step attends to.

The int8 pool is [Hkv, blocks, block, D] with fp16 scales [Hkv, blocks, block]. Attention runs the plain
torch paged attention over a small dequantized copy of the blocks this step reads, with the step's block
tables renumbered into that copy, so the int8 path shares every line of the attention math.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels.attention import AttentionMetadata
from kernels.int8_heads import SCALE_DTYPE, quantize_heads

__all__ = ["SCALE_DTYPE", "compact_metadata", "dequantize_blocks", "quantize_heads", "write_kv_int8"]


def write_kv_int8(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's keys or values [T, Hkv, D] into their slots of the int8 cache and its scales."""
    hk, _, _, d = cache.shape
    q, s = quantize_heads(x.transpose(0, 1))
    cache.view(hk, -1, d).index_copy_(1, slot_mapping, q)
    scales.view(hk, -1).index_copy_(1, slot_mapping, s)


def dequantize_blocks(cache: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """The given blocks of an int8 cache as [Hkv, len(blocks), block, D] in `dtype`."""
    q = cache.index_select(1, blocks).to(dtype)
    return q.mul_(scales.index_select(1, blocks).to(dtype)[..., None])


def compact_metadata(meta: AttentionMetadata, num_blocks: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """The blocks a step reads from the cache, and its metadata with block tables renumbered into them."""
    assert getattr(meta, "fused_short", None) is None, "the int8 KV cache runs the torch attention path"
    cached = [s for s in meta.long_seqs if s.context_len != s.query_len]
    tables = [g.block_index for g in meta.short_groups] + [s.block_table for s in cached]
    device = meta.slot_mapping.device
    used = torch.unique(torch.cat(tables)) if tables else torch.zeros(0, dtype=torch.long, device=device)
    lookup = torch.zeros(num_blocks, dtype=torch.long, device=device)
    lookup[used] = torch.arange(len(used), device=device)
    compact = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        short_groups=[replace(g, block_index=lookup[g.block_index]) for g in meta.short_groups],
        long_seqs=[replace(s, block_table=lookup[s.block_table]) if s.context_len != s.query_len else s
                   for s in meta.long_seqs],
    )
    return used, compact
