"""LLM.int8() linears on CPU without bitsandbytes: bitsandbytes' Linear8bitLt (inference) computed by our
kernels.

The stored tensors are bitsandbytes' (int8 rows `weight` = CB [out, in], fp32 row absmax `SCB` [out]), and so
is the arithmetic, step by step as its CPU path runs it: the activations quantized per row as
`int8_vectorwise_quant(x.half(), threshold)` does (kernels.int8_weights.bnb_int8_act: outlier values zeroed,
the columns holding one zeroed where there are several rows), their exact int32 product with CB (our VNNI
kernel where it builds; the same sums as torch._int_mm), rescaled as `int8_mm_dequant` does (int32 * (row
absmax * SCB) * 1/127², plus bias, in fp32, rounded once to the activations' dtype: one C++ pass for bf16),
then the outlier columns' product added back. That one sums in float32 where bitsandbytes' default kernel
calls a bf16/fp16 `addmm`, for which oneDNN JIT-builds and caches one primitive per [tokens, outlier columns]
shape (milliseconds each, and hundreds of MiB resident after one batch of mixed lengths): for bf16 on x86
(AVX2 and up) one C++ pass (the products summed in column order, kernels.int8_weights.bnb_int8_outliers; the
decode stack runs the same pass), elsewhere the BLAS GEMM (no per-shape state kept). Its inputs are
bitsandbytes' (the outlier weight columns dequantized and rounded to the activations' dtype) and so is the
single rounding of `output + subA @ subB` to that dtype. On other devices bitsandbytes' own module serves.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.kernels import decode_stack, int8_weights

INV_127 = 7.874015718698502e-3  # bitsandbytes' int8_vectorwise_dequant factor


class LLMInt8Linear(nn.Module):
    """bitsandbytes' Linear8bitLt (LLM.int8(), no fp16 weights) on CPU: int8 rows `weight` [out, in] with fp32
    row absmax `SCB` [out]; activation columns with a value of magnitude >= `threshold` in higher
    precision."""

    def __init__(self, cb: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 threshold: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(cb, requires_grad=False)
        self.register_buffer("SCB", scb)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.threshold = threshold

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def stack_linear(self):
        """This linear for kernels.decode_stack, or None where the stack would not run it as `forward`
        does."""
        return decode_stack.llm_int8_stack_linear(self.weight, self.SCB, self.bias, self.threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = llm_int8_linear(rows, self.weight, self.SCB, self.bias, self.threshold)
        return y.view(*x.shape[:-1], self.weight.shape[0])


def llm_int8_linear(rows: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None,
                    threshold: float) -> torch.Tensor:
    """rows [M, in] times the LLM.int8() weight (cb [out, in] int8, scb [out] fp32), plus bias: bitsandbytes'
    Linear8bitLt forward on CPU, in rows' dtype."""
    ca, sca, cols = int8_weights.bnb_int8_act(rows, threshold)
    out = int8_weights.bnb_int8_dequant(int8_weights.exact_int8_mm(ca, cb), sca, scb, bias, rows.dtype)
    if cols is None or not cols.numel() or int8_weights.bnb_int8_outliers(out, rows, cols, cb, scb):
        return out
    sub_a = rows[:, cols]
    sub_b = (cb[:, cols].float() * scb.view(-1, 1) * INV_127).to(rows.dtype)
    return out.float().addmm_(sub_a.float(), sub_b.float().t()).to(rows.dtype)
