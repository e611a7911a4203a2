"""A fused CPU paged-attention kernel (C++ in csrc/paged_attention.cpp, built on first use).

The torch path gathers blocks into a padded copy and then multiplies; this kernel walks the block tables
directly, so decode attention touches the KV cache once per layer. It is optional: when the toolchain is
missing or the build fails, `available()` is False and the torch implementation is used.
"""

from __future__ import annotations

from kernels import cpp_build


def _build():
    return cpp_build.load("sluice_paged_attention_cpu", "paged_attention.cpp")


def available() -> bool:
    """True when the kernel is enabled (SLUICE_CPU_KERNEL != 0) and built."""
    return cpp_build.enabled() and _build() is not None


def paged_attention_cpu(q, k_cache, v_cache, out, qstart, qlen, ctx, block_tables, scale) -> None:
    """Write into out [T, H, D] the attention of each listed sequence's queries over its blocks."""
    _build().paged_attention_cpu(q.contiguous(), k_cache, v_cache, out, qstart, qlen, ctx, block_tables, scale)
