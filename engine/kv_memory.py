"""KV pool storage that costs nothing until it is used.

`torch.zeros` of a multi-GiB pool writes every page at start-up (seconds on a VM whose host backs guest
memory lazily) and commits memory that short requests never reach. On CPU the pool is a private anonymous
memory map instead: the kernel hands out a zero page on first touch, so the pool reads exactly as
`torch.zeros` (no garbage a masked attention slot could turn into NaN) while start-up touches nothing. No
`MADV_HUGEPAGE`: with the usual `defrag=madvise` every 2 MB fault compacts memory synchronously (4 ms a fault
measured here, 9x the 4 KB faults it replaces). Elsewhere the pool is `torch.zeros` (a device memset is fast).
"""

from __future__ import annotations

import mmap

import torch


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
