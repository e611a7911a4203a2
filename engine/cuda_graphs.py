"""CUDA graphs for pure-decode steps: static step buffers, one graph per padded batch size, one memory pool.

Each captured size replays the whole forward (Triton KV store and attention over a FlatMetadata view of the
static buffers) with no host work but filling the buffers. A batch is padded up to the next captured size
with padding sequences (slot -1, seq_len 0), whose rows come out as zeros and are dropped. Without CUDA the
same padding runs eagerly (`capture=False`), which is how CPU tests check it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.flat_metadata import FlatMetadata, default_splits, padded_tables

SMALL_SIZES = (1, 2, 4, 8)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to 64 and of 32 above, ending at max_num_seqs."""
    sizes = [*SMALL_SIZES, *range(16, 65, 16), *range(96, max_num_seqs + 1, 32)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Padded decode steps over static buffers, replayed from CUDA graphs (or run eagerly off CUDA)."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        n, w = self.sizes[-1], max_blocks_per_seq
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_len = torch.zeros(n, **i32)
        self.block_tables = torch.zeros(n, w, **i32)
        self.arange = torch.arange(n, **i32)
        self.ones, self.zeros = torch.ones(n, **i32), torch.zeros(n, **i32)
        self.host = {name: torch.zeros(getattr(self, name).shape, dtype=getattr(self, name).dtype,
                                       pin_memory=device.type == "cuda")
                     for name in ("input_ids", "positions", "slot_mapping", "seq_len", "block_tables")}
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        self.pool = None
        for size in reversed(self.sizes):
            self.runs[size] = self._capture(size) if capture else (lambda s=size: self._forward(s))

    def _meta(self, n: int) -> FlatMetadata:
        c = self.model.config
        splits = default_splits(n, c.num_kv_heads, self.block_tables.shape[1] * self.kv_block_size(), 1)
        return FlatMetadata(self.slot_mapping[:n], self.arange[:n], self.ones[:n], self.seq_len[:n],
                            self.block_tables[:n], self.arange[:n], self.arange[:n], self.zeros[:n],
                            block_q=1, num_splits=splits)

    def kv_block_size(self) -> int:
        return self.kv_caches[0].k.shape[2]

    def _forward(self, n: int) -> torch.Tensor:
        return self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, self._meta(n), self.arange[:n])

    def _capture(self, n: int) -> Callable[[], torch.Tensor]:
        self._forward(n)  # warm-up: compiles the Triton kernels outside the capture (all slots -1: no writes)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(n)
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def fits(self, num_new_tokens: list[int]) -> bool:
        """Whether a step is pure decode (one new token per sequence) within the largest captured size."""
        return 0 < len(num_new_tokens) <= self.sizes[-1] and all(n == 1 for n in num_new_tokens)

    def run(self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Logits [len(ids), vocab] of one decode step, replayed at the next captured size."""
        size = self.load(ids, positions, slots, context_lens, tables)
        return self.runs[size]()[: len(ids)]

    def load(self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
             tables: list[list[int]]) -> int:
        """Fill the static buffers with one decode step padded to the next captured size; return that size."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        h = self.host
        h["input_ids"][:n] = torch.tensor(ids)
        h["positions"][:n] = torch.tensor(positions)
        h["slot_mapping"][:n] = torch.tensor(slots)
        h["slot_mapping"][n:size] = -1
        h["seq_len"][:n] = torch.tensor(context_lens, dtype=torch.int32)
        h["seq_len"][n:size] = 0
        width = max(len(t) for t in tables)
        assert width <= h["block_tables"].shape[1], "block table wider than max_model_len allows"
        h["block_tables"][:n, :width] = padded_tables(tables, width)
        for name, host in h.items():
            getattr(self, name)[:size].copy_(host[:size], non_blocking=True)
        return size
