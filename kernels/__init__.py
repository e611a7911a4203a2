"""Compute kernels, each chosen by device and dtype inside this package.

Torch reference everywhere; on CPU a fused C++ paged attention (csrc/, built on first use, torch fallback)
and torch's int8 GEMV for few-row int8 weight matmuls.
"""

from kernels.attention import AttentionMetadata, build_metadata, gather_kv, paged_attention, write_kv
from kernels.dispatch import fused_attention
from kernels.int8_weights import int8_linear

__all__ = ["AttentionMetadata", "build_metadata", "fused_attention", "gather_kv", "int8_linear", "paged_attention",
           "write_kv"]
