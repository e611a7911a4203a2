"""Triton paged attention over a FlatMetadata: decode, speculative verify and (chunked) prefill in one kernel.

One program per (query tile, KV head, split). A tile holds up to `block_q` query rows of one sequence times
the GQA group of that KV head, so each key/value block is read once per group. Keys are walked in tiles of
BLOCK_N positions through the block table; the softmax runs online (running max and sum). With several
splits, each writes its partial output and log-sum-exp and a second kernel merges them. Int8 caches are
dequantized in registers with their per-token-head scales. Rows past a sequence's query length and
sequences with seq_len 0 (padding) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.flat_metadata import FlatMetadata

BLOCK_N = 32


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 models (no TF32); half types always multiply exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _query_rows(q_ptr, query_start, query_len, seq_len, tile_seq, tile_q0, tile, kvh, stride_qt, stride_qh,
                GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """One tile's query rows (a block of one sequence's queries times the KV head's group) and their
    layout."""
    b = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)
    qs = tl.load(query_start + b)
    ql = tl.load(query_len + b)
    sl = tl.load(seq_len + b)
    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    rows = (r < BLOCK_Q * GROUP) & (qi < ql)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    token = (qs + qi).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rows[:, None] & dmask[None, :], other=0.0)
    kv_len = tl.maximum(sl - ql + tl.minimum(q0 + BLOCK_Q, ql), 0)
    return q, b, token, head, rows, d, dmask, sl - ql + qi, kv_len


@triton.jit
def _kv_tile(k_cache, v_cache, k_scale, v_scale, block_tables, q, b, kvh, n0, end, d, dmask, stride_ch,
             stride_bt,
             HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr):
    """Keys and values at positions [n0, n0 + BLOCK_N) below `end`, read through the block table in q's
    dtype."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pmask = pos < end
    blk = tl.load(block_tables + b.to(tl.int64) * stride_bt + pos // PAGE, mask=pmask, other=0).to(tl.int64)
    slot = blk * PAGE + pos % PAGE
    kv_off = kvh.to(tl.int64) * stride_ch + slot[:, None] * HEAD_DIM + d[None, :]
    kv_mask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
    if INT8:
        scale_off = kvh.to(tl.int64) * (stride_ch // HEAD_DIM) + slot
        ks = tl.load(k_scale + scale_off, mask=pmask, other=0.0).to(tl.float32)
        vs = tl.load(v_scale + scale_off, mask=pmask, other=0.0).to(tl.float32)
        k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    return k, v, pos, pmask


@triton.jit
def _softmax_step(q, k, v, pos, pmask, rows, qpos, scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One key tile's causal, masked update of the running max, sum and output accumulator (online
    softmax)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    keep = rows[:, None] & pmask[None, :] & (pos[None, :] <= qpos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _write_rows(out_ptr, mid_o, mid_lse, acc, m_i, l_i, token, head, rows, d, dmask, split, stride_ot,
                stride_oh, num_heads, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The tile's normalized output into `out`, or with several splits its partial output and log-sum-exp."""
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        at = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(mid_o + at[:, None] * BLOCK_D + d[None, :], o, mask=rows[:, None] & (d[None, :] < BLOCK_D))
        tl.store(mid_lse + at, lse, mask=rows)


@triton.jit
def _attention_kernel(
    q_ptr, k_cache, v_cache, k_scale, v_scale, out_ptr, mid_o, mid_lse,
    query_start, query_len, seq_len, block_tables, tile_seq, tile_q0,
    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_bt, num_heads,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INT8: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q, b, token, head, rows, d, dmask, qpos, kv_len = _query_rows(
        q_ptr, query_start, query_len, seq_len, tile_seq, tile_q0, tile, kvh, stride_qt, stride_qh,
        GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D)
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, v, pos, pmask = _kv_tile(k_cache, v_cache, k_scale, v_scale, block_tables, q, b, kvh, n0, end, d,
                                    dmask, stride_ch, stride_bt, HEAD_DIM, PAGE, BLOCK_N, INT8)
        m_i, l_i, acc = _softmax_step(q, k, v, pos, pmask, rows, qpos, scale, m_i, l_i, acc, PRECISION)
    _write_rows(out_ptr, mid_o, mid_lse, acc, m_i, l_i, token, head, rows, d, dmask, split, stride_ot,
                stride_oh, num_heads, BLOCK_D, NUM_SPLITS)


@triton.jit
def _merge_kernel(mid_o, mid_lse, out_ptr, stride_ot, stride_oh, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    at = (t * num_heads + h) * NUM_SPLITS + sp
    lse = tl.load(mid_lse + at)
    top = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)))
    o = tl.load(mid_o + at[:, None] * BLOCK_D + d[None, :])
    merged = tl.sum(o * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, merged.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlatMetadata,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the flat queries q [T, H, D] over the cache [Hkv, blocks, block, D] per `meta`."""
    t, h, d = q.shape
    hk, _, page, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous() and h % hk == 0
    assert d >= 16, "head_dim >= 16 (tl.dot)"
    assert meta.num_splits & (meta.num_splits - 1) == 0, "num_splits: power of two"
    group, block_d, splits = h // hk, triton.next_power_of_2(d), meta.num_splits
    out = torch.empty_like(q) if out is None else out
    mid_o = mid_lse = out
    if splits > 1:
        mid_o = torch.empty(t * h * splits, block_d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(t * h * splits, dtype=torch.float32, device=q.device)
    int8 = k_cache.dtype == torch.int8
    grid = (meta.tile_seq.shape[0], hk, splits)
    _attention_kernel[grid](
        q, k_cache, v_cache, k_scale if int8 else k_cache, v_scale if int8 else v_cache, out, mid_o, mid_lse,
        meta.query_start, meta.query_len, meta.seq_len, meta.block_tables, meta.tile_seq, meta.tile_q0,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        meta.block_tables.stride(0), h,
        GROUP=group, BLOCK_Q=meta.block_q, BLOCK_M=max(16, triton.next_power_of_2(meta.block_q * group)),
        HEAD_DIM=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=BLOCK_N, NUM_SPLITS=splits, INT8=int8,
        PRECISION=dot_precision(q.dtype),
    )
    if splits > 1 and t:
        _merge_kernel[(t, h)](mid_o, mid_lse, out, out.stride(0), out.stride(1), h,
                              HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=splits)
    return out
