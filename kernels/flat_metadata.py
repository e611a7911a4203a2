"""The device path's step layout: int32 per-sequence tensors every kernel reads, with no host round trips.

Sequence b owns flat tokens [query_start[b], query_start[b] + query_len[b]); its keys live at positions
[0, seq_len[b]) of the blocks in block_tables[b]; query row i sits at position seq_len - query_len + i.
Padding sequences (query_len 1, seq_len 0, slot -1) give every padded token an owner whose output is zero,
so a batch padded to a fixed size keeps fixed shapes (CUDA graphs replay it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    want = max(1, min(16, 256 // max(1, num_seqs * num_kv_heads), longest_context // 256))
    return 1 << (want.bit_length() - 1)  # a power of two, as the Triton kernel's merge requires


def build_flat_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                        slot_mapping: list[int], device: torch.device, num_kv_heads: int,
                        num_splits: int | None = None) -> FlatMetadata:
    """One step's FlatMetadata on `device` from host lists, in buffers of its own (tests and one-off
    calls)."""
    assert len(query_lens) == len(context_lens) == len(block_tables)
    tokens, width = len(slot_mapping), max((len(t) for t in block_tables), default=1) or 1
    buffers = StepBuffers(tokens, len(query_lens), width, device)
    return buffers.load([0] * tokens, [0] * tokens, slot_mapping, [], query_lens, context_lens, block_tables,
                        num_kv_heads, num_splits=num_splits)[2]


class StepBuffers:
    """Persistent inputs of device-path steps: host buffers (pinned on CUDA) filled in place each step, then
    one non-blocking copy per field into static device tensors whose addresses never change (CUDA graphs
    replay on them). Off CUDA the host buffers are the device tensors and nothing is copied.

    The host buffers are rewritten only once the previous step's copies out of them are done: an event
    recorded after them is queried first (a step that sampled already waited for it) and waited on only when
    still pending (a step of prefill chunks that sampled nothing).
    """

    LONG = ("input_ids", "positions", "slot_mapping", "logits_index")
    INT32 = ("token_seq", "query_start", "query_len", "seq_len", "tile_seq", "tile_q0")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        tokens, seqs = max(max_tokens, max_seqs), max_seqs
        sizes = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens, "logits_index": tokens,
                 "token_seq": tokens, "query_start": seqs, "query_len": seqs, "seq_len": seqs,
                 "tile_seq": tokens + seqs, "tile_q0": tokens + seqs}
        pin = device.type == "cuda"
        self.host = {name: torch.zeros(n, dtype=torch.long if name in self.LONG else torch.int32,
                                       pin_memory=pin)
                     for name, n in sizes.items()}
        self.host["block_tables"] = torch.zeros(seqs, max(1, max_blocks_per_seq), dtype=torch.int32,
                                                pin_memory=pin)
        self.view = {name: t.numpy() for name, t in self.host.items()}
        self.dev = self.host if device.type == "cpu" else {n: torch.zeros_like(t, device=device)
                                                            for n, t in self.host.items()}
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def max_seqs(self) -> int:
        return self.host["query_len"].shape[0]

    def load(self, ids: list[int], positions: list[int], slots: list[int], logits_index: list[int],
             query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], num_kv_heads: int,
             pad_to: int | None = None,
             num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, FlatMetadata, torch.Tensor]:
        """(input ids, positions, FlatMetadata, logits index) on the device for one step.

        `pad_to` pads a pure-decode step to that many sequences (query length 1, seq_len 0, slot -1: rows that
        come out as zeros) with fixed-size views and the full block-table width, as a CUDA graph needs.
        """
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()
        n, s = len(ids), len(query_lens)
        if pad_to is not None:
            assert n == s and all(q == 1 for q in query_lens) and s <= pad_to <= self.max_seqs
            n = s = pad_to
        width = max((len(t) for t in block_tables), default=1) or 1
        fits = s <= self.max_seqs and width <= self.view["block_tables"].shape[1]
        assert fits, "step larger than the buffers"
        self._fill_tokens(ids, positions, slots, n)
        self._fill_sequences(query_lens, context_lens, block_tables, s, n)
        seq, q0, block_q = tiles(self.view["query_len"][:s].tolist())
        nt = len(seq)
        self.view["tile_seq"][:nt], self.view["tile_q0"][:nt] = seq, q0
        rows = self._fill_logits_index(logits_index, n if pad_to is not None else None)
        self._copy_to_device({"input_ids": n, "positions": n, "slot_mapping": n, "logits_index": rows,
                              "token_seq": n, "query_start": s, "query_len": s, "seq_len": s, "tile_seq": nt,
                              "tile_q0": nt, "block_tables": s})
        longest = int(self.view["seq_len"][:s].max(initial=0))
        splits = num_splits or default_splits(s, num_kv_heads, longest, block_q)
        return self.views(n, s, nt, rows, None if pad_to else width, block_q, splits)

    def _fill_tokens(self, ids: list[int], positions: list[int], slots: list[int], n: int) -> None:
        """The per-token host buffers' first n entries: the real tokens, then padding (id 0, slot -1)."""
        v, real = self.view, len(ids)
        v["input_ids"][:real], v["positions"][:real], v["slot_mapping"][:real] = ids, positions, slots
        v["input_ids"][real:n], v["positions"][real:n], v["slot_mapping"][real:n] = 0, 0, -1

    def _fill_sequences(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                        s: int, n: int) -> None:
        """The per-sequence host buffers' first s entries (padding sequences: query length 1, seq_len 0)."""
        v = self.view
        v["query_len"][:s] = 1
        v["query_len"][: len(query_lens)] = query_lens
        v["seq_len"][:s] = 0
        v["seq_len"][: len(context_lens)] = context_lens
        starts = np.cumsum(v["query_len"][:s]) - v["query_len"][:s]
        v["query_start"][:s] = starts
        v["token_seq"][:n] = np.repeat(np.arange(s, dtype=np.int32), v["query_len"][:s])
        for row, table in enumerate(block_tables):
            v["block_tables"][row, : len(table)] = table

    def _fill_logits_index(self, logits_index: list[int], padded: int | None) -> int:
        """The logits index host buffer (every row of a padded step); returns its length."""
        if padded is not None:
            self.view["logits_index"][:padded] = np.arange(padded)
            return padded
        self.view["logits_index"][: len(logits_index)] = logits_index
        return len(logits_index)

    def _copy_to_device(self, counts: dict[str, int]) -> None:
        """Non-blocking copies of each host buffer's first `counts[name]` entries, then the event recorded."""
        if self.dev is self.host:
            return
        for name, count in counts.items():
            self.dev[name][:count].copy_(self.host[name][:count], non_blocking=True)
        self.copied.record()

    def views(self, tokens: int, seqs: int, num_tiles: int, rows: int, width: int | None, block_q: int,
              num_splits: int) -> tuple[torch.Tensor, torch.Tensor, FlatMetadata, torch.Tensor]:
        """The device buffers' leading parts as one step's inputs (nothing is copied; a CUDA graph captures
        these views once); width None: the full block-table width."""
        d, n, s, nt = self.dev, tokens, seqs, num_tiles
        meta = FlatMetadata(
            slot_mapping=d["slot_mapping"][:n], query_start=d["query_start"][:s],
            query_len=d["query_len"][:s],
            seq_len=d["seq_len"][:s], block_tables=d["block_tables"][:s, :width],
            token_seq=d["token_seq"][:n], tile_seq=d["tile_seq"][:nt], tile_q0=d["tile_q0"][:nt],
            block_q=block_q, num_splits=num_splits,
        )
        return d["input_ids"][:n], d["positions"][:n], meta, d["logits_index"][:rows]
