"""CUDA graphs for pure-decode steps: static step buffers, one graph per padded batch size, one memory pool.

Each captured size replays the whole forward (Triton KV store and attention over a FlatMetadata view of the
static buffers) with no host work but filling the buffers. A batch is padded up to the next captured size
with padding sequences (slot -1, seq_len 0), whose rows come out as zeros and are dropped. Without CUDA the
same padding runs eagerly (`capture=False`), which is how CPU tests check it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.kernels.flat_metadata import StepBuffers, default_splits

SMALL_SIZES = (1, 2, 4, 8)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to 64 and of 32 above, ending at max_num_seqs."""
    sizes = [*SMALL_SIZES, *range(16, 65, 16), *range(96, max_num_seqs + 1, 32)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Padded decode steps over static buffers, replayed from CUDA graphs (or run eagerly off CUDA)."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture: bool = True, buffers: StepBuffers | None = None) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = buffers or StepBuffers(max_num_seqs, max_num_seqs, max_blocks_per_seq, device)
        width = self.buffers.host["block_tables"].shape[1]
        self.splits = {n: default_splits(n, model.config.num_kv_heads, width * self.kv_block_size(), 1)
                       for n in self.sizes}
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        self.pool = None
        for size in reversed(self.sizes):
            self.runs[size] = self._capture(size) if capture else (lambda s=size: self._forward(s))

    def kv_block_size(self) -> int:
        return self.kv_caches[0].k.shape[2]

    def _inputs(self, n: int, ids=(), positions=(), slots=(), context_lens=(), tables=()) -> None:
        """Fill the static buffers with a decode step padded to n sequences."""
        k = len(ids)
        self.buffers.load(list(ids), list(positions), list(slots), [], [1] * k, list(context_lens),
                          list(tables), self.model.config.num_kv_heads, pad_to=n, num_splits=self.splits[n])

    def _forward(self, n: int) -> torch.Tensor:
        ids, positions, meta, rows = self.buffers.views(n, n, n, n, None, 1, self.splits[n])
        return self.model(ids, positions, self.kv_caches, meta, rows)

    def _capture(self, n: int) -> Callable[[], torch.Tensor]:
        self._inputs(n)  # all padding (slot -1: the capture writes nothing)
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
        size = next(s for s in self.sizes if s >= len(ids))
        self._inputs(size, ids, positions, slots, context_lens, tables)
        return size
