"""The engine's memory housekeeping: the weights' huge pages and the C heap, paced around the steps.

At load the 4-bit linears are packed for the CPU kernels and the heap's freed pages go back; around each step
the weight arenas (engine.weight_memory) pace their huge-page collapse while there is work, settle after the first
step (loading, the KV pool and the first step's lazy set-up never share the cores with it), and once the engine
drains the heap is trimmed (engine.heap) and the collapse goes on unpaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sluice.engine import heap
from sluice.engine.quantization import pack_4bit_for_cpu


class MemoryHousekeeping:
    """What the engine's memory needs at load and around each step, for its models on one device."""

    def __init__(self, models: list[torch.nn.Module], device: torch.device) -> None:
        self.cpu = device.type == "cpu"
        if self.cpu:
            for m in models:
                pack_4bit_for_cpu(m)  # at load: the 4-bit linears' bf16 absmax, bitsandbytes' state freed
            heap.trim()  # the load's freed originals (full-precision weights, 4-bit states) go back now
        self.arenas = [m.weight_arena for m in models if hasattr(m, "weight_arena")]
        self._unsettled = list(self.arenas)

    @contextmanager
    def step(self, has_work: bool, drained: Callable[[], bool]) -> Iterator[None]:
        """Around one step: arenas paced while it has work, settled after the first that ran; the heap trimmed
        and the arenas unpaced once `drained()` says nothing is left."""
        if has_work:
            for arena in self.arenas:
                arena.busy()
        yield
        if has_work:
            for arena in self._unsettled:
                arena.settle()
            self._unsettled = []
        if drained():
            if has_work and self.cpu:
                heap.trim()  # the step's temporaries are gone, their pages go back to the OS
            for arena in self.arenas:
                arena.idle()
