"""Unquantized linears: on CPU a bf16 GEMV of ours for a few rows (csrc/bf16_gemv.cpp), F.linear elsewhere;
on AVX512-BF16 without AMX, a product of ours from the weight packed into panels at every row count.

Where the tier has it (`panels_serve`), each bf16 weight is packed once, on its first product, into panels of
64 outputs in K pairs (csrc/bf16_panels.h, `weight_panels`: a second copy kept on the weight, remade if the
weight is written to), and every product of it runs there: faster than the GEMV and than oneDNN's bf16 matmul
from one row to prefill (docs/benchmarks.md, cpu_tiers). The copies take at most half the memory available
when the first is made (`PANEL_SHARE`), in huge pages (`in_huge_pages`); weights past that, or with
SLUICE_PACKED_WEIGHTS=0, stay on the paths below.

At the row counts of decode (one to a few tokens per step) a linear only streams its weight, and oneDNN's bf16
matmul reads it well below the memory bandwidth that a plain AVX512-BF16 pass reaches (on the avx2 tier oneDNN
has no bf16 instructions at all: ours widens bf16 by a shift and sums by FMA); up to `MAX_GEMV_ROWS`
rows, and up to 64 while the rows are small enough to stay in L2 (`gemv_serves`), ours serves; past that, and
on any other device or dtype, F.linear. Where oneDNN has no bf16 instructions (CPUs without AVX512-BF16 / AMX,
or ONEDNN_MAX_CPU_ISA below them) its bf16 matmul is far slower than its fp32 one, so the rows past our GEMV
(there MAX_GEMV_ROWS_FP32: larger decode batches and prefill) are multiplied in fp32: on the avx2 tier at
every row count by the GEMV call's AVX2 GEMM (weight panels packed per call, x rows broadcast; `gemm_rows`:
the decode batches it serves), on other tiers the weight widened a bounded slice at a time for oneDNN's fp32
matmul (`widened_linear`). Sums are fp32 in a different order than oneDNN's, then rounded to bf16 as it does.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import cpp_build, cpu_isa, options

# Measured on CPU against oneDNN's bf16 matmul, weights streamed from memory (docs/benchmarks.md,
# cpu_tiers): ours wins up to MAX_GEMV_ROWS on every shape, and beyond only while its x rows (re-read for
# every 4 weight rows) stay in L2.
MAX_GEMV_ROWS = 32
MAX_GEMV_X = 64 * 2048  # past MAX_GEMV_ROWS, up to 64 rows while rows x in_features is at most this (256 KB)
# Past this many rows our GEMV gives way where oneDNN has no bf16 instructions (`onednn_bf16`: to
# `widened_linear`, oneDNN's fp32 matmul, measured level here) or has AMX tiles (`onednn_amx`: to its bf16
# matmul, the faster one past here); the decode stack (kernels/decode_stack.py) runs our GEMV to exactly this
# row count.
MAX_GEMV_ROWS_FP32 = 16
WIDEN_ELEMENTS = 1 << 22  # weight elements widened to fp32 at a time by `widened_linear` (16 MiB of fp32)
# ... at up to 64 rows (decode): a slice that stays in L2 for the matmul that reads it (2 MiB of fp32)
WIDEN_ELEMENTS_FEW_ROWS = 1 << 19
ONEDNN_FP32_MIN_ROWS = 32  # fp32 linears of fewer rows stay on torch's BLAS (see onednn_fp32)
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's values (MADV_COLLAPSE is not in Python's mmap module)
PANEL_SHARE = 0.5  # of the memory available at the first packing, the most the panel copies take together
_panel_budget: list[int] = []  # bytes the panel copies may still take (set at the first packing)


def gemv_serves(rows: int, in_features: int) -> bool:
    """Whether our GEMV takes `rows` rows of a bf16 linear with `in_features` inputs: past MAX_GEMV_ROWS_FP32
    rows only where oneDNN multiplies bf16 with AVX512-BF16 and has no AMX tiles (with AMX its matmul is the
    faster one there, docs/benchmarks.md, "llama.cpp vs Sluice on CPU, amx tier"; with no bf16 instructions
    its fp32 one, `widened_linear`)."""
    if rows > MAX_GEMV_ROWS_FP32 and (not onednn_bf16() or onednn_amx()):
        return gemm_rows() > 0  # the avx2 tier's GEMM: decode batches and prefill rows alike
    return 1 <= rows <= MAX_GEMV_ROWS or (rows <= 64 and rows * in_features <= MAX_GEMV_X)


def bf16_stack_rows(in_features: int) -> int:
    """The most rows r (up to 64, the decode batches the decode stack counts) such that our GEMV takes a bf16
    linear with `in_features` inputs at every row count 1..r (`gemv_serves`): MAX_GEMV_ROWS_FP32 where oneDNN
    serves past it, 64 on the avx2 tier's GEMM and where weights are packed into panels (`panels_serve`), and
    else on AVX512-BF16 without AMX as far as x stays in L2."""
    if panels_serve():
        return 64
    rows = 0
    while rows < 64 and gemv_serves(rows + 1, in_features):
        rows += 1
    return rows


def _gemv():
    ext = cpp_build.part("bf16_gemv") if cpp_build.enabled() else None
    return ext if ext is not None and ext.SUPPORTED else None


@options.derived
def gemm_rows() -> int:
    """The GEMV call's AVX2 GEMM (csrc/bf16_gemm_avx2.h) limit for decode batches on the avx2 tier where
    oneDNN has no bf16 instructions (it takes every row count past MAX_GEMV_ROWS_FP32, prefill rows too,
    faster there than `widened_linear`: docs/benchmarks.md, "CPU ISA tiers"; `gemv_serves` asks only whether
    it is there); else 0 (on the avx512 tier oneDNN's fp32 matmul has AVX-512 FMAs;
    with bf16 instructions its own matmul serves)."""
    ext = _gemv()
    if ext is None or onednn_bf16() or cpu_isa.tier() != "avx2":
        return 0
    return getattr(ext, "GEMM_MAX_ROWS", 0)


def gemv_extension():
    """Our C++ bf16 GEMV extension (csrc/bf16_gemv.cpp), or None where disabled or not built for the tier."""
    return _gemv()


def gemv_available() -> bool:
    """True when the C++ bf16 GEMV is enabled (SLUICE_CPU_KERNEL != 0) and built for a tier that has one (avx2
    and up: kernels.cpu_isa)."""
    return _gemv() is not None


@options.derived
def panels_serve() -> bool:
    """Whether bf16 weights are packed into panels here (`weight_panels`): the extension is built for
    AVX512-BF16, oneDNN has no AMX tiles (with them its matmul is the faster past a few rows), and
    SLUICE_PACKED_WEIGHTS is not 0."""
    ext = _gemv()
    return (ext is not None and getattr(ext, "PANELS", False) and not onednn_amx()
            and options.current().packed_weights)


def weight_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """The panels of a bf16 CPU weight [out, in] (csrc/bf16_panels.h), packed on first use and kept on the
    weight until it is written to; None where they do not serve (`panels_serve`) or the copies' share of
    memory is spent."""
    if not panels_serve():
        return None
    if not (weight.dtype is torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.is_contiguous()):
        return None
    return kept_packing(weight, _gemv().pack_panels)


def kept_packing(weight: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """`pack(weight)` (a CPU weight in another layout: bf16 or int8 panels), made on first use and kept on the
    weight until it is written to; None, kept too, where the packed copies' share of memory (PANEL_SHARE of
    what was available at the first) is spent. A copy's bytes return to the share when it is freed (its
    weight freed or written to)."""
    held = getattr(weight, "_sluice_panels", None)
    version = 0 if weight.is_inference() else weight._version
    if held is not None and held[0] == version:
        return held[1]
    if not _panel_budget:
        _panel_budget.append(int(PANEL_SHARE * _available_memory()))
    size = weight.numel() * weight.element_size()
    packed = None
    if size <= _panel_budget[0]:
        with torch.inference_mode(weight.is_inference()):
            packed = pack(weight)
        _panel_budget[0] -= size
        weakref.finalize(packed, _return_to_share, size)
        in_huge_pages(packed)
    weight._sluice_panels = (version, packed)
    return packed


def _return_to_share(size: int) -> None:
    _panel_budget[0] += size


def in_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages over the 2 MiB pages that t's memory spans whole (MADV_HUGEPAGE,
    then MADV_COLLAPSE, which copies them now: Linux 6.1+); True if the collapse took. A copy that decode
    steps stream in 4 KiB pages reads slower than the weight arena's huge pages (engine.weight_memory:
    measured here, B=1 decode 0.93x the row-major weights in the arena without, 1.11x with)."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if sys.platform != "linux" or end <= start:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise(start, end - start, MADV_HUGEPAGE)
    return madvise(start, end - start, MADV_COLLAPSE) == 0


def _available_memory() -> int:
    """Bytes of memory available now (Linux: MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] · weight [out, in]ᵀ (+ bias), as F.linear. (Checks ordered cheapest-first and the extension
    resolved once: this runs for every linear of a decode step.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if (rows.dtype is torch.bfloat16 and rows.device.type == "cpu"
            and weight.dtype is torch.bfloat16 and rows.stride(-1) == 1 and rows.shape[0] > 0
            and (bias is None or bias.dtype is torch.bfloat16)
            and not torch.is_grad_enabled()):
        panels = weight_panels(weight)
        if panels is not None:
            bias = None if bias is None else bias.contiguous()
            y = _gemv().panels_linear(rows, panels, weight.shape[0], bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    if (gemv_serves(rows.shape[0], rows.shape[1]) and rows.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
            and rows.device.type == "cpu" and (bias is None or bias.dtype is torch.bfloat16)
            and rows.stride(-1) == 1 and weight.is_contiguous() and not torch.is_grad_enabled()):
        ext = _gemv()
        if ext is not None:
            bias = None if bias is None else bias.contiguous()
            y = ext.bf16_gemv(rows, weight, bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    if widen_serves(rows):
        return widened_linear(x, weight, bias)
    if onednn_serves(rows, weight):
        y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def onednn_serves(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rows [n, in] · weight [out, in]ᵀ goes through oneDNN's fp32 matmul (`onednn_fp32`)."""
    return (rows.dtype is torch.float32 and rows.shape[0] >= ONEDNN_FP32_MIN_ROWS
            and weight.dtype is torch.float32 and rows.device.type == "cpu" and onednn_fp32()
            and not torch.is_grad_enabled())


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """x [n, in] · weight [out, in]ᵀ + bias: oneDNN's matmul where it serves (a new tensor), else into
    `out`."""
    if onednn_serves(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.addmm(bias, x, weight.t(), out=out)


def residual_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """residual + x [n, in] · weight [out, in]ᵀ + bias: oneDNN's matmul with the sum fused where it serves
    (a new tensor), else into `out` (the residual and the bias summed, then the GEMM adds the product)."""
    if onednn_serves(x, weight):
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    return torch.add(residual, bias, out=out).addmm_(x, weight.t())


@options.derived
def onednn_fp32() -> bool:
    """Whether fp32 linears of ONEDNN_FP32_MIN_ROWS rows and more go through oneDNN's matmul rather than
    torch's BLAS (MKL): where the CPU has AVX-512 and is not Intel's, MKL takes its AVX2 kernels ("zen") while
    oneDNN uses AVX-512 (ONEDNN_MAX_CPU_ISA permitting). Measured on Zen 4, 2 threads: a vision tower's and an
    encoder's shapes 1.05-1.7x MKL's (the patch embedding's K = 1,176 the most)."""
    limit = options.current().onednn_max_cpu_isa
    allowed = limit in ("", "ALL", "DEFAULT") or any(k in limit for k in ("AVX512", "AMX", "AVX10"))
    return ("avx512f" in cpu_isa.cpu_flags() and cpu_isa.cpu_vendor() != "GenuineIntel" and allowed
            and torch.backends.mkldnn.is_available())


@options.derived
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 with bf16 instructions here (AVX512-BF16 or AMX, not capped below them
    by ONEDNN_MAX_CPU_ISA); without them its bf16 matmul converts in scalar-ish code."""
    flags = cpu_isa.cpu_flags()
    limit = options.current().onednn_max_cpu_isa
    allowed = limit in ("", "ALL", "DEFAULT") or any(k in limit for k in ("BF16", "AMX", "AVX10"))
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and allowed


@options.derived
def onednn_amx() -> bool:
    """Whether oneDNN multiplies bf16 with AMX tiles here (the CPU has amx_bf16, ONEDNN_MAX_CPU_ISA allows
    it)."""
    limit = options.current().onednn_max_cpu_isa
    allowed = limit in ("", "ALL", "DEFAULT") or "AMX" in limit
    return "amx_bf16" in cpu_isa.cpu_flags() and allowed


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of bf16 x and weight summed in fp32 through oneDNN's fp32 matmul, the weight widened
    WIDEN_ELEMENTS at a time (a bounded scratch whatever the layer's size), rounded to x's dtype; `scales`:
    one per output row of an int8 weight, applied as it widens (the dequantized weight, W8A16)."""
    return widened_product(x, weight.shape, lambda i, j: _widened(weight, scales, i, j), bias)


def widened_product(x: torch.Tensor, shape: tuple[int, int], widen: Callable[[int, int], torch.Tensor],
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x times an [out, in] weight given as fp32 row slices (`widen(i, j)`: rows i..j widened or dequantized),
    WIDEN_ELEMENTS at a time (WIDEN_ELEMENTS_FEW_ROWS at up to 64 rows of x), bias added in fp32, rounded to
    x's dtype once."""
    x32, (out_features, in_features) = x.float(), shape
    elements = WIDEN_ELEMENTS_FEW_ROWS if x32.numel() <= 64 * x32.shape[-1] else WIDEN_ELEMENTS
    step = max(1, elements // in_features)
    parts = [F.linear(x32, widen(i, min(i + step, out_features)),
                      None if bias is None else bias[i:i + step].float())
             for i in range(0, out_features, step)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)


def _widened(weight: torch.Tensor, scales: torch.Tensor | None, i: int, j: int) -> torch.Tensor:
    w = weight[i:j].float()
    return w if scales is None else w.mul_(scales[i:j, None].float())


def widen_serves(rows: torch.Tensor, min_rows: int = 1) -> bool:
    """Whether `rows` (at least min_rows of them) of bf16 on CPU go through `widened_linear`: oneDNN has no
    bf16 instructions here."""
    return (rows.shape[0] >= min_rows and rows.dtype is torch.bfloat16 and rows.device.type == "cpu"
            and not onednn_bf16() and not torch.is_grad_enabled())




class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, state dict and repr)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
