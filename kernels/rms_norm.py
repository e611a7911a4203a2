"""Residual add + RMSNorm: one fused C++ pass on CPU (csrc/rms_norm.cpp, built on first use), torch elsewhere.

Both round like HF's LlamaRMSNorm (the sum in the activations' dtype, the normalised row cast to it before the
weight multiplies), so the fused kernel only changes the order of the fp32 sum of squares.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpp_build


def fused_available() -> bool:
    """True when the C++ kernel is enabled (SLUICE_CPU_KERNEL != 0) and built."""
    return cpp_build.enabled() and cpp_build.part("rms_norm") is not None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
            and fused_available())


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)); with delta None, (x, RMSNorm(x))."""
    if _fused(x, weight):
        s, out = cpp_build.part("rms_norm").add_rms_norm(x, delta, weight, eps)
        return s, out
    s = x if delta is None else x + delta
    return s, rms_norm_reference(s, weight, eps)
