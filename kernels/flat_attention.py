"""Sync-free torch attention over a FlatMetadata: the Triton kernels' reference and their CPU stand-in.

Every op has shapes fixed by the padded batch (no boolean indexing, nonzero, unique or .item()), so the
same code runs inside a CUDA graph and two batches padded to one size record the same op shapes.
"""

from __future__ import annotations

import torch

from sluice.kernels.flat_metadata import FlatMetadata


def store_slots(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write x [T, Hkv, ...] into cache [Hkv, blocks, block, ...] at its slots, skipping slot -1.

    Skipped rows rewrite token 0's value into token 0's slot (the builder keeps token 0 real), so
    duplicate indices all carry one value and the result does not depend on write order.
    """
    hk = cache.shape[0]
    flat = cache.view(hk, -1, *cache.shape[3:])
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, slot_mapping[:1].clamp_min(0))
    keep = valid.view(-1, *([1] * (x.dim() - 1)))
    values = torch.where(keep, x, x[:1]).transpose(0, 1).to(cache.dtype)
    flat.index_copy_(1, slots, values)


def write_kv_flat(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] (slot -1 skipped)."""
    store_slots(k_cache, k, slot_mapping)
    store_slots(v_cache, v, slot_mapping)


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype) -> torch.Tensor:
    hk, d = cache.shape[0], cache.shape[-1]
    x = cache.view(hk, -1, d)[:, slots].to(dtype)
    if scales is not None:
        x = x * scales.view(hk, -1)[:, slots].to(dtype)[..., None]
    return x


def flat_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlatMetadata,
                   scale: float, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each flat query token [T, H, D] attends to its sequence's cached keys up to its own position (fp32
    math)."""
    t, h, d = q.shape
    hk, _, bs, _ = k_cache.shape
    seq = meta.token_seq.long()
    qpos = (meta.seq_len.long() - meta.query_len.long())[seq] + torch.arange(t, device=q.device) \
        - meta.query_start.long()[seq]
    tables = meta.block_tables.long()[seq]
    slots = (tables[:, :, None] * bs + torch.arange(bs, device=q.device)).view(t, -1)
    kpos = torch.arange(slots.shape[1], device=q.device)
    mask = (kpos[None, :] <= qpos[:, None])[None, :, None, :]
    keys, vals = (_gather(c, s, slots, q.dtype).float() for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    qg = q.view(t, hk, h // hk, d).transpose(0, 1).float()
    scores = (torch.matmul(qg, keys.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = (scores - top).exp()
    probs = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.matmul(probs, vals)
    return out.transpose(0, 1).reshape(t, h, d).to(q.dtype)
