"""Int8 KV cache helpers: per-token, per-head absmax scales; dequantize only the blocks a step attends to.

The int8 pool is [Hkv, blocks, block, D] with fp16 scales [Hkv, blocks, block]. On CPU the fused kernel reads
the int8 blocks of short queries (decode, verify) itself; everything else runs the plain torch paged attention
over a small dequantized copy of the blocks it reads, with its block tables renumbered into that copy.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from sluice.kernels.attention import AttentionMetadata, ShortGroup
from sluice.kernels.int8_heads import SCALE_DTYPE, quantize_heads

__all__ = ["SCALE_DTYPE", "compact_metadata", "dequantize_blocks", "fused_args", "quantize_heads",
           "write_kv_int8"]


def write_kv_int8(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
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


def fused_args(groups: list[ShortGroup]) -> tuple[torch.Tensor, ...]:
    """The fused kernel's (query starts, query lens, contexts, block tables) of the sequences in padded
    groups."""
    starts, lens, ctxs, tables = [], [], [], []
    for g in groups:
        rows = torch.arange(g.valid.shape[0], device=g.valid.device)
        qlen = g.valid.sum(1)
        starts.append(g.token_index[:, 0])
        lens.append(qlen)
        ctxs.append(g.mask[0, rows, qlen - 1, 0].sum(-1))  # the last query sees its whole context
        tables.append(g.block_index.view(len(rows), -1))
    width = max(t.shape[1] for t in tables)
    padded = [F.pad(t, (0, width - t.shape[1])) for t in tables]
    return torch.cat(starts), torch.cat(lens), torch.cat(ctxs), torch.cat(padded)


def compact_metadata(meta: AttentionMetadata, num_blocks: int,
                     fused: bool = False) -> tuple[torch.Tensor, AttentionMetadata,
                                                   tuple[torch.Tensor, ...] | None]:
    """The blocks the torch path reads, its metadata renumbered into them, and the fused kernel's arguments.

    With `fused`, short queries go to the fused kernel (their `fused_short` arguments, or ones derived from
    their padded groups) and the torch path keeps only the long ones; without, the torch path takes them all.
    """
    assert fused or meta.fused_short is None, "fused short-query arguments need the fused kernel"
    short = meta.fused_short if meta.fused_short is not None else (
        fused_args(meta.short_groups) if fused and meta.short_groups else None)
    groups = [] if fused else meta.short_groups
    cached = [s for s in meta.long_seqs if s.context_len != s.query_len]
    tables = [g.block_index for g in groups] + [s.block_table for s in cached]
    device = meta.slot_mapping.device
    used = torch.unique(torch.cat(tables)) if tables else torch.zeros(0, dtype=torch.long, device=device)
    lookup = torch.zeros(num_blocks, dtype=torch.long, device=device)
    lookup[used] = torch.arange(len(used), device=device)
    compact = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        short_groups=[replace(g, block_index=lookup[g.block_index]) for g in groups],
        long_seqs=[replace(s, block_table=lookup[s.block_table]) if s.context_len != s.query_len else s
                   for s in meta.long_seqs],
    )
    return used, compact, short
