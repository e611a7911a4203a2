"""A decoder layer's elementwise steps: one fused C++ pass each on CPU (csrc/elementwise.cpp), torch
elsewhere.

`rope_qk` rotates the query and key heads of a fused qkv projection and returns them contiguous; `silu_mul`
is SwiGLU's silu(gate) * up; `store_kv` copies a step's keys and values to their cache slots; `argmax` picks
each logits row's greedy token. The first two round every intermediate to the activations' dtype as the torch
ops (and HF) do, and `argmax` breaks ties as torch does, so the fused kernels change speed, not results.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpp_build


def _ext():
    return cpp_build.part("elementwise") if cpp_build.enabled() else None


def _fused(x: torch.Tensor, dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> bool:
    return x.device.type == "cpu" and x.dtype in dtypes and _ext() is not None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x2, x1) of the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, heads, D] by cos/sin [T, 1, D], rounding like HF's apply_rotary_pos_emb."""
    return x * cos + rotate_half(x) * sin


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated queries [T, H, D] and keys [T, Hkv, D] from qkv [T, H + 2 Hkv, D]; cos/sin [T, 1, D]."""
    d = qkv.shape[-1]
    # fp32 stays on torch: the compiler may contract x * cos + r * sin into one FMA, which rounds differently
    if (_fused(qkv, (torch.bfloat16, torch.float16)) and qkv.stride(-1) == 1 and qkv.stride(1) == d
            and cos.shape[-1] == d and d % 2 == 0):
        c, s = cos.reshape(-1, d), sin.reshape(-1, d)
        if c.dtype == qkv.dtype and c.is_contiguous() and s.is_contiguous():
            q, k = _ext().rope_qk(qkv, c, s, num_heads, num_kv_heads)
            return q, k
    qk = apply_rope(qkv[:, : num_heads + num_kv_heads], cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first)."""
    if _fused(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return _ext().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copy keys/values [T, Hkv, D] to their slots of the [Hkv, blocks, block, D] caches in one C++ call;
    False (nothing written) where it does not serve: another device, dtypes that differ, other strides."""
    ok = (_fused(k) and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
          and slot_mapping.dtype == torch.long
          and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()
          and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v)))
    if ok:
        _ext().store_kv(k_cache, v_cache, k, v, slot_mapping)
    return ok


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum (the first NaN where a row has one) of x [rows, n]:
    x.max(-1).indices, by one C++ pass per row on CPU (torch's reduction reads a bf16 vocabulary row
    slowly)."""
    if _fused(x) and x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous():
        return _ext().argmax_rows(x)
    return x.max(-1).indices
