"""Compute kernels chosen by device: torch reference everywhere, Triton on CUDA when available."""

from kernels.attention import AttentionMetadata, build_metadata, gather_kv, paged_attention, write_kv
from kernels.int8_weights import int8_linear

__all__ = ["AttentionMetadata", "build_metadata", "gather_kv", "int8_linear", "paged_attention", "write_kv"]
