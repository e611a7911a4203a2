"""Grouped low-rank products for LoRA adapters (the SGMV idea of Punica and S-LoRA): the tokens of one step
grouped by adapter slot, each group's shrink (x·Aᵀ) and expand (·Bᵀ) added onto the base projection's output.

`groups` is the step's mapping, computed once per step (engine.lora): per slot in use, the flat token rows
that carry it, as a slice where they are contiguous, else an index tensor. A slot's A is [rank rows, in] and
its B [out, rank rows] with the scaling folded in; zero rows of a smaller rank add exact zeros.
"""

from __future__ import annotations

import torch

from sluice.kernels.device_path import triton_on

Rows = slice | torch.Tensor


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: list[tuple[int, Rows]], token_slots: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, out] += per group, x[rows] · a[slot]ᵀ · b[slot]ᵀ; a [slots, R, in], b [slots, out, R]. Returns y.
    On CUDA with triton, one pass per token over `token_slots` (each flat token's slot, -1: none)."""
    if token_slots is not None and x.is_cuda and triton_on(x.device):
        from sluice.kernels.triton.lora_bgmv import triton_add_lora

        return triton_add_lora(y, x.contiguous(), a, b, token_slots)
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
