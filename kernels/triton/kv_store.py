"""Triton KV store: this step's keys/values into the head-major paged cache, int8 with per-token-head scales.

The cache is [Hkv, blocks, block, D] (scales [Hkv, blocks, block]); token t goes to flat slot
slot_mapping[t] = block * block_size + offset; slot -1 (padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _store_int8(x, dst, scale_dst, dmask):
    xf = x.to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(xf), axis=0) / 127.0, 1e-6).to(tl.float16)
    qx = _round_half_even(tl.math.div_rn(xf, s.to(tl.float32)))
    qx = tl.minimum(tl.maximum(qx, -127.0), 127.0)
    tl.store(dst, qx.to(tl.int8), mask=dmask)
    tl.store(scale_dst, s)


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scale, v_scale, slots, stride_kt, stride_kh, stride_vt,
                  stride_vh, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        t64 = t.to(tl.int64)
        dst = h.to(tl.int64) * stride_ch + slot * HEAD_DIM + d
        k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=dmask, other=0.0)
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=dmask, other=0.0)
        if INT8:
            scale_at = h.to(tl.int64) * (stride_ch // HEAD_DIM) + slot
            _store_int8(k, k_cache + dst, k_scale + scale_at, dmask)
            _store_int8(v, v_cache + dst, v_scale + scale_at, dmask)
        else:
            tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=dmask)
            tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=dmask)


def triton_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write keys/values [T, Hkv, D] at their slots (int8 caches quantize; pass their fp16 scales)."""
    t, hk, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    int8 = k_cache.dtype == torch.int8
    assert not int8 or (k_scale is not None and v_scale is not None)
    if t == 0:
        return
    _store_kernel[(t, hk)](
        k, v, k_cache, v_cache, k_scale if int8 else k_cache, v_scale if int8 else v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d), INT8=int8,
    )
