"""bitsandbytes' LLM.int8() product on CPU without a oneDNN primitive per activation shape.

Its default `int8_mixed_scaled_mm` adds the outlier columns back by a bf16/fp16 `addmm` of [M, k] by [k, N],
with M the step's token count and k the number of columns holding an outlier in this step's activations, both
different nearly every call. oneDNN builds (JIT) and caches one matmul primitive per shape: each costs
milliseconds to make and its AMX/AVX-512 kernels stay resident in the primitive cache (up to 1024 of them), so a
worker that served one batch of mixed lengths kept hundreds of MiB more than bf16 and spent most of its prefill
making primitives. Here that one product runs in float32 (the BLAS GEMM: no per-shape state kept), with the
same inputs (the outlier weight columns dequantized and rounded to the activations' dtype, as bitsandbytes
does) and the same single rounding of `output + subA @ subB` to the activations' dtype; the int8 product and its
dequantization are bitsandbytes' own ops.
"""

from __future__ import annotations

import torch

_LIBRARY: list = []  # the torch.library registration, once made (kept alive for the process)


def _mixed_scaled_mm(A: torch.Tensor, CA: torch.Tensor, CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
                     outlier_cols: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes::int8_mixed_scaled_mm on CPU: the int8 product plus the outlier columns' in float32."""
    ops = torch.ops.bitsandbytes
    output = ops.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if outlier_cols is None or not outlier_cols.numel():
        return output, torch.empty(0, device=A.device, dtype=A.dtype)
    subA = A[:, outlier_cols].contiguous()
    subB = ops.int8_vectorwise_dequant.default(CB[:, outlier_cols].contiguous(), SCB).to(A.dtype)
    summed = output.float().addmm_(subA.float(), subB.float().t())
    return summed.to(A.dtype), subA


def serve_int8_on_cpu() -> bool:
    """Register the CPU kernel above for bitsandbytes::int8_mixed_scaled_mm (once per process; bitsandbytes must
    be imported); False where this bitsandbytes has no such op."""
    if _LIBRARY:
        return True
    if not hasattr(torch.ops.bitsandbytes, "int8_mixed_scaled_mm"):
        return False
    lib = torch.library.Library("bitsandbytes", "IMPL")
    lib.impl("int8_mixed_scaled_mm", _mixed_scaled_mm, "CPU")
    _LIBRARY.append(lib)
    return True
