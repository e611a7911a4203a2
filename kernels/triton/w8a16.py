"""Triton W8A16 matmul for `int8_weight_only`: int8 weights [N, K] with one scale per row, activations in
bf16/fp16.

Few rows (decode) take a GEMV that streams each int8 weight tile once and multiplies on the CUDA cores; more
rows take a tiled GEMM that dequantizes each weight tile in registers before tl.dot. Neither materializes
a dequantized weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.triton.paged_attention import dot_precision

MAX_GEMV_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask, mmask = n < N, m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _epilogue(acc, s_ptr, b_ptr, y_ptr, m, n, mmask, nmask, stride_ym, HAS_BIAS)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PRECISION: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    _epilogue(acc, s_ptr, b_ptr, y_ptr, m, n, mmask, nmask, stride_ym, HAS_BIAS)


@triton.jit
def _epilogue(acc, s_ptr, b_ptr, y_ptr, m, n, mmask, nmask, stride_ym, HAS_BIAS: tl.constexpr):
    y = acc * tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    ptr = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(ptr, y.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times (qweight [N, K] int8 * scales [N]) transposed, plus bias, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    (m, k), n = rows.shape, qweight.shape[0]
    assert qweight.dtype == torch.int8 and qweight.stride(1) == 1 and qweight.shape[1] == k
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (rows, qweight, scales, bias if bias is not None else scales, y, m, n, k,
            rows.stride(0), qweight.stride(0), y.stride(0))
    if m <= MAX_GEMV_ROWS:
        block_n = 64
        _gemv_kernel[(triton.cdiv(n, block_n),)](*args, BLOCK_M=triton.next_power_of_2(max(m, 1)),
                                                 BLOCK_N=block_n, BLOCK_K=64, HAS_BIAS=bias is not None)
    elif m:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))
        _gemm_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, HAS_BIAS=bias is not None,
                           PRECISION=dot_precision(x.dtype))
    return y.view(*x.shape[:-1], n)
