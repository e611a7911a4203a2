"""Unquantized linears: on CPU a bf16 GEMV of ours for a few rows (csrc/bf16_gemv.cpp), F.linear elsewhere.

At the row counts of decode (one to a few tokens per step) a linear only streams its weight, and oneDNN's bf16
matmul reads it at about half the memory bandwidth that a plain AVX512-BF16 pass reaches; past
`MAX_GEMV_ROWS` rows, and on any other device or dtype, F.linear serves.
Sums are fp32 in a different order than oneDNN's, then rounded to bf16 as it does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpp_build

MAX_GEMV_ROWS = 16  # measured on CPU, five shapes: 1.4-2.8x oneDNN's bf16 matmul at 1-4 rows, 1.2-1.6x at 8-12, 1.0-1.4x at 16, par at 32


def _gemv():
    ext = cpp_build.load("sluice_bf16_gemv_cpu", "bf16_gemv.cpp") if cpp_build.enabled() else None
    return ext if ext is not None and ext.SUPPORTED else None


def gemv_available() -> bool:
    """True when the C++ bf16 GEMV is enabled (SLUICE_CPU_KERNEL != 0), built, and the CPU has avx512_bf16."""
    return _gemv() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] · weight [out, in]ᵀ (+ bias), as F.linear. (Checks ordered cheapest-first and the extension
    resolved once: this runs ~50 times a decode step.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if (1 <= rows.shape[0] <= MAX_GEMV_ROWS and rows.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16
            and rows.device.type == "cpu" and (bias is None or bias.dtype is torch.bfloat16)
            and rows.stride(-1) == 1 and weight.is_contiguous() and not torch.is_grad_enabled()):
        ext = _gemv()
        if ext is not None:
            bias = None if bias is None else bias.contiguous()
            y = ext.bf16_gemv(rows, weight, bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, state dict and repr)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
