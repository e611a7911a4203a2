"""Every Triton kernel under TRITON_INTERPRET=1 (fp32/fp16: the interpreter has no bf16 dot) vs the torch
reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it before triton can load (triton reads it at import)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton cannot be imported on this platform")

from sluice.kernels.attention import build_metadata, paged_attention  # noqa: E402
from sluice.kernels.flat_attention import flat_attention, write_kv_flat  # noqa: E402
from sluice.kernels.flat_metadata import build_flat_metadata  # noqa: E402
from sluice.kernels.int8_weights import int8_linear  # noqa: E402
from sluice.kernels.kv_int8 import dequantize_blocks, write_kv_int8  # noqa: E402
from sluice.kernels.triton.kv_store import triton_store_kv  # noqa: E402
from sluice.kernels.triton.paged_attention import triton_paged_attention as triton_attention  # noqa: E402
from sluice.kernels.triton.w8a16 import w8a16_linear  # noqa: E402

HK, D, BS, NB = 2, 16, 8, 128
CPU = torch.device("cpu")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def layout(query_lens, context_lens, seed=0):
    """Random block tables over a shuffled pool and the slots of each sequence's new tokens."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB, generator=g).tolist()
    tables, slots, used = [], [], 0
    for q, c in zip(query_lens, context_lens, strict=True):
        n = -(-c // BS)
        t = perm[used:used + n]
        used += n
        tables.append(t)
        slots += [t[p // BS] * BS + p % BS for p in range(c - q, c)]
    return tables, slots


def caches(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(HK, NB, BS, D, generator=g).to(dtype) for _ in range(2)]


def reference(q, kc, vc, query_lens, context_lens, tables, slots):
    """The engine's torch paged attention (padded groups + SDPA) over the same cache."""
    idx = torch.tensor(slots, dtype=torch.long)
    k_new, v_new = (c.view(HK, -1, D)[:, idx].transpose(0, 1) for c in (kc, vc))
    meta = build_metadata(query_lens, context_lens, tables, idx, BS, CPU)
    return paged_attention(q, k_new, v_new, kc, vc, meta, D**-0.5)


def check_attention(query_lens, context_lens, group, dtype, splits, int8=False, pad=0):
    tables, slots = layout(query_lens, context_lens)
    kc, vc = caches(torch.float32)
    q = torch.randn(sum(query_lens) + pad, HK * group, D).to(dtype)
    scales = None
    if int8:
        ks, vs = (torch.zeros(HK, NB, BS, dtype=torch.float16) for _ in range(2))
        qk, qv = (torch.zeros(HK, NB, BS, D, dtype=torch.int8) for _ in range(2))
        all_slots = torch.arange(NB * BS)
        write_kv_int8(qk, ks, kc.view(HK, -1, D).transpose(0, 1), all_slots)
        write_kv_int8(qv, vs, vc.view(HK, -1, D).transpose(0, 1), all_slots)
        blocks = torch.arange(NB)
        kc, vc = dequantize_blocks(qk, ks, blocks, dtype), dequantize_blocks(qv, vs, blocks, dtype)
        scales = (ks, vs)
    kc, vc = kc.to(dtype), vc.to(dtype)
    want = reference(q[: sum(query_lens)], kc, vc, query_lens, context_lens, tables, slots)
    meta = build_flat_metadata(query_lens + [1] * pad, context_lens + [0] * pad, tables + [[]] * pad,
                               slots + [-1] * pad, CPU, HK, num_splits=splits)
    cache_args = (qk, qv) if int8 else (kc, vc)
    got = triton_attention(q, *cache_args, meta, D**-0.5, *(scales or ()))
    flat = flat_attention(q, *cache_args, meta, D**-0.5, *(scales or ()))
    n = sum(query_lens)
    assert (got[:n].float() - want.float()).abs().max().item() < TOL[dtype]
    assert (flat[:n].float() - want.float()).abs().max().item() < TOL[dtype]
    assert torch.equal(got[n:], torch.zeros_like(got[n:])) and torch.equal(flat[n:],
                                                                           torch.zeros_like(flat[n:]))


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_contexts_and_groups(group, dtype):
    contexts = [1, BS, BS + 1, 3 * BS + 5]
    check_attention([1] * len(contexts), contexts, group, dtype, splits=1)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_merge_with_padding_rows(splits):
    contexts = [1, BS, BS + 1, 40, 70]
    check_attention([1] * len(contexts), contexts, 4, torch.float32, splits=splits, pad=3)


@pytest.mark.parametrize("query_len", [2, 5, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_verify_query_lengths_are_causal(query_len, group):
    contexts = [query_len, query_len + 1, query_len + BS, query_len + 37]
    check_attention([query_len] * len(contexts), contexts, group, torch.float32, splits=2)


def test_mixed_query_lengths_one_to_sixteen():
    qls = list(range(1, 17))
    check_attention(qls, [q + 3 * i for i, q in enumerate(qls)], 4, torch.float16, splits=1, pad=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_and_chunked_prefill_in_one_batch(dtype):
    check_attention([40, 17, 1, 23], [40, 50, 9, 23 + BS + 1], 3, dtype, splits=1)


@pytest.mark.parametrize("group", [1, 4])
def test_int8_kv_dequantized_in_registers(group):
    check_attention([1, 1, 4, 1], [1, BS + 1, 20, 45], group, torch.float16, splits=2, int8=True, pad=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_store_skips_padding_slots(dtype):
    t = 12
    k = torch.randn(t, HK, D).to(dtype)
    # a view of a fused qkv row
    v = torch.randn(t, 3 * HK * D).to(dtype)[:, HK * D: 2 * HK * D].view(t, HK, D)
    slots = torch.randperm(NB * BS)[:t]
    slots[[3, 7, 11]] = -1
    kc, vc = caches(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    keep = slots >= 0
    want_k.view(HK, -1, D)[:, slots[keep]] = k[keep].transpose(0, 1)
    want_v.view(HK, -1, D)[:, slots[keep]] = v[keep].transpose(0, 1)
    got_k, got_v = kc.clone(), vc.clone()
    triton_store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    flat_k, flat_v = kc.clone(), vc.clone()
    write_kv_flat(flat_k, flat_v, k, v, slots)
    assert torch.equal(flat_k, want_k) and torch.equal(flat_v, want_v)


def test_int8_kv_store_matches_torch_quantization():
    t = 10
    k, v = torch.randn(t, HK, D) * 3, torch.randn(t, HK, D)
    k[2] = 0.0
    slots = torch.randperm(NB * BS)[:t]
    slots[5] = -1
    keep = slots >= 0
    want = [torch.zeros(HK, NB, BS, D, dtype=torch.int8) for _ in range(2)]
    want_s = [torch.zeros(HK, NB, BS, dtype=torch.float16) for _ in range(2)]
    write_kv_int8(want[0], want_s[0], k[keep], slots[keep])
    write_kv_int8(want[1], want_s[1], v[keep], slots[keep])
    got = [torch.zeros_like(w) for w in want]
    got_s = [torch.zeros_like(s) for s in want_s]
    triton_store_kv(k, v, got[0], got[1], slots, got_s[0], got_s[1])
    for a, b in zip(got + got_s, want + want_s, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_gemv_and_gemm_match_reference(rows, dtype):
    n, k = 96, 80
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) / 100).to(dtype)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    want = (x.float() @ qweight.float().T) * scales.float() + bias.float()
    got = w8a16_linear(x, qweight, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((got.float() - want).abs() / want.abs().clamp_min(1)).max().item() < tol
    assert (int8_linear(x, qweight, scales, bias).float() - got.float()).abs().max().item() < 20 * tol
