"""The device path's step layout: int32 per-sequence tensors every kernel reads, with no host round trips.

Sequence b owns flat tokens [query_start[b], query_start[b] + query_len[b]); its keys live at positions
[0, seq_len[b]) of the blocks in block_tables[b]; query row i sits at position seq_len - query_len + i.
Padding sequences (query_len 1, seq_len 0, slot -1) give every padded token an owner whose output is zero,
so a batch padded to a fixed size keeps fixed shapes (CUDA graphs replay it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_DECODE_QUERY = 16
PREFILL_TILE = 16


@dataclass(slots=True)
class FlatMetadata:
    """Per-step layout of the flat token batch against the paged KV cache, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    query_start: torch.Tensor  # [B] int32
    query_len: torch.Tensor  # [B] int32
    seq_len: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    token_seq: torch.Tensor  # [T] int32, the sequence owning each flat token
    tile_seq: torch.Tensor  # [tiles] int32, the sequence of each attention program's query tile
    tile_q0: torch.Tensor  # [tiles] int32, its first query row
    block_q: int  # query rows per tile (power of two)
    num_splits: int  # key/value splits per tile, merged by log-sum-exp


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(0, n - 1).bit_length()


def tiles(query_lens: list[int]) -> tuple[list[int], list[int], int]:
    """Query tiles (sequence, first row) and rows per tile: one tile per sequence while all are short."""
    longest = max(query_lens, default=1)
    block_q = next_power_of_2(longest) if longest <= MAX_DECODE_QUERY else PREFILL_TILE
    seq, q0 = [], []
    for b, q in enumerate(query_lens):
        for start in range(0, max(q, 1), block_q):
            seq.append(b)
            q0.append(start)
    return seq, q0, block_q


def default_splits(num_seqs: int, num_kv_heads: int, longest_context: int, block_q: int) -> int:
    """Enough key/value splits to give a GPU ~256 programs when the batch alone does not."""
    if block_q > MAX_DECODE_QUERY or longest_context <= 256:
        return 1
    return max(1, min(16, 256 // max(1, num_seqs * num_kv_heads), longest_context // 256))


def padded_tables(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables as one int32 [len, width] tensor, zero-padded (entries past seq_len are never read)."""
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32).view(-1, width)


def build_flat_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                        slot_mapping: list[int], device: torch.device, num_kv_heads: int,
                        num_splits: int | None = None) -> FlatMetadata:
    """Host lists to a FlatMetadata on `device` (int32, one copy per tensor)."""
    assert len(query_lens) == len(context_lens) == len(block_tables)
    tables = padded_tables(block_tables, max((len(t) for t in block_tables), default=1) or 1)
    starts = [0]
    for q in query_lens[:-1]:
        starts.append(starts[-1] + q)
    owner = [b for b, q in enumerate(query_lens) for _ in range(q)]
    seq, q0, block_q = tiles(query_lens)
    splits = num_splits or default_splits(len(query_lens), num_kv_heads, max(context_lens, default=0), block_q)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return FlatMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(device, non_blocking=True),
        query_start=i32(starts), query_len=i32(query_lens), seq_len=i32(context_lens),
        block_tables=tables.to(device, non_blocking=True), token_seq=i32(owner), tile_seq=i32(seq),
        tile_q0=i32(q0), block_q=block_q, num_splits=splits,
    )
