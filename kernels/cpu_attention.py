"""A fused CPU paged-attention kernel (C++ in csrc/paged_attention.cpp, built on first use).

The torch path gathers blocks into a padded copy and then multiplies; this kernel walks the block tables
directly, so attention of short queries touches the KV cache once per layer: AVX-512 (or AVX2) dot products
and value sums over fp32 tiles in L1, an online softmax, and long contexts split across threads when there are
few sequences. It reads an int8 cache with its per-token-head scales itself (dequantized in registers). It is
optional: when the toolchain is missing or the build fails, `available()` is False and torch is used.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpp_build


def _build():
    return cpp_build.part("paged_attention")


def available() -> bool:
    """True when the kernel is enabled (SLUICE_CPU_KERNEL != 0) and built."""
    return cpp_build.enabled() and _build() is not None


def serves_prefill(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether long queries (prefills, prefill chunks) run on this kernel too: bf16 queries over a bf16
    cache where it has `vdpbf16ps` (AVX512-BF16), there faster than torch's SDPA (fresh prefills) or SDPA over
    a gathered copy (chunks) at every length measured (docs/benchmarks.md, "vLLM CPU vs Sluice")."""
    return (dtype is torch.bfloat16 and kv_dtype is torch.bfloat16 and available()
            and bool(getattr(_build(), "BF16_DOT", False)))


def paged_attention_cpu(q, k_cache, v_cache, out, qstart, qlen, ctx, block_tables, scale,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        chunk: int = 0) -> None:
    """Write into out [T, H, D] the attention of each listed sequence's queries over its blocks.

    An int8 cache comes with its fp16 scales [Hkv, blocks, block]; `chunk` > 0 caps the positions one thread
    attends per sequence and kv head (0: split long contexts only when sequences leave threads idle).
    """
    _build().paged_attention_cpu(q.contiguous(), k_cache, v_cache, out, qstart, qlen, ctx, block_tables,
                                 scale, k_scale, v_scale, chunk)
