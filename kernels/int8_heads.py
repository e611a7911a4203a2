"""Int8 quantization of head vectors: one fp16 absmax scale per vector, shared by every int8 KV path."""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
QMAX = 127.0


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 values and fp16 scales of x [..., D], one scale per vector (absmax / 127)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / QMAX).clamp(min=1e-6).to(SCALE_DTYPE)
    q = (xf / scale.float()[..., None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale
