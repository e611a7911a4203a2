"""Paged attention in plain torch: the reference for every device, the fallback where no kernel exists."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sluice.kernels import device_path, elementwise, prefill
from sluice.kernels.cpu_attention import paged_attention_cpu
from sluice.kernels.flat_metadata import FlatMetadata

MAX_SHORT_QUERY = 16
SHORT_BUCKET = 32


@dataclass(slots=True)
class ShortGroup:
    """Sequences with few query tokens (decode, speculative verify), attended in one padded call."""

    token_index: torch.Tensor  # [B, max_q] flat token positions (padding rows point at 0)
    valid: torch.Tensor  # [B, max_q] bool
    block_index: torch.Tensor  # [B * max_blocks] flattened block tables
    mask: torch.Tensor  # [1, B, max_q, 1, max_blocks * block_size] bool


@dataclass(slots=True)
class LongSeq:
    """One sequence with many query tokens (prefill or a prefill chunk)."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flat token batch against the paged KV cache, shared by all layers."""

    slot_mapping: torch.Tensor
    short_groups: list[ShortGroup] = field(default_factory=list)
    fused_short: tuple[torch.Tensor, ...] | None = None  # (query starts, query lens, contexts, block tables)
    fused_long: bool = False  # fused_short holds long queries too (`fused_prefill`): no decode stack step
    long_seqs: list[LongSeq] = field(default_factory=list)
    padded_prefills: list[prefill.PaddedBatch] = field(default_factory=list)  # fresh long_seqs batched
    batched_ids: set[int] = field(default_factory=set)  # ids of the long_seqs the padded batches serve


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    fused: bool = False,
    fused_prefill: bool = False,
) -> AttentionMetadata:
    """Split sequences into short-query ones (padded groups bucketed by context, or the fused CPU kernel's
    arguments when `fused`) and long ones (with `fused_prefill` too, the fused kernel's)."""
    meta = AttentionMetadata(slot_mapping=slot_mapping)
    starts, pos = [], 0
    for q in query_lens:
        starts.append(pos)
        pos += q
    longest = MAX_SHORT_QUERY if not (fused and fused_prefill) else max(query_lens)
    meta.fused_long = longest > MAX_SHORT_QUERY
    short = [i for i, q in enumerate(query_lens) if q <= longest]
    if fused and short:
        meta.fused_short = _fused_args(short, starts, query_lens, context_lens, block_tables)
        short = []
    short.sort(key=lambda i: context_lens[i])
    for b in range(0, len(short), SHORT_BUCKET):
        idx = short[b:b + SHORT_BUCKET]
        meta.short_groups.append(
            _short_group(idx, starts, query_lens, context_lens, block_tables, block_size, device)
        )
    for i, q in enumerate(query_lens):
        if q > longest:
            bt = torch.tensor(block_tables[i][: -(-context_lens[i] // block_size)], dtype=torch.long)
            meta.long_seqs.append(LongSeq(starts[i], q, context_lens[i], bt.to(device)))
    meta.padded_prefills, meta.batched_ids = prefill.padded_batches(meta.long_seqs, device)
    return meta


def _fused_args(idx, starts, query_lens, context_lens, block_tables) -> tuple[torch.Tensor, ...]:
    """(query starts, query lens, contexts, block tables zero-padded to the widest): two host-to-tensor
    copies."""
    width = max(len(block_tables[i]) for i in idx)
    tables = torch.tensor([block_tables[i] + [0] * (width - len(block_tables[i])) for i in idx],
                          dtype=torch.long)
    per_seq = torch.tensor([[xs[i] for i in idx] for xs in (starts, query_lens, context_lens)],
                           dtype=torch.long)
    return per_seq[0], per_seq[1], per_seq[2], tables


def _short_group(idx, starts, query_lens, context_lens, block_tables, block_size, device) -> ShortGroup:
    max_q = max(query_lens[i] for i in idx)
    max_ctx = max(context_lens[i] for i in idx)
    nb = -(-max_ctx // block_size)
    q_off = torch.arange(max_q)
    qlen = torch.tensor([query_lens[i] for i in idx])
    ctx = torch.tensor([context_lens[i] for i in idx])
    start = torch.tensor([starts[i] for i in idx])
    valid = q_off[None, :] < qlen[:, None]
    token_index = torch.where(valid, start[:, None] + q_off[None, :], torch.zeros((), dtype=torch.long))
    qpos = ctx[:, None] - qlen[:, None] + q_off[None, :]
    kpos = torch.arange(nb * block_size)
    mask = kpos[None, None, :] <= qpos[:, :, None]
    tables = torch.zeros(len(idx), nb, dtype=torch.long)
    for r, i in enumerate(idx):
        row = block_tables[i][:nb]
        tables[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ShortGroup(
        token_index.to(device), valid.to(device), tables.flatten().to(device),
        mask[None, :, :, None].to(device)
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] at their slots of the [Hkv, blocks, block, D] cache."""
    if device_path.flat_layout(k_cache.device):
        device_path.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    if elementwise.store_kv(k_cache, v_cache, k, v, slot_mapping):
        return
    hk, _, _, d = k_cache.shape
    k_cache.view(hk, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(hk, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Keys or values of each sequence as [Hkv, B, L, D] from its flattened block table."""
    hk, _, _, d = cache.shape
    return cache.index_select(1, block_index).view(hk, num_seqs, -1, d).to(dtype)


def short_query_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: ShortGroup,
                          scale: float) -> torch.Tensor:
    """GQA attention of q [B, Q, H, D] against gathered blocks as two batched matmuls."""
    b, nq, h, d = q.shape
    hk = k_cache.shape[0]
    grp = h // hk
    keys = gather_kv(k_cache, g.block_index, b, q.dtype)
    vals = gather_kv(v_cache, g.block_index, b, q.dtype)
    qg = q.view(b, nq, hk, grp, d).permute(2, 0, 1, 3, 4).reshape(hk, b, nq * grp, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    scores = scores.view(hk, b, nq, grp, -1).masked_fill(~g.mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(hk, b, nq * grp, -1)
    o = torch.matmul(probs, vals)
    return o.view(hk, b, nq, grp, d).permute(1, 2, 0, 3, 4).reshape(b, nq, h, d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata | FlatMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the flat queries q [T, H, D] over each sequence's cached context."""
    if isinstance(meta, FlatMetadata):
        return device_path.attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.fused_short is not None:
        paged_attention_cpu(q, k_cache, v_cache, out, *meta.fused_short, scale)
    for g in meta.short_groups:
        o = short_query_attention(q[g.token_index], k_cache, v_cache, g, scale)
        out[g.token_index[g.valid]] = o[g.valid]
    _long_attention(q, k, v, k_cache, v_cache, meta, scale, out)
    return out


def _long_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor) -> None:
    """Prefills and prefill chunks: fresh ones of similar lengths in padded batches (kernels.prefill), the
    rest one SDPA each over its gathered context."""
    for batch in meta.padded_prefills:
        prefill.attend(q, k, v, out, batch, scale)
    for s in meta.long_seqs:
        if id(s) in meta.batched_ids:
            continue
        sl = slice(s.query_start, s.query_start + s.query_len)
        qs = q[sl].transpose(0, 1)[None]
        if s.context_len == s.query_len:
            keys, vals = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=scale, enable_gqa=True)
        else:
            keys = gather_kv(k_cache, s.block_table, 1, q.dtype)[:, :, : s.context_len].transpose(0, 1)
            vals = gather_kv(v_cache, s.block_table, 1, q.dtype)[:, :, : s.context_len].transpose(0, 1)
            qpos = torch.arange(s.context_len - s.query_len, s.context_len, device=q.device)
            mask = torch.arange(s.context_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
