"""Qwen2-VL natively: the vision tower and merger, and the Qwen2 language model with M-RoPE over our paged
cache (Qwen2.5-VL's too; its own vision tower is models.qwen2_5_vl's).

Each step the runner hands the model its batch (`prepare_step`) before the forward: the vision tower encodes,
in one batched call, the images of the requests being prefilled whose tokens this step covers and that the
encoder cache lacks; their embeddings replace the image placeholder rows of the flat batch (a chunk that ends
inside an image takes the slice it covers), and every token gets its (t, h, w) M-RoPE position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice.engine.models.llama import LlamaModel, ModelConfig
from sluice.engine.multimodal.encoder_cache import EncoderCache
from sluice.engine.multimodal.image_patches import compute_all
from sluice.engine.multimodal.inputs import step_positions
from sluice.kernels.linear import Linear
from sluice.kernels.varlen_attention import varlen_attention


class VisionAttention(nn.Module):
    """Bidirectional attention within each image, with 2D rotary positions."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, dim * 3, bias=True)
        self.proj = Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """x [N, dim] of images laid end to end (`lengths` patches each)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        out = varlen_attention(q, k, v, lengths, self.head_dim**-0.5, rotary=(cos, sin))
        return self.proj(out.view(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = nn.ModuleDict({"fc1": Linear(dim, mlp_dim), "fc2": Linear(mlp_dim, dim)})

    def forward(self, x, cos, sin, lengths) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h = self.mlp["fc1"](self.norm2(x))
        return x + self.mlp["fc2"](h.mul_(torch.mul(h, 1.702).sigmoid_()))  # quick_gelu, in place


class PatchMerger(nn.Module):
    """A norm (LayerNorm unless given), then each merge x merge block of patches through a 2-layer MLP into
    one LM embedding."""

    def __init__(self, dim: int, context_dim: int, merge: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = norm if norm is not None else nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(Linear(self.hidden, self.hidden), nn.GELU(), Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def vision_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the vision tower's 2D rotary positions (a quarter of head_dim each axis)."""
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    spatial = head_dim // 2
    return 1.0 / theta ** (torch.arange(0, spatial, 2).float() / spatial)


def vision_rotary(grids: list[tuple[int, int, int]], merge: int, inv_freq: torch.Tensor,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] of every patch's (h, w) position, patches in merge-block order."""
    ids = []
    for t, h, w in grids:
        blocks = (h // merge, merge, w // merge, merge)
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w).reshape(blocks).permute(0, 2, 1, 3)
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1).reshape(blocks).permute(0, 2, 1, 3)
        ids.append(torch.stack([hpos.flatten(), wpos.flatten()], -1).repeat(t, 1))
    pos = torch.cat(ids).to(device)
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [N, 2 * spatial/2]: h's, then w's
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


class VisionTransformer(nn.Module):
    """Qwen2-VL's vision tower: patch embedding, blocks with 2D rotary positions, patch merger."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = cfg["embed_dim"], cfg["num_heads"]
        self.merge = cfg.get("spatial_merge_size", 2)
        channels, frames = cfg.get("in_channels", 3), cfg.get("temporal_patch_size", 2)
        self.patch_dim = channels * frames * cfg["patch_size"] ** 2
        self.patch_embed = Linear(self.patch_dim, dim, bias=False)  # the checkpoint's Conv3d, flattened
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, int(dim * cfg.get("mlp_ratio", 4)))
                                    for _ in range(cfg["depth"]))
        self.merger = PatchMerger(cfg["hidden_size"], dim, self.merge)
        self.register_buffer("inv_freq", vision_inv_freq(cfg, dim // heads), persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged embeddings [sum(t*h*w) / merge**2, hidden] of the images whose patches lie end to end."""
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        cos, sin = vision_rotary(grids, self.merge, self.inv_freq, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)


@dataclass(slots=True)
class StepInputs:
    """What `prepare_step` found for the next forward: M-RoPE positions ([3, T], or [T] where the axes agree),
    image rows, embeddings."""

    positions: torch.Tensor
    rows: torch.Tensor | None
    embeds: torch.Tensor | None


class Qwen2VLModel(LlamaModel):
    """The Qwen2 language model over the paged cache, M-RoPE positions and image embeddings in its input."""

    cuda_graphs = False

    def __init__(self, c: ModelConfig, max_positions: int, mrope_section: list[int]) -> None:
        super().__init__(c, max_positions)
        self.cuda_graphs = False
        self.mrope_section = list(mrope_section)
        self.visual: VisionTransformer | None = None
        self.encoder_cache = EncoderCache()
        self._step: StepInputs | None = None

    def _decode_stack(self, kv_caches, tokens: int = 1):
        """Never the C++ decode stack: it rotates by 1D positions."""
        return None

    def prepare_step(self, batch) -> None:
        """Positions and image embeddings of the batch the next forward runs (the runner's flat order)."""
        rows, chunks, offset = [], [], 0
        need = self._encode_missing(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, mm = req.num_computed_tokens, getattr(req, "mm_inputs", None)
            for item in mm.items if mm is not None else ():
                lo, hi = max(start, item.offset), min(start + n, item.offset + item.length)
                if lo < hi:
                    rows.append(torch.arange(lo - start + offset, hi - start + offset))
                    chunks.append(need[item.content_hash][lo - item.offset:hi - item.offset])
            offset += n
        device = self.embed_tokens.weight.device
        positions = step_positions(batch.requests, batch.num_new_tokens).to(device)
        self._step = StepInputs(positions, torch.cat(rows).to(device) if rows else None,
                                torch.cat(chunks) if chunks else None)

    def _encode_missing(self, batch) -> dict[str, torch.Tensor]:
        """Embeddings of every image this step's tokens cover: from the encoder cache, the rest encoded in one
        batched call of the vision tower."""
        found, todo = self.encoder_cache.for_step(batch)
        if todo:
            assert self.visual is not None
            device = self.embed_tokens.weight.device
            items = list(todo.values())
            pixels = compute_all([i.patches for i in items]).to(device)
            embeds = self.visual(pixels, [i.grid_thw for i in items])
            for item, emb in zip(items, embeds.split([i.length for i in items]), strict=True):
                found[item.content_hash] = emb
                self.encoder_cache.put(item.content_hash, emb)
        return found

    def _mrope_cos_sin(self, positions: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim]: frequency section i of the rotary dims takes axis i % 3's positions (1D
        positions [T], every axis the same: the table's own rows, both halves being the same frequencies)."""
        if positions.dim() == 1:
            return self.rope.cos_sin(positions, dtype)
        out = []
        for table in (self.rope.cos, self.rope.sin):
            rows = table.index_select(0, positions.flatten()).view(*positions.shape, -1)  # [3, T, D]
            half = rows[..., : table.shape[-1] // 2]
            mixed = torch.cat([s[i % 3] for i, s in enumerate(half.split(self.mrope_section, -1))], -1)
            out.append(torch.cat([mixed, mixed], -1).to(dtype)[:, None, :])
        return out[0], out[1]

    def hidden_states(self, input_ids, positions, kv_caches, meta, indices, stack=False,
                      plan=None) -> torch.Tensor:
        """Final-norm hidden states of the selected flat positions, image rows taking their embeddings."""
        step, self._step = self._step, None
        x = self.embed_tokens(input_ids)
        if step is None:  # a text-only call outside the runner: 1D positions on all three axes
            step = StepInputs(positions, None, None)
        if step.rows is not None:
            x = x.index_copy(0, step.rows, step.embeds.to(x.dtype))
        cos_sin = self._mrope_cos_sin(step.positions, x.dtype)
        delta = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, cos_sin, cache, meta)
        if indices is not None:
            x, delta = x[indices], delta[indices]
        return self.norm.add(x, delta)[1]


def _vision_weight(reader, name: str, param: torch.Tensor, dtype) -> torch.Tensor:
    tensor = reader.get(name).to(dtype)
    return tensor.reshape(param.shape)


def load_vision_tower(model: Qwen2VLModel, reader, visual: nn.Module, dtype: torch.dtype,
                      device: torch.device) -> None:
    """Read the empty vision tower `visual` (Qwen2-VL's, or Qwen2.5-VL's: models.qwen2_5_vl.vision_tower) from
    the checkpoint `reader` (engine.models.loader) into `model.visual`."""
    prefix = "visual." if any(n.startswith("visual.") for n in reader.names()) else "model.visual."
    state = {}
    for name, param in visual.named_parameters():
        stored = name.replace("patch_embed.weight", "patch_embed.proj.weight")
        state[name] = _vision_weight(reader, prefix + stored, param, dtype)
    visual.load_state_dict(state)
    model.visual = visual.to(device=device, dtype=dtype)
    model.visual.inv_freq = model.visual.inv_freq.float()
