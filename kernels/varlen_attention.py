"""Bidirectional attention of unpadded sequences laid back to back (an encoder's step, a vision tower's
images): each token attends every token of its own sequence.

On CPU (fp32, bf16, fp16) csrc/varlen_attention.cpp runs it: no padding, no mask, the keys transposed once per
head so scores are broadcast FMAs, fp32 arithmetic throughout (docs/benchmarks.md); elsewhere, or where the
head dim does not fit its vectors, torch's SDPA runs once per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build
from sluice.kernels.elementwise import rotate_half

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _build():
    return cpp_build.part("varlen_attention")


def varlen_serves(q: torch.Tensor) -> bool:
    """Whether q [T, H, D] goes through the C++ kernel: fp32, bf16 or fp16 on CPU, D a multiple of its vector
    width, and built."""
    if q.dtype not in KERNEL_DTYPES or q.device.type != "cpu" or not cpp_build.enabled():
        return False
    ext = _build()
    return ext is not None and q.shape[-1] % ext.HEAD_DIM_MULTIPLE == 0


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float,
                     out: torch.Tensor | None = None,
                     rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v within each sequence: q, k, v [T, H, D] (rows may be strided, as a fused qkv's
    thirds are; each head's D contiguous), `lengths` the sequences' token counts in order; out [T, H, D].
    `rotary`: cos, sin [T, D] applied to q and k first (x cos + rotate_half(x) sin, in fp32)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if varlen_serves(q) and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v, out)):
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        cos, sin = (None, None) if rotary is None else (t.float().contiguous() for t in rotary)
        _build().varlen_attention_cpu(q, k, v, out, cu, scale, cos, sin)
        return out
    if rotary is not None:
        qk = torch.stack((q, k), 1).float()  # both rotated together: transformers' arithmetic
        cos, sin = (t[:, None, None].float() for t in rotary)
        q, k = (qk * cos + rotate_half(qk) * sin).to(q.dtype).unbind(1)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        qi, ki, vi = (t[rows].transpose(0, 1) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
        start += n
    return out
