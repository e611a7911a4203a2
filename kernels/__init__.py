"""Compute kernels, each chosen by device and dtype inside this package.

Torch reference everywhere; on CPU a fused C++ paged attention and residual add + RMSNorm (csrc/, built on
first use, torch fallback), an AVX512-BF16 GEMV for bf16 linears at decode row counts (kernels.linear), torch's
int8 GEMV / dynamic int8 matmul and int4 matmul for weight-only linears;
on CUDA with triton the device path (device_path.py: Triton KV store, paged attention and W8A16 over a
FlatMetadata, no host syncs inside the forward).
"""

import importlib.util

from kernels.attention import AttentionMetadata, build_metadata, gather_kv, paged_attention, write_kv
from kernels.device_path import flat_layout
from kernels.dispatch import fused_attention
from kernels.elementwise import rope_qk, silu_mul
from kernels.flat_metadata import FlatMetadata, build_flat_metadata
from kernels.int8_weights import int8_linear
from kernels.rms_norm import add_rms_norm

__all__ = ["AttentionMetadata", "FlatMetadata", "add_rms_norm", "build_flat_metadata", "build_metadata",
           "flat_layout", "fused_attention", "gather_kv", "int8_linear", "paged_attention", "rope_qk", "silu_mul",
           "write_kv"]


def __getattr__(name: str):
    """A name this package lacks: say so plainly, naming the usual cause (Hugging Face's `kernels` hub)."""
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # dunders, and submodules the import system loads itself
    raise ImportError(
        f"sluice's top-level `kernels` package has no {name!r}. Something expected Hugging Face's `kernels` "
        "distribution (kernel hub), whose import name ours shadows: transformers >= 5.25 requires it and imports "
        "it at start-up. Install sluice's pinned transformers (<5.25) and `pip uninstall kernels`."
    )
