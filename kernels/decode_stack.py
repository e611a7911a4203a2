"""A CPU decode step's whole decoder stack in one C++ call (csrc/decode_stack.cpp, built on first use).

At a few tokens a layer's ~10 kernel calls from Python (module __call__, each kernel's checks, views) cost
~0.1 ms a layer, 1.1-1.4 ms of a 125M model's bf16 decode step at batch 1 and 8 (measured on a loaded 2-core
CPU). The stack makes the same calls in the same order from C++, so its results are bitwise the layers'. It
serves bf16 steps of 1 to MAX_GEMV_ROWS tokens whose sequences all have short queries (decode, speculative
verify) on the fused attention kernel; anything else runs the Python layers.
"""

from __future__ import annotations

import torch

from kernels import cpp_build
from kernels.attention import AttentionMetadata
from kernels.linear import MAX_GEMV_ROWS


def _ext():
    ext = cpp_build.load("sluice_decode_stack_cpu", "decode_stack.cpp") if cpp_build.enabled() else None
    return ext if ext is not None and ext.SUPPORTED else None


def available() -> bool:
    """True when the stack is enabled (SLUICE_CPU_KERNEL != 0), built, and the CPU has avx512_bf16 (its GEMV)."""
    return _ext() is not None


def step_fits(x: torch.Tensor, meta) -> bool:
    """Whether a step with hidden states x [T, hidden] can run on a stack (a few attribute tests: every step)."""
    return (x.dtype is torch.bfloat16 and 1 <= x.shape[0] <= MAX_GEMV_ROWS and x.device.type == "cpu"
            and type(meta) is AttentionMetadata and meta.fused_short is not None and not meta.short_groups
            and not meta.long_seqs and not torch.is_grad_enabled())


def _plain_bf16(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype is torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous())


def build(layers: list[list[torch.Tensor | None]], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
          scale: float) -> DecodeStack | None:
    """A stack over per-layer [input norm, qkv weight, qkv bias or None, o weight, post-attention norm, gate_up
    weight, down weight, k cache, v cache], or None where the kernels do not build or a tensor is not a
    contiguous CPU bf16 one."""
    ext = _ext()
    if ext is None or not all(_plain_bf16(t) for layer in layers for t in layer):
        return None
    return DecodeStack(ext.DecodeStack(layers, num_heads, num_kv_heads, head_dim, eps, scale))


class DecodeStack:
    """The C++ stack, holding the layers' weights and caches (later writes to them are seen, not copies)."""

    __slots__ = ("_stack",)

    def __init__(self, stack) -> None:
        self._stack = stack

    def run(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings x [T, hidden] of a step that `step_fits` through every layer: (x, delta) as the Python
        loop leaves them."""
        return self._stack.run(x, None, *cos_sin, meta.slot_mapping, *meta.fused_short)
