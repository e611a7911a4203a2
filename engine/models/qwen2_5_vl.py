"""Qwen2.5-VL's vision tower natively: RMSNorm, a gated SiLU MLP, attention within windows of merged patches
(every block but those of `fullatt_block_indexes`, which attend over the whole image) and an RMSNorm merger.

Its language model is Qwen2-VL's (models.qwen2_vl): a still image takes the same (t, h, w) M-RoPE positions
(the seconds-per-grid temporal spacing applies to videos only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.models.qwen2_vl import (
    PatchMerger,
    VisionAttention,
    VisionTransformer,
    vision_inv_freq,
    vision_rotary,
)

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


class VisionRMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Qwen2.5-VL's vision tower has it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x scaled to unit root mean square over its last dim, times the weight."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class VisionGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of x [N, dim]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen25VisionBlock(nn.Module):
    """Pre-norm attention (within the segments it is handed) and gated MLP, both residual."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(dim), VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionGatedMLP(dim, mlp_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """x [N, dim] whose tokens attend within consecutive segments of `lengths` tokens."""
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


def window_order(grids: list[tuple[int, int, int]], merge: int,
                 window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged patches of images laid end to end, reordered window by window (each frame tiled into windows
    of window x window merged patches, the last row and column of windows cut short), and each window's
    patch count."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        tiles = F.pad(index, (0, nw * window - gw, 0, nh * window - gh), value=-1)
        tiles = tiles.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(-1, window * window)
        kept = tiles >= 0
        order.append(tiles[kept] + base)
        lengths += [int(n) * merge * merge for n in kept.sum(1).tolist() if n]
        base += t * gh * gw
    return torch.cat(order), lengths


class Qwen25VisionTransformer(nn.Module):
    """Qwen2.5-VL's vision tower: patch embedding, window and full attention blocks with 2D rotary positions,
    RMSNorm patch merger."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = cfg["hidden_size"], cfg["num_heads"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen2.5-VL vision hidden_act {cfg['hidden_act']!r} is not supported "
                             "(silu only)")
        self.merge = cfg.get("spatial_merge_size", 2)
        patch = cfg.get("patch_size", 14)
        self.window = cfg.get("window_size", 112) // self.merge // patch  # in merged patches
        self.full_attention = set(cfg.get("fullatt_block_indexes") or ())
        channels, frames = cfg.get("in_channels", 3), cfg.get("temporal_patch_size", 2)
        self.patch_embed = nn.Linear(channels * frames * patch**2, dim, bias=False)  # the Conv3d, flattened
        self.blocks = nn.ModuleList(Qwen25VisionBlock(dim, heads, cfg["intermediate_size"])
                                    for _ in range(cfg["depth"]))
        self.merger = PatchMerger(cfg["out_hidden_size"], dim, self.merge, VisionRMSNorm(dim))
        self.register_buffer("inv_freq", vision_inv_freq(cfg, dim // heads), persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged embeddings [sum(t*h*w) / merge**2, out_hidden] of images whose patches lie end to end."""
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        cos, sin = vision_rotary(grids, self.merge, self.inv_freq, x.device)
        order, windows = window_order(grids, self.merge, self.window)
        unit = self.merge**2
        patches = (order[:, None] * unit + torch.arange(unit)).flatten().to(x.device)
        x, cos, sin = x[patches], cos[patches], sin[patches]
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order.to(x.device))]


def vision_tower(hf_config: dict[str, Any]) -> nn.Module:
    """An empty vision tower of the checkpoint's architecture: Qwen2.5-VL's, else Qwen2-VL's."""
    if ARCHITECTURE in (hf_config.get("architectures") or []):
        return Qwen25VisionTransformer(hf_config["vision_config"])
    return VisionTransformer(hf_config["vision_config"])
