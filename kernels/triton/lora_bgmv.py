"""Triton LoRA products for CUDA (the BGMV idea of Punica): each token's shrink x·A[slot]ᵀ, then its expand
·B[slot]ᵀ added onto the base projection's output; tokens without an adapter (slot -1) are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, v_ptr, R, K, stride_xt, stride_as, stride_ar, stride_vt,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    acc = tl.zeros([BLOCK_R], tl.float32)
    base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k, mask=kmask, other=0.0).to(tl.float32)
        a = tl.load(base + r[:, None] * stride_ar + k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + t.to(tl.int64) * stride_vt + r, acc, mask=rmask)


@triton.jit
def _expand_kernel(v_ptr, b_ptr, slot_ptr, y_ptr, N, R, stride_vt, stride_bs, stride_bn, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    base = b_ptr + slot.to(tl.int64) * stride_bs
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rmask = r < R
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + r, mask=rmask, other=0.0)
        b = tl.load(base + n[:, None] * stride_bn + r[None, :], mask=nmask[:, None] & rmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    out = y_ptr + t.to(tl.int64) * stride_yt + n
    y = tl.load(out, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(out.dtype.element_ty), mask=nmask)


def triton_add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += x[t] · a[s]ᵀ · b[s]ᵀ for each token t of slot s = token_slots[t] >= 0; a [slots, R, K],
    b [slots, N, R]; in place, returns y."""
    tokens, k = x.shape
    rank, n = a.shape[1], b.shape[1]
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    v = torch.zeros(tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(rank))
    _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, a, token_slots, v, rank, k, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        BLOCK_R=block_r, BLOCK_K=64)
    _expand_kernel[(tokens, triton.cdiv(n, 64))](
        v, b, token_slots, y, n, rank, v.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=64, BLOCK_R=block_r)
    return y
