"""Weight-only int8 matmul: int8 weights with one scale per output row, activations in the model dtype.

For a few rows (decode, a draft model's proposals) torch's CPU int8 GEMV reads half the bytes of a bf16
matmul and runs ~3x faster at one row. On CUDA with triton the W8A16 kernel (kernels/triton/w8a16.py) serves. Its cost grows linearly with the row count and it mis-computes unless
in_features % 16 == 0, so larger batches, odd shapes and other devices dequantize the weight and use the
ordinary matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.device_path import triton_on

MAX_GEMV_ROWS = 12  # measured on CPU (rows 2-16, four shapes): up to 12 the GEMV beats dequantizing
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_gemv(rows: torch.Tensor, qweight: torch.Tensor) -> bool:
    return (rows.device.type == "cpu" and rows.shape[0] <= MAX_GEMV_ROWS and rows.dtype in GEMV_DTYPES
            and qweight.shape[1] % 16 == 0)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the dequantized weight qweight [out, in] * scales [out] (x's dtype), plus bias."""
    rows = x.reshape(-1, x.shape[-1])
    if triton_on(rows.device):
        from kernels.triton.w8a16 import w8a16_linear

        return w8a16_linear(x, qweight, scales, bias)
    if _use_gemv(rows, qweight):
        y = torch._weight_int8pack_mm(rows.contiguous(), qweight, scales)
    else:
        y = F.linear(rows, qweight.to(x.dtype)) * scales
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], qweight.shape[0])
