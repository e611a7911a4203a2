"""Weight-only 4-bit matmul: groups of 32 input columns share a scale and a zero (asymmetric, like q4_1).

A weight w [out, in] is stored as codes q in 0..15 with w ~= (q - 8) * scale + zero per group, in one of three
layouts (`Int4Weight.layout`):
- "vnni", bf16 on the avx2 tier and up (csrc/quant_linear.cpp; w4a8_avx512.h with AVX512-VNNI, w4a8_avx2.h
  without: `vpmaddubsw`, every row count): our layout, each row's codes in memory order,
  two per byte so that one 64-byte load unpacks into four whole groups, scales/zeros per row [out, 2, groups].
  Up to `MAX_VNNI_ROWS` rows the activations are quantized to int8 per group of 32 (absmax, as llama.cpp's
  q8_0 against q4_0) and multiplied by `vpdpbusd` (`int4_vnni_mm`): faster than torch's int4pack GEMV,
  which multiplies in fp32 (docs/benchmarks.md). Past that (large batches, prefill) each block of weight rows
  is requantized to int8 per row and multiplied with the activations quantized per row by the int8 VNNI kernel
  (`int4_vnni_int8_mm`, as the dynamic int8 path), faster than dequantizing to bf16 for oneDNN at those rows.
- "int4pack", other CPU dtypes (or no VNNI kernel): torch's `_convert_weight_to_int4pack_for_cpu` layout. Up
  to `MAX_INT4PACK_ROWS` rows `_weight_int4pack_mm_for_cpu` runs, past that the C++ tile kernel dequantizes
  each tile of output rows once, to the activations' dtype, and multiplies it with oneDNN.
- "plain" elsewhere: two codes per byte, the matmul dequantizes (the reference every kernel is tested
  against).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build, cpu_isa
from sluice.kernels import linear as linear_kernels

GROUP = 32
OUT_MULTIPLE = 16  # the CPU packer's requirement on out_features: other sizes are padded with zero rows
MAX_INT4PACK_ROWS = 16  # torch's int4pack matmul up to here, its dequantized tiles above (docs/benchmarks.md)
# measured (docs/benchmarks.md, decode_steps): the W4A8 product beats int4pack up to here and ties the
# requantized int8 product, which wins above (and errs more: x and weights per row)
MAX_VNNI_ROWS = 16
CHUNK = 128  # our VNNI layout pads in_features to a multiple of this (code 0, scale and zero 0: adds nothing)
TILE_BYTES = 4 << 20  # dequantized scratch per tile: fewer, larger at::mm calls beat L2-sized tiles here
# bf16 rows from which, where oneDNN has no bf16 instructions and our kernels no VNNI (the avx2 tier), the
# weight is dequantized to fp32 a bounded slice at a time for oneDNN's fp32 matmul (`widened_int4`) instead of
# the W4A8 product (measured: docs/benchmarks.md; with VNNI the requantized int8 product is faster than both)
WIDEN_MIN_ROWS = 128
# ... on the avx2 tier: the W4A8 product (csrc/w4a8_avx2.h) is faster than the widened weight below here and
# slower from here (bench/cpu_tiers.py --quant)
AVX2_WIDEN_MIN_ROWS = 1024
# torch's int4pack (block rows, split) for AVX-512, AVX2, other
LAYOUTS = ((64, True), (32, True), (32, False))


@dataclass(slots=True)
class Int4Weight:
    """Packed codes and scales/zeros in one of the layouts (module docstring), and the shape. scales_zeros:
    [in / GROUP, padded out, 2] in the compute dtype (int4pack, plain), bf16 [out, 2, padded in / GROUP]
    (vnni)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    out_features: int
    in_features: int
    layout: str


def shape_error(out_features: int, in_features: int) -> str | None:
    """Why a weight of this shape cannot be stored as int4, or None."""
    if in_features % GROUP:
        return f"in_features {in_features} is not a multiple of the group size {GROUP}"
    return None


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [out, in] (int32, 0..15) and scales/zeros [in / GROUP, out, 2] (fp32) of a weight [out, in]."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((w - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    return q, torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


def layout_for(device: torch.device, dtype: torch.dtype) -> str:
    """The layout `pack` stores weights of this device and compute dtype in."""
    if device.type != "cpu":
        return "plain"
    return "vnni" if dtype is torch.bfloat16 and vnni_kernel() is not None else "int4pack"


@functools.cache
def kernel_order(padded_in: int) -> torch.Tensor:
    """The groups in our VNNI layout's scale order (csrc/quant_linear.cpp `w4_pos`): per block of four chunks
    (16 groups), position 4 g + c holds group 4 c + g; the chunks after the last whole block keep group
    order."""
    groups, whole = padded_in // GROUP, padded_in // CHUNK // 4 * 16
    block = torch.arange(16).view(4, 4).t().reshape(-1)  # position 4 g + c -> group 4 c + g
    return torch.cat([block + b for b in range(0, whole, 16)] + [torch.arange(whole, groups)])


def pack(weight: torch.Tensor, dtype: torch.dtype, layout: str | None = None) -> Int4Weight:
    """Quantize and pack a weight [out, in] for its device; scales/zeros in `dtype` (the activations' dtype);
    `layout`: the device's own (`layout_for`) unless given."""
    n, k = weight.shape
    err = shape_error(n, k)
    assert err is None, err
    q, sz = quantize_int4(weight)
    sz = sz.to(dtype)
    layout = layout or layout_for(weight.device, dtype)
    if layout == "vnni":
        kp = -k // CHUNK * -CHUNK
        # chunk c, byte 16 g + j: column 128 c + 32 g + j (low nibble) and 128 c + 32 g + 16 + j (high)
        halves = F.pad(q, (0, kp - k)).view(n, kp // CHUNK, 4, 2, 16)
        packed = (halves[..., 0, :] | (halves[..., 1, :] << 4)).to(torch.uint8).view(n, kp // 2)
        sz = F.pad(sz.permute(1, 2, 0), (0, (kp - k) // GROUP))[..., kernel_order(kp)].contiguous()
        return Int4Weight(packed, sz, n, k, layout)
    if layout == "int4pack":
        pad = -n % OUT_MULTIPLE
        q, sz = F.pad(q, (0, 0, 0, pad), value=8), F.pad(sz, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return Int4Weight(packed, sz, n, k, layout)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return Int4Weight(packed, sz, n, k, layout)


def codes(w: Int4Weight) -> torch.Tensor:
    """The codes [out, in] (int32) of a packed weight."""
    if w.layout == "vnni":
        chunks = w.packed.view(w.out_features, -1, 4, 16)
        halves = torch.stack([chunks & 15, chunks >> 4], -2)  # [out, chunks, 4 groups, 2 halves, 16]
        return halves.reshape(w.out_features, -1)[:, : w.in_features].int()
    if w.layout == "int4pack":
        eye = torch.eye(w.in_features, dtype=w.scales_zeros.dtype, device=w.packed.device)
        zeros = torch.zeros_like(w.scales_zeros)
        zeros[..., 0] = 1
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, w.packed, GROUP, zeros)
        return (mm[:, : w.out_features].t().float() + 8).round().int()
    lo, hi = w.packed & 15, w.packed >> 4
    return torch.stack([lo, hi], -1).view(w.out_features, w.in_features).int()


def scales_zeros(w: Int4Weight) -> torch.Tensor:
    """Scales and zeros [in / GROUP, out, 2] (fp32) of a packed weight, whatever its layout."""
    if w.layout == "vnni":
        natural = torch.argsort(kernel_order(w.packed.shape[1] * 2))
        return w.scales_zeros[:, :, natural[: w.in_features // GROUP]].float().permute(2, 0, 1)
    return w.scales_zeros[:, : w.out_features].float()


def dequantize(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] the codes stand for, in `dtype`."""
    sz = scales_zeros(w).repeat_interleave(GROUP, 0)  # [in, out, 2]
    return ((codes(w).float() - 8) * sz[..., 0].t() + sz[..., 1].t()).to(dtype)


def _tile_kernel():
    return cpp_build.part("quant_linear") if cpp_build.enabled() else None


def vnni_kernel():
    """The C++ kernels when they have the int8 x int4 product on our layout (csrc/quant_linear.cpp:
    AVX512-VNNI, or AVX2 on the avx2 tier and AVX-512 CPUs without VNNI), else None."""
    kernel = _tile_kernel()
    return kernel if kernel is not None and kernel.W4A8 else None


def w4a8_max_rows(kernel) -> int | float:
    """The most rows `int4_vnni_mm` takes: MAX_VNNI_ROWS with VNNI (the requantized int8 product above), every
    row count without it (no int8 VNNI product to requantize for)."""
    return MAX_VNNI_ROWS if kernel.VNNI else float("inf")


def widen_min_rows(kernel) -> int:
    """bf16 rows from which `int4_linear` widens a vnni-layout weight on a tier without VNNI where oneDNN has
    no bf16 instructions: AVX2_WIDEN_MIN_ROWS on the avx2 tier, else WIDEN_MIN_ROWS."""
    return AVX2_WIDEN_MIN_ROWS if not kernel.VNNI and cpu_isa.tier() == "avx2" else WIDEN_MIN_ROWS


def bnb_4bit_kernel():
    """The C++ kernels' `bnb_4bit_blocks` (blocks coded as bitsandbytes' default quantize_4bit codes them,
    csrc/quant_linear.cpp), or None where they do not build."""
    kernel = _tile_kernel()
    return kernel.bnb_4bit_blocks if kernel is not None else None


@functools.cache
def cpu_layout() -> tuple[int, bool] | None:
    """torch's int4pack layout on this CPU as (block rows, split), read back from packed known codes; None
    when the tile kernel is unavailable or reads none of the layouts it knows."""
    kernel = _tile_kernel()
    if kernel is None:
        return None
    # one block of 64 rows and a tail of 16
    q = (torch.arange(80 * 64, dtype=torch.int32).view(80, 64) * 7) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return next((lay for lay in LAYOUTS if torch.equal(kernel.int4_codes(packed, 64, 80, *lay) + 8, q)), None)


def use_tiles(rows: torch.Tensor) -> bool:
    """Whether `int4_linear` runs an int4pack weight on these rows through our tile kernel (else torch's)."""
    return rows.shape[0] > MAX_INT4PACK_ROWS and cpp_build.enabled() and cpu_layout() is not None


def widened_int4(rows: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, kernel) -> torch.Tensor:
    """rows [M, in] (bf16) times a vnni-layout weight through oneDNN's fp32 matmul, the weight dequantized to
    fp32 a bounded slice at a time (`linear.widened_product`)."""
    def dequantized(i: int, j: int) -> torch.Tensor:
        return kernel.int4_vnni_dequant(w.packed, w.scales_zeros, w.in_features, i, j)

    return linear_kernels.widened_product(rows, (w.out_features, w.in_features), dequantized, bias)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the 4-bit weight (x's dtype), plus bias."""
    rows = x.reshape(-1, x.shape[-1])
    if w.layout == "vnni" and x.dtype is torch.bfloat16 and (kernel := _tile_kernel()) is not None:
        if not kernel.VNNI and linear_kernels.widen_serves(rows, widen_min_rows(kernel)):
            return widened_int4(rows, w, bias, kernel).view(*x.shape[:-1], w.out_features)
        mm = kernel.int4_vnni_mm if rows.shape[0] <= w4a8_max_rows(kernel) else kernel.int4_vnni_int8_mm
        y = mm(rows.contiguous(), w.packed, w.scales_zeros, bias)
        return y.view(*x.shape[:-1], w.out_features)
    if w.layout == "int4pack" and use_tiles(rows):
        y = _tile_kernel().int4_tile_mm(rows.contiguous(), w.packed, w.scales_zeros, GROUP, w.out_features,
                                        *cpu_layout(), TILE_BYTES)
    elif w.layout == "int4pack":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), w.packed, GROUP, w.scales_zeros)
        if y.shape[1] != w.out_features:
            y = y[:, : w.out_features].contiguous()
    else:
        y = F.linear(rows, dequantize(w, x.dtype))
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], w.out_features)
