"""The device path: FlatMetadata steps served by Triton on CUDA, by the sync-free torch reference elsewhere.

CUDA with triton takes this path by default (`flat_layout`); SLUICE_DEVICE_PATH=1 forces it on any device
(to test on CPU the exact op sequence CUDA runs), =0 turns it off.
"""

from __future__ import annotations

import functools

import torch

from sluice.kernels import options
from sluice.kernels.flat_attention import flat_attention, store_slots
from sluice.kernels.flat_metadata import FlatMetadata
from sluice.kernels.int8_heads import quantize_heads
from sluice.kernels.triton import triton_available


def flat_layout(device: torch.device) -> bool:
    """Whether steps on `device` use FlatMetadata (Triton kernels on CUDA)."""
    forced = options.current().device_path
    if forced is not None:
        return forced
    return triton_on(device)


@functools.cache
def _triton_ready() -> bool:
    return triton_available() and torch.cuda.is_available()


def triton_on(device: torch.device) -> bool:
    """Whether Triton kernels serve tensors on `device` (CUDA with triton importable)."""
    return device.type == "cuda" and _triton_ready()


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Keys/values [T, Hkv, D] into a plain or int8 (with scales) cache at their slots; slot -1 skipped."""
    if triton_on(k_cache.device):
        from sluice.kernels.triton.kv_store import triton_store_kv

        triton_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if k_cache.dtype != torch.int8:
        store_slots(k_cache, k, slot_mapping)
        store_slots(v_cache, v, slot_mapping)
        return
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        qx, s = quantize_heads(x)
        store_slots(cache, qx, slot_mapping)
        store_slots(scales, s, slot_mapping)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlatMetadata, scale: float,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention of the flat queries over the cache (int8 caches dequantize with their scales)."""
    if triton_on(q.device):
        from sluice.kernels.triton.paged_attention import triton_paged_attention as triton_attention

        return triton_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return flat_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
