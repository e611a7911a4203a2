"""bitsandbytes' 4-bit weights (NF4 / FP4, blocks of 64 values along a row) multiplied on CPU by our kernels,
in bitsandbytes' own serialized layout (csrc/nf4.cpp): codes [out, in / 2] uint8, two a byte, the even column
in the high nibble; absmax [out, in / 64] bf16; the 16-value code table (fp32).

Below `TILE_MIN_ROWS` rows (decode and prefill chunks) the tier's product (nf4_avx512.h, nf4_avx2.h,
nf4_generic.h: a table lookup per code, fp32 FMAs, x rows a few at a time); from there, tiles of weight rows
dequantized to the activations' dtype and multiplied by oneDNN, faster at many rows but holding oneDNN's
per-shape state and allocations (a 40-prompt batch left the process more resident: docs/benchmarks.md).
Without the C++ kernels (none built, SLUICE_CPU_KERNEL=0) the weight is dequantized by torch ops
(`dequantize`: the reference the kernels are tested against) for F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build

BLOCK = 64
TILE_MIN_ROWS = 4096  # rows from which the tiles serve (docs/benchmarks.md: resident memory after a batch)
TILE_BYTES = 4 << 20  # dequantized scratch per tile, as int4_weights' tiles


def kernel():
    """The C++ kernels (csrc/nf4.cpp, built for this process's tier: a part of the core library), or None
    where they do not build."""
    return cpp_build.part("nf4") if cpp_build.enabled() else None


def shape_error(out_features: int, in_features: int) -> str | None:
    """Why a weight of this shape cannot be multiplied here, or None."""
    if in_features % BLOCK:
        return f"in_features {in_features} is not a multiple of the block size {BLOCK}"
    return None


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype`: table[code] * absmax in fp32, rounded once (torch ops, any device)."""
    n = codes.shape[0]
    idx = torch.stack((codes >> 4, codes & 15), -1).view(n, -1).long()
    values = table[idx].view(n, -1, BLOCK) * absmax.float().view(n, -1, 1)
    return values.view(n, -1).to(dtype)


def nf4_linear(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the 4-bit weight [out, in], plus bias, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    ext = kernel() if x.device.type == "cpu" else None
    if ext is None:
        y = F.linear(rows, dequantize(codes, absmax, table, x.dtype), bias)
    elif 0 < rows.shape[0] < TILE_MIN_ROWS:
        y = ext.nf4_gemv(rows.contiguous(), codes, absmax, table, bias)
    else:
        y = ext.nf4_tile_mm(rows.contiguous(), codes, absmax, table, bias, TILE_BYTES)
    return y.view(*x.shape[:-1], codes.shape[0])
