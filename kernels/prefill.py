"""Fresh prefills (a sequence whose whole context is this step's queries) attended in padded batches.

One scaled_dot_product_attention per sequence and layer leaves the CPU's kernel mostly idle on short
sequences; sequences of similar length padded into one call run several times faster, the padding bounded by
`MAX_PADDING` of the real tokens. Padding sits after each sequence's tokens, so the causal mask alone keeps a
real query off it (the padding queries' rows are dropped): SDPA runs with `is_causal` and no mask tensor,
skipping the masked blocks and the mask's conversion in every call. The batches are planned once per step
(`plan`) and served to every layer (`attend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

MAX_PADDING = 0.5  # padded tokens a batch may add, as a share of its real ones


class Fresh(Protocol):
    query_start: int
    query_len: int
    context_len: int


@dataclass(slots=True)
class PaddedBatch:
    """Sequences padded to `width`: flat token index per padded row (padding reads token 0), the real rows and
    their flat token index."""

    size: int
    width: int
    index: torch.Tensor  # [size * width]
    rows: torch.Tensor  # positions of the real rows in the padded [size * width]
    dest: torch.Tensor  # index[rows]: where each real row goes in the flat step


def buckets(seqs: Sequence[Fresh]) -> list[list[Fresh]]:
    """Sequences sorted by length, cut where padding to the longest would exceed MAX_PADDING."""
    out: list[list[Fresh]] = []
    real = 0
    for s in sorted(seqs, key=lambda s: s.query_len):
        if out and (len(out[-1]) + 1) * s.query_len <= (1 + MAX_PADDING) * (real + s.query_len):
            out[-1].append(s)
            real += s.query_len
        else:
            out.append([s])
            real = s.query_len
    return out


def _batch(group: Sequence[Fresh], device: torch.device) -> PaddedBatch:
    width = max(s.query_len for s in group)
    cols = torch.arange(width)
    valid = cols[None, :] < torch.tensor([s.query_len for s in group])[:, None]
    index = ((torch.tensor([s.query_start for s in group])[:, None] + cols[None, :]) * valid).flatten()
    rows = valid.flatten().nonzero().squeeze(1)
    return PaddedBatch(len(group), width, index.to(device), rows.to(device), index[rows].to(device))


def padded_batches(long_seqs: Sequence[Fresh], device: torch.device) -> tuple[list[PaddedBatch], set[int]]:
    """The padded batches of a step's fresh prefills (two or more of similar length), and the ids of the
    sequences they serve."""
    fresh = [s for s in long_seqs if s.context_len == s.query_len]
    groups = [g for g in buckets(fresh) if len(g) > 1] if len(fresh) > 1 else []
    return [_batch(g, device) for g in groups], {id(s) for g in groups for s in g}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, b: PaddedBatch,
           scale: float) -> None:
    """Causal attention of q [T, H, D] over this step's k, v [T, Hkv, D] for one padded batch, into out."""
    qb, kb, vb = (x.index_select(0, b.index).view(b.size, b.width, *x.shape[1:]).transpose(1, 2)
                  for x in (q, k, v))
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
    flat = o.transpose(1, 2).reshape(b.size * b.width, *q.shape[1:])
    out.index_copy_(0, b.dest, flat.index_select(0, b.rows))
