"""Which implementation serves an op on a given device and dtype: decided here, never by engine code."""

from __future__ import annotations

import torch

from sluice.kernels.cpu_attention import available as cpu_kernel_available


def fused_attention(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """True when paged attention over a plain `kv_dtype` cache runs the fused CPU kernel (built on first call)."""
    return device.type == "cpu" and kv_dtype == dtype and cpu_kernel_available()


def fused_int8_attention(device: torch.device) -> bool:
    """True when short queries over an int8 KV cache run the fused CPU kernel, which dequantizes in registers."""
    return device.type == "cpu" and cpu_kernel_available()
