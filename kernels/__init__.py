"""Compute kernels, each chosen by device and dtype inside this package.

Torch reference everywhere; on CPU a fused C++ paged attention and residual add + RMSNorm (csrc/, built on
first use, torch fallback), a bf16 GEMV (AVX512-BF16, or AVX2 + FMA: kernels.cpu_isa picks the tier) for bf16
linears at decode row counts (kernels.linear), torch's int8 GEMV / dynamic int8 matmul and int4 matmul for
weight-only linears; on CUDA with triton the device path (device_path.py: Triton KV store, paged attention and
W8A16 over a FlatMetadata, no host syncs inside the forward).
"""

from sluice.kernels.attention import AttentionMetadata, build_metadata, gather_kv, paged_attention, write_kv
from sluice.kernels.device_path import flat_layout
from sluice.kernels.elementwise import rope_qk, silu_mul
from sluice.kernels.flat_metadata import FlatMetadata, build_flat_metadata
from sluice.kernels.int8_weights import int8_linear
from sluice.kernels.rms_norm import add_rms_norm

__all__ = ["AttentionMetadata", "FlatMetadata", "add_rms_norm", "build_flat_metadata", "build_metadata",
           "flat_layout", "gather_kv", "int8_linear", "paged_attention", "rope_qk", "silu_mul",
           "write_kv"]

