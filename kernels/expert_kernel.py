"""Sparse MoE experts on CPU in one C++ call per layer (csrc/moe.cpp): the (token, slot) pairs of a top-k
routing grouped by expert in C++, each expert's rows streamed once for all of its tokens, fp32 sums; bf16
experts multiply as AMX tiles (csrc/moe_amx.h) where the tier has them and both widths are multiples of 32
(the holder's `amx`), else as `vdpbf16ps` or fp32 vector tiles; torch elsewhere.

`moe_reference` is the fp64 reference the kernel is tested against (tests/test_generic_models.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build

NAME, SOURCE = "sluice_moe_cpu", "moe.cpp"


def _ext():
    return cpp_build.load(NAME, SOURCE) if cpp_build.enabled() else None


def available() -> bool:
    """True when the C++ kernel is enabled (SLUICE_CPU_KERNEL != 0) and built."""
    return _ext() is not None


def experts(gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]):
    """The kernel's holder of every expert's weights ([I, H], [I, H], [H, I] each, one dtype), or None without
    the kernel; call it as `holder.forward(x [T, H], ids [T, k], weights [T, k])`; `holder.amx`: AMX tiles."""
    ext = _ext()
    if ext is None:
        return None
    return ext.Experts([w.contiguous() for w in gate], [w.contiguous() for w in up],
                       [w.contiguous() for w in down])


def bf16_hidden(holder) -> bool:
    """Whether the holder's tier rounds bf16 experts' silu(gate) * up to bf16 before the down product (its
    AVX512-BF16 / AMX products take bf16 pairs), as transformers' bf16 experts do."""
    return bool(type(holder).bf16_products)


def moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: list[torch.Tensor],
                  up: list[torch.Tensor], down: list[torch.Tensor],
                  hidden_dtype=torch.float64) -> torch.Tensor:
    """Each token's weighted sum over its experts' SwiGLU, computed in fp64 (the kernels' reference), each
    silu(gate) * up rounded to `hidden_dtype` before the down product."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist(), strict=True):
            h = F.silu(x64[t] @ gate[e].double().T) * (x64[t] @ up[e].double().T)
            out[t] += w * (h.to(hidden_dtype).double() @ down[e].double().T)
    return out
