"""Rotary position embeddings, with the scalings Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

from sluice.kernels.elementwise import apply_rope


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise old (rope_theta + rope_scaling) and new (rope_parameters) config styles."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inv_frequencies(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the checkpoint's rope type."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, params), 1.0
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv, attn_scale = inv_frequencies(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_scale, persistent=False)
        self._typed: tuple | None = None  # `tables`: (the fp32 cos it was cast from, cos, sin in one dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of the positions in `dtype`: gathered once per step, shared by every layer.

        Where `tables` has cast the whole tables to `dtype` (the CPU decode stack does), a step only indexes
        them: the same values, as a row's cast is the cast's row. Nothing is built here, so a step's ops stay
        the same from the first call on (CUDA graphs capture them)."""
        typed = self._cast(dtype)
        if typed is not None:
            return typed[0][positions][:, None, :], typed[1][positions][:, None, :]
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables [positions, D] cast to `dtype`, built on first use and kept until
        another dtype is asked or the fp32 tables are replaced (module.to())."""
        typed = self._cast(dtype)
        if typed is None:
            self._typed = (self.cos, self.cos.to(dtype), self.sin.to(dtype))
            typed = self._typed[1:]
        return typed

    def _cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept (cos, sin) in `dtype`, if `tables` built them from the current fp32 tables."""
        typed = self._typed
        return typed[1:] if typed is not None and typed[0] is self.cos and typed[1].dtype == dtype else None

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] to their positions."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
