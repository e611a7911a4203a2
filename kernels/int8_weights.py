"""Weight-only int8 matmul: int8 weights with one scale per output row, activations in the model dtype.

For a few rows (decode, a draft model's proposals) a GEMV reads half the bytes of a bf16 matmul: for one bf16
row where our exact int8 product does not build ours (csrc/bf16_gemv.cpp, weight rows in memory order), for up
to four fp32/fp16 rows torch's CPU int8 GEMV, whose cost grows linearly with the row count and which
mis-computes unless in_features % 16 == 0 (so neither serves such shapes: one rule for both). Other rows of
bf16/fp16 activations on CPU (bf16 from one row where our int8 product serves) are quantized on the fly (int8,
one absmax scale per row) and multiplied in int32: up to 64 rows by our AVX512-VNNI kernel
(csrc/quant_linear.cpp `int8_mm`, which needs nothing of the weight but its codes: faster than oneDNN's, whose
weight reorder on every call costs as much as the product at a few rows: docs/benchmarks.md; without AMX, from
the codes packed once into panels, `int8_panels`, faster still), above by
`torch._int_mm` (oneDNN), the same exact int32 sums either way; the quantization and the rescale epilogue
(bias included) are one C++ pass each (csrc/quant_linear.cpp) where it builds, rounding exactly as the torch
ops they replace. Where oneDNN has no bf16 instructions (kernels.linear.onednn_bf16), prefill-sized bf16
inputs (`widen_min_rows` and up) multiply the dequantized weight in fp32 instead, a bounded slice at a time.
On CUDA with triton the W8A16 kernel (kernels/triton/w8a16.py) serves; fp32 activations, odd shapes and other
devices dequantize the weight and use the ordinary matmul.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build, cpu_isa, options
from sluice.kernels import linear as linear_kernels
from sluice.kernels.device_path import triton_on

DEQUANT = 6.200124e-05  # bitsandbytes' int8_mm_dequant factor (1 / 127², as it writes it)
MAX_GEMV_ROWS = 4  # fp32/fp16 rows that take torch's GEMV, where it wins (docs/benchmarks.md, decode_steps)
# bf16 rows, ours: where our exact int8 product serves (AVX512-VNNI, or AVX2's madd), none (at one row the
# dynamic int8 matmul, weight rows in memory order, beats this GEMV, which widens every weight to fp32:
# docs/benchmarks.md); without it one row (it keeps the activations unquantized; oneDNN's int8 matmul is
# slower)
BF16_GEMV_ROWS = 1
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DYNAMIC_DTYPES = (torch.bfloat16, torch.float16)
# bf16 rows from which, where oneDNN has no bf16 instructions, the dequantized weight is widened to fp32 for
# oneDNN's fp32 matmul (kernels.linear.widened_linear) instead of the dynamic int8 product: prefill chunks
WIDEN_MIN_ROWS = 128
# ... on the avx2 tier, against our AVX2 int8 product (csrc/int8_mm_avx2.h): faster than the widened weight
# up to here, level at it, slower past it (bench/cpu_tiers.py --quant)
AVX2_WIDEN_MIN_ROWS = 2048


def gemv_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of this dtype a GEMV serves on CPU."""
    if dtype is torch.bfloat16:
        return 0 if dynamic_from_one_row() else BF16_GEMV_ROWS
    return MAX_GEMV_ROWS


def dynamic_from_one_row() -> bool:
    """Whether bf16 rows take the dynamic int8 matmul from one row on: our exact int8 product builds here (its
    AVX512-VNNI kernel, or the AVX2 one: csrc/int8_mm_avx2.h)."""
    fused = _fused()
    return fused is not None and (fused.VNNI or cpu_isa.at_least("avx2"))


def widen_min_rows() -> int:
    """bf16 rows from which `int8_linear` widens the dequantized weight where oneDNN has no bf16 instructions:
    AVX2_WIDEN_MIN_ROWS on the avx2 tier with our AVX2 int8 product, else WIDEN_MIN_ROWS."""
    fused = _fused()
    if fused is not None and not fused.VNNI and cpu_isa.tier() == "avx2":
        return AVX2_WIDEN_MIN_ROWS
    return WIDEN_MIN_ROWS


def _use_gemv(rows: torch.Tensor, qweight: torch.Tensor) -> bool:
    return (rows.device.type == "cpu" and rows.shape[0] <= gemv_rows(rows.dtype) and rows.dtype in GEMV_DTYPES
            and qweight.shape[1] % 16 == 0)


def _gemv_kernel(scales: torch.Tensor):
    """Our int8 GEMV (csrc/bf16_gemv.cpp: the bf16 GEMV's memory-order pass, faster than torch's at one row)
    for bf16 activations and scales, or None (then torch's serves)."""
    from sluice.kernels.linear import gemv_extension

    return gemv_extension() if scales.dtype is torch.bfloat16 else None


def _use_dynamic(rows: torch.Tensor) -> bool:
    return rows.device.type == "cpu" and rows.dtype in DYNAMIC_DTYPES


def _fused():
    return cpp_build.part("quant_linear") if cpp_build.enabled() else None


def stack_branches(qweight: torch.Tensor, scales: torch.Tensor,
                   rows: list[torch.Tensor]) -> list[bool] | None:
    """Per batch of rows, True where `int8_linear` runs our int8 GEMV on it and False where the fused dynamic
    int8 matmul; None where either does not build for these weights or some batch takes another branch (what
    the decode stack needs to run the same products)."""
    if qweight.device.type != "cpu" or _fused() is None or _gemv_kernel(scales) is None:
        return None
    gemv = [_use_gemv(r, qweight) for r in rows]
    return gemv if all(g or _use_dynamic(r) for g, r in zip(gemv, rows, strict=True)) else None


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, in] as int8 codes and fp32 scales [M, 1] (absmax / 127 per row): the torch reference."""
    xf = rows.float()
    row_scale = xf.abs().amax(1, keepdim=True).clamp_min_(1e-12).div_(127)
    return xf.div_(row_scale).round_().to(torch.int8), row_scale


def bnb_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A weight [out, in] quantized as bitsandbytes' int8_vectorwise_quant quantizes its fp16 copy (codes CB,
    fp32 row absmax SCB; the same bits), in one C++ pass per row; None where that kernel does not serve (other
    devices, no C++ kernels), for the caller to use bitsandbytes' own."""
    fused = _fused()
    if fused is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    return tuple(fused.bnb_int8_rows(weight.contiguous()))


def bnb_int8_act(rows: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation rows [M, in] quantized as bitsandbytes' int8_vectorwise_quant(rows.half(), threshold)
    quantizes them (LLM.int8(): codes, fp32 row absmax [M], the outlier columns int64, empty where none; the
    same bits): one C++ pass per row where it builds, else those torch ops."""
    fused = _fused()
    if fused is not None and rows.device.type == "cpu" and rows.dim() == 2:
        return tuple(fused.bnb_int8_act(rows.contiguous(), threshold))
    a = rows.to(torch.float16)
    cols = torch.empty(0, dtype=torch.int64, device=rows.device)
    if threshold > 0.0:
        outliers = a.abs() >= threshold
        cols = torch.argwhere(outliers.any(dim=0)).view(-1)
        a = a.masked_fill(outliers, 0)
    row_stats = torch.max(a.abs(), dim=1).values.float()
    codes = torch.round(a * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
    if rows.shape[0] > 1:
        codes[:, cols] = 0
    return codes, row_stats, cols


def bnb_int8_dequant(acc: torch.Tensor, row: torch.Tensor, col: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' int8_mm_dequant (acc int32 [M, N] * (row absmax [M] * SCB [N]) / 127², in fp32), plus
    bias, in `dtype`: one C++ pass for bf16 where it builds (the same bits), else its torch ops."""
    fused = _fused()
    if fused is not None and dtype is torch.bfloat16 and acc.device.type == "cpu" and acc.is_contiguous():
        out = fused.bnb_int8_dequant(acc, row, col, bias)
        if out is not None:
            return out
    out = acc * (row.view(-1, 1) * col.view(1, -1)) * DEQUANT
    if bias is not None:
        out += bias
    return out.to(dtype)


def bnb_int8_outliers(out: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, cb: torch.Tensor,
                      scb: torch.Tensor) -> bool:
    """LLM.int8()'s outlier columns added back into out [M, N] (bf16, in place): rows' columns `cols` times
    cb's same columns dequantized as bitsandbytes does (cb * SCB / 127, rounded to bf16), the products summed
    in fp32 in column order, added to out in fp32 and rounded once. One C++ pass where the tier has it (AVX2
    and up); False where not (the caller adds them with torch ops)."""
    fused = _fused()
    return fused is not None and rows.device.type == "cpu" and fused.bnb_int8_outliers(
        out, rows, cols, cb, scb)


def exact_int8_mm(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """xq [M, in] int8 times qweight [out, in] int8 in exact int32 sums: our product (C++) where it builds,
    else torch._int_mm where it sums exactly, else in float64."""
    fused = _fused()
    if fused is not None and xq.device.type == "cpu":
        return fused.int8_mm(xq, qweight)
    if xq.device.type != "cpu" or int_mm_exact():
        return torch._int_mm(xq, qweight.t())
    return (xq.double() @ qweight.double().t()).to(torch.int32)


@options.derived
def int8_panels_serve() -> bool:
    """Whether int8 weights are packed into panels here (`int8_panels`): our int8 product is built for
    AVX512-VNNI, oneDNN has no AMX tiles, and SLUICE_PACKED_WEIGHTS is not 0 (as kernels.linear's bf16
    ones)."""
    fused = _fused()
    return (fused is not None and getattr(fused, "INT8_PANELS", False) and not linear_kernels.onednn_amx()
            and options.current().packed_weights)


def int8_panels(qweight: torch.Tensor) -> torch.Tensor | None:
    """The panels of an int8 CPU weight [out, in] (csrc/int8_panels.h: 64 outputs in K quads, the same exact
    int32 sums as torch._int_mm at every row count; 1.1-1.4x our row-major VNNI product at 1 to 64 rows), kept
    on the weight (`linear.kept_packing`); None where they do not serve."""
    if not (int8_panels_serve() and qweight.dtype is torch.int8 and qweight.dim() == 2
            and qweight.device.type == "cpu" and qweight.is_contiguous()):
        return None
    return linear_kernels.kept_packing(qweight, _fused().pack_int8_panels)


def dynamic_int8_mm(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, in] quantized per row to int8, times qweight [out, in] in int32 (from its panels where they
    serve, to VNNI_MAX_ROWS rows: past them oneDNN's product is the faster, 1.04x at 256 rows and 1.2x at
    1,024 on Zen 4),
    rescaled to rows' dtype, + bias."""
    fused = _fused()
    if fused is not None and rows.is_contiguous():
        xq, row_scale = fused.quantize_rows(rows)
        panels = int8_panels(qweight)
        acc = (fused.int8_panels_mm(xq, panels, qweight.shape[0])
               if panels is not None and xq.shape[0] <= fused.VNNI_MAX_ROWS else fused.int8_mm(xq, qweight))
        return fused.int8_rescale(acc, row_scale, scales, bias)
    xq, row_scale = quantize_rows(rows)
    y = exact_int8_mm(xq, qweight).float().mul_(row_scale).mul_(scales.float()).to(rows.dtype)
    return y if bias is None else y + bias


@functools.cache
def int_mm_exact() -> bool:
    """Whether torch._int_mm sums exactly here: oneDNN's int8 product without VNNI saturates int16 pair sums,
    so on CPUs without AVX512-VNNI / AVX-VNNI, or with ONEDNN_MAX_CPU_ISA below them, the torch path sums in
    fp64 (exact for int8 products) instead."""
    flags = cpu_isa.cpu_flags()
    limit = options.current().onednn_max_cpu_isa
    return ("avx512_vnni" in flags or "avx_vnni" in flags) and (limit in ("", "ALL", "DEFAULT")
                                                                or "VNNI" in limit
                                                                  or "BF16" in limit or "AMX" in limit
                                                                  or "AVX10" in limit)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the dequantized weight qweight [out, in] * scales [out] (x's dtype), plus bias."""
    rows = x.reshape(-1, x.shape[-1])
    if triton_on(rows.device):
        from sluice.kernels.triton.w8a16 import w8a16_linear

        return w8a16_linear(x, qweight, scales, bias)
    if _use_gemv(rows, qweight):
        ours = _gemv_kernel(scales) if rows.dtype is torch.bfloat16 else None
        y = (ours.int8_gemv if ours is not None
             else torch._weight_int8pack_mm)(rows.contiguous(), qweight, scales)
    elif linear_kernels.widen_serves(rows, widen_min_rows()):
        y, bias = linear_kernels.widened_linear(rows, qweight, bias, scales), None
    elif _use_dynamic(rows):
        y, bias = dynamic_int8_mm(rows.contiguous(), qweight, scales, bias), None
    else:
        y = F.linear(rows, qweight.to(x.dtype)) * scales
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], qweight.shape[0])
