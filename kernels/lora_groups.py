"""Grouped low-rank products for LoRA adapters (the SGMV idea of Punica and S-LoRA): the tokens of one step
grouped by adapter slot, each group's shrink (x·Aᵀ) and expand (·Bᵀ) added onto the base projection's output.

`groups` is the step's mapping, computed once per step (engine.lora): per slot in use, the flat token rows
that carry it, as a slice where they are contiguous, else an index tensor. A slot's A is [rank rows, in] and
its B [out, rank rows] with the scaling folded in; zero rows of a smaller rank add exact zeros. On CPU the C++
kernel (csrc/lora.cpp, one object per ISA tier) runs bf16 and fp32 over the step's `LoraMapping`, the same
call the decode stack makes after its linears; on CUDA with triton, kernels/triton/lora_bgmv.py; else torch
per group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.kernels import cpp_build
from sluice.kernels.device_path import triton_on

Rows = slice | torch.Tensor
CPP_DTYPES = (torch.bfloat16, torch.float32)


def cpu_kernel():
    """csrc/lora.cpp's functions for the chosen tier (`lora_add`, `lora_add_mapped`, `LoraMapping`), or None
    where the C++ kernels are off (SLUICE_CPU_KERNEL=0) or do not build."""
    return cpp_build.part("lora") if cpp_build.enabled() else None


def cpp_serves(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the C++ kernel takes these tensors: CPU, one dtype of CPP_DTYPES, contiguous rows, weights."""
    return (x.device.type == "cpu" and x.dtype in CPP_DTYPES and x.dtype == y.dtype == a.dtype == b.dtype
            and x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous())


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: list[tuple[int, Rows]], token_slots: torch.Tensor | None = None, mapping=None,
             out_splits: Sequence[int] = ()) -> torch.Tensor:
    """y [T, out] += per group, x[rows] · a[slot]ᵀ · b[slot]ᵀ; a [slots, R, in], b [slots, out, R]. Returns y.
    On CUDA with triton, one pass per token over `token_slots` (each flat token's slot, -1: none); on CPU the
    C++ kernel over `mapping` (the step's LoraMapping of `cpu_kernel()`), reading only each part's own rank
    columns of a fused projection (`out_splits`: the parts' output rows)."""
    if token_slots is not None and x.is_cuda and triton_on(x.device):
        from sluice.kernels.triton.lora_bgmv import triton_add_lora

        return triton_add_lora(y, x.contiguous(), a, b, token_slots)
    if mapping is not None and cpp_serves(y, x, a, b):
        return cpu_kernel().lora_add_mapped(y, x, a, b, mapping, 1.0, list(out_splits))
    for slot, rows in groups:
        if isinstance(rows, slice):
            y[rows] += (x[rows] @ a[slot].T) @ b[slot].T
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)
    return y


def token_groups(token_slots: list[int], device: torch.device) -> list[tuple[int, Rows]]:
    """The step's groups from each flat token's slot (-1: the base model, no group)."""
    rows: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s >= 0:
            rows.setdefault(s, []).append(t)
    groups: list[tuple[int, Rows]] = []
    for s, idx in rows.items():
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((s, slice(idx[0], idx[-1] + 1)))
        else:
            groups.append((s, torch.tensor(idx, dtype=torch.long, device=device)))
    return groups
