"""The vectorized CPU paged-attention kernel (plain and int8 caches) against a float64 reference, and the int8
KV cache's fused path against its dequantize-then-attend path, down to greedy engine output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sluice.engine import LLM, SamplingParams
from sluice.engine import kv_cache as int8_cache
from sluice.engine.kv_cache import StepBlocks, layer_caches
from sluice.kernels import cpu_attention, cpu_isa, decode_stack, dispatch, options
from sluice.kernels.attention import build_metadata, paged_attention
from sluice.kernels.int8_heads import quantize_heads
from tests.tiers import tier_fixture

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ toolchain for the CPU kernel")

BS, NB, D = 16, 160, 64
# query lengths 1-16 against contexts 1, block_size, block_size + 1 and long ones (split when chunk > 0)
QUERY_LENS = [1, 1, 1, 4, 16, 1, 7, 2, 16]
CONTEXT_LENS = [1, BS, BS + 1, BS, 40, 700, 333, 1000, 16]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
cpu_tier = tier_fixture(autouse=False)


def layout(context_lens, seed=0):
    """Block tables drawn from a shuffled pool, so no sequence's blocks are contiguous."""
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for c in context_lens:
        n = -(-c // BS)
        tables.append(perm[used:used + n])
        used += n
    return tables


def kernel_args(query_lens, context_lens, tables):
    starts = torch.tensor([sum(query_lens[:i]) for i in range(len(query_lens))])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return starts, torch.tensor(query_lens), torch.tensor(context_lens), bt


def reference(q, kc, vc, query_lens, context_lens, tables, scale, bs=BS):
    """Causal attention in float64 per sequence over its keys laid out contiguously (GQA by repetition)."""
    hk, h = kc.shape[0], q.shape[1]
    out, start = [], 0
    for ql, c, t in zip(query_lens, context_lens, tables, strict=True):
        pos = torch.arange(c)
        idx = torch.tensor(t)[pos // bs] * bs + pos % bs
        k = kc.reshape(hk, -1, D)[:, idx].double().repeat_interleave(h // hk, 0)
        v = vc.reshape(hk, -1, D)[:, idx].double().repeat_interleave(h // hk, 0)
        qs = q[start:start + ql].transpose(0, 1).double()
        s = (qs @ k.transpose(1, 2)) * scale
        s = s.masked_fill(pos[None, :] > torch.arange(c - ql, c)[:, None], float("-inf"))
        out.append((s.softmax(-1) @ v).transpose(0, 1))
        start += ql
    return torch.cat(out)


def run_kernel(q, kc, vc, query_lens, context_lens, tables, chunk, k_scale=None, v_scale=None):
    out = torch.full_like(q, float("nan"))
    cpu_attention.paged_attention_cpu(q, kc, vc, out, *kernel_args(query_lens, context_lens, tables), D**-0.5,
                                      k_scale, v_scale, chunk)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
# automatic; long contexts split and merged; every position alone
@pytest.mark.parametrize("chunk", [0, 64, 1])
def test_kernel_matches_float64_reference(dtype, group, chunk, cpu_tier):
    hk = 2
    g = torch.Generator().manual_seed(group)
    kc, vc = (torch.randn(hk, NB, BS, D, generator=g).to(dtype) for _ in range(2))
    q = (torch.randn(sum(QUERY_LENS), hk * group, D, generator=g) * 2).to(dtype)
    tables = layout(CONTEXT_LENS)
    got = run_kernel(q, kc, vc, QUERY_LENS, CONTEXT_LENS, tables, chunk)
    want = reference(q, kc, vc, QUERY_LENS, CONTEXT_LENS, tables, D**-0.5)
    assert got.dtype == dtype and not got.isnan().any(), "every query row is written"
    assert (got.double() - want).abs().max().item() < TOL[dtype]


def test_batch_one_long_context_splits_across_threads_and_matches(cpu_tier):
    """One sequence and one kv head: the automatic plan splits the context, the merge is exact."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kc, vc = (torch.randn(1, NB, BS, D) for _ in range(2))
        q = torch.randn(3, 4, D)
        tables = layout([1500])
        got = run_kernel(q, kc, vc, [3], [1500], tables, 0)
        whole = run_kernel(q, kc, vc, [3], [1500], tables, 10**6)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, kc, vc, [3], [1500], tables, D**-0.5)
    assert (got.double() - want).abs().max().item() < 2e-5
    assert (whole.double() - want).abs().max().item() < 2e-5


def shared_prefix_batch(share: int):
    """Four sequences whose tables begin with the same `share` blocks (one prefix-cache hit), a fifth
    sharing only half of them, a sixth none; and the batch with every shared block copied per sequence."""
    query_lens = [1, 1, 4, 16, 2, 3]
    context_lens = [share * BS + 1, share * BS + 80, share * BS + 40, share * BS + 16, share * BS + 180, 200]
    pool = iter(torch.randperm(NB, generator=torch.Generator().manual_seed(5)).tolist())
    prefix = [next(pool) for _ in range(share)]
    heads = [prefix] * 4 + [prefix[:share // 2], []]
    tables = [h + [next(pool) for _ in range(-(-c // BS) - len(h))]
              for h, c in zip(heads, context_lens, strict=True)]
    copies = {}  # (sequence, shared block) -> its own block
    for i, h in enumerate(heads):
        for b in h:
            copies[i, b] = next(pool)
    apart = [[copies.get((i, b), b) for b in t] for i, t in enumerate(tables)]
    return query_lens, context_lens, tables, apart, copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_shared_prefix_blocks_are_attended_once_with_the_bits_of_attending_them_apart(dtype, group, cpu_tier):
    """A prefix shared by several sequences' tables (cascade attention) gives each row exactly the output it
    has when every sequence holds its own copy of those blocks, and matches the float64 reference."""
    hk = 2
    query_lens, context_lens, tables, apart, copies = shared_prefix_batch(20)
    g = torch.Generator().manual_seed(11)
    kc, vc = (torch.randn(hk, NB, BS, D, generator=g).to(dtype) for _ in range(2))
    for (_, b), own in copies.items():
        kc[:, own], vc[:, own] = kc[:, b], vc[:, b]
    q = (torch.randn(sum(query_lens), hk * group, D, generator=g) * 2).to(dtype)
    shared = run_kernel(q, kc, vc, query_lens, context_lens, tables, 10**6)
    alone = run_kernel(q, kc, vc, query_lens, context_lens, apart, 10**6)
    assert torch.equal(shared, alone)
    want = reference(q, kc, vc, query_lens, context_lens, tables, D**-0.5)
    assert (shared.double() - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_over_small_blocks_out_of_order_reads_each_block(dtype, cpu_tier):
    """Blocks of 4 positions laid out 0, 2, 1, 3 in the pool: a 16-key tile's first and last keys sit where
    one contiguous run would put them, its middle blocks swapped; the kernel reads them block by block."""
    bs, hk, group = 4, 2, 3
    g = torch.Generator().manual_seed(13)
    kc, vc = (torch.randn(hk, 16, bs, D, generator=g).to(dtype) for _ in range(2))
    tables = [[0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11], [0, 2, 1, 3, 12, 14, 13, 15]]
    query_lens, context_lens = [1, 5], [48, 30]
    q = torch.randn(sum(query_lens), hk * group, D, generator=g).to(dtype)
    got = run_kernel(q, kc, vc, query_lens, context_lens, tables, 0)
    want = reference(q, kc, vc, query_lens, context_lens, tables, D**-0.5, bs=bs)
    assert (got.double() - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [0, 64])
def test_int8_cache_read_by_the_kernel_matches_dequantize_then_attend(dtype, chunk, cpu_tier):
    hk, group = 2, 3
    g = torch.Generator().manual_seed(7)
    (kq, ks), (vq, vs) = (quantize_heads(torch.randn(hk, NB, BS, D, generator=g) * 3) for _ in range(2))
    q = torch.randn(sum(QUERY_LENS), hk * group, D, generator=g).to(dtype)
    tables = layout(CONTEXT_LENS, seed=3)
    got = run_kernel(q, kq, vq, QUERY_LENS, CONTEXT_LENS, tables, chunk, ks, vs)
    kd, vd = (x.double() * s.double()[..., None] for x, s in ((kq, ks), (vq, vs)))
    want = reference(q, kd, vd, QUERY_LENS, CONTEXT_LENS, tables, D**-0.5)
    assert got.dtype == dtype and (got.double() - want).abs().max().item() < TOL[dtype] * 3


def test_int8_layer_cache_reads_only_long_sequences_blocks_into_a_copy():
    """A step mixing decode, verify and a prefill chunk: same output with the kernel (metadata built for it,
    as the step plan asks) as without it, and the dequantized copy holds only the prefill chunk's blocks."""
    c = SimpleNamespace(num_kv_heads=2, head_dim=D, num_layers=1)  # all layer_caches reads of a ModelConfig
    query_lens, context_lens = [1, 5, 40, 1], [30, 70, 90, 1]
    tables = layout(context_lens)
    slots = torch.tensor([t[p // BS] * BS + p % BS
                          for q, n, t in zip(query_lens, context_lens, tables, strict=True)
                          for p in range(n - q, n)])
    past = torch.tensor([t[p // BS] * BS + p % BS
                         for q, n, t in zip(query_lens, context_lens, tables, strict=True)
                         for p in range(n - q)])
    torch.manual_seed(0)
    outs = []
    for fused in (True, False):
        cache = layer_caches(c, NB, BS, torch.int8, torch.float32, torch.device("cpu"))[0]
        torch.manual_seed(1)
        cache.write(torch.randn(len(past), 2, D), torch.randn(len(past), 2, D), past)
        k, v, q = torch.randn(len(slots), 2, D), torch.randn(len(slots), 2, D), torch.randn(len(slots), 6, D)
        cache.write(k, v, slots)
        meta = build_metadata(query_lens, context_lens, tables, slots, BS, torch.device("cpu"), fused=fused)
        outs.append(cache.attend(q, k, v, meta, D**-0.5))
        used, _, args = cache.step.of(meta, NB)
        assert (args is not None) == fused
        if fused:
            assert sorted(used.tolist()) == sorted(tables[2]), "only the prefill chunk's blocks"
        else:
            assert set(sum(tables, [])) <= set(used.tolist())
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4
    assert isinstance(cache.step, StepBlocks)


# How far the two paths' logits may differ (fp32: summation order, which on the avx2 tier's 8-lane sums
# reaches 1e-4 at the test model's logits, hence twice that; bf16: the torch path rounds its dequantized
# copy to bf16, so four bf16 ulps at the test model's logits, all under 1 in magnitude). A position counts as
# agreeing when both paths pick the same token, or when the kernel's pick is within TIE_MARGIN (twice that:
# two logits each off by it) of the torch path's maximum, a near-tie another summation order may break the
# other way.
LOGIT_DIFF = {"float32": 2e-4, "bfloat16": 4 * 2**-8}
TIE_MARGIN = {dtype: 2 * diff for dtype, diff in LOGIT_DIFF.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_argmax_with_int8_kv_is_unchanged_by_the_kernel_teacher_forced(checkpoint_factory, monkeypatch,
                                                                              request, dtype):
    """Teacher-forced: the same token sequences (prompts and the kernel path's greedy continuations) scored
    through the engine with the kernel and with SLUICE_CPU_KERNEL=0, prefill chunked to short queries so the
    kernel reads the int8 cache at every position; the logits agree within LOGIT_DIFF, and each position's
    argmax agrees, near-ties within TIE_MARGIN counting."""
    ckpt = checkpoint_factory("llama", hidden_size=192, intermediate_size=256, num_attention_heads=6,
                              num_key_value_heads=2)
    calls = []
    real = int8_cache.paged_attention_cpu
    monkeypatch.setattr(int8_cache, "paged_attention_cpu", lambda *a: calls.append(1) or real(*a))
    prompts = [[1, *range(5, 5 + n)] for n in (6, 30, 70)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype=dtype, device="cpu", kv_cache_dtype="int8", kv_cache_memory_gb=0.002,
              max_num_batched_tokens=16)
    fused_llm = LLM(ckpt, **kw)
    sequences = [p + o.token_ids for p, o in zip(prompts, fused_llm.generate(prompts, params, progress=False),
                                                  strict=True)]
    calls.clear()
    fused = fused_llm.score(sequences)
    assert calls, "the chunked prefill read the int8 cache through the kernel"
    monkeypatch.setenv("SLUICE_CPU_KERNEL", "0")
    options.reset()
    request.addfinalizer(options.reset)  # read again once the environment is restored
    calls.clear()
    plain = LLM(ckpt, **kw).score(sequences)
    assert not calls, "SLUICE_CPU_KERNEL=0 keeps the torch path"
    for ours, theirs in zip(fused, plain, strict=True):
        ours, theirs = ours.float(), theirs.float()
        assert ours.shape == theirs.shape and ours.shape[0] > 1
        assert theirs.abs().max() < 1 and (ours - theirs).abs().max() <= LOGIT_DIFF[dtype]
        picked = theirs.gather(1, ours.argmax(-1, keepdim=True)).squeeze(1)
        gap = theirs.max(-1).values - picked
        assert (gap <= TIE_MARGIN[dtype]).all(), gap.max()


def test_bf16_prefills_join_the_kernel_where_it_has_bf16_dot_products():
    """With `fused_prefill` (bf16 over a bf16 cache where the kernel has `vdpbf16ps`: the step plan asks for
    it exactly there) a step's fresh prefill and prefill chunk run on the kernel beside its decode and verify
    rows, no torch SDPA and no decode stack, matching the float64 reference and the torch path."""
    query_lens, context_lens = [1, 40, 100, 3], [30, 90, 100, 50]  # decode, chunk, fresh prefill, verify
    tables = layout(context_lens, seed=5)
    slots = torch.tensor([t[p // BS] * BS + p % BS
                          for q, n, t in zip(query_lens, context_lens, tables, strict=True)
                          for p in range(n - q, n)])
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(2, NB, BS, D, generator=g).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(sum(query_lens), 6, D, generator=g) * 2).to(torch.bfloat16)
    k, v = (c.view(2, -1, D)[:, slots].transpose(0, 1) for c in (kc, vc))  # this step's rows, already written
    cpu = torch.device("cpu")
    fused = build_metadata(query_lens, context_lens, tables, slots, BS, cpu, fused=True, fused_prefill=True)
    torch_path = build_metadata(query_lens, context_lens, tables, slots, BS, cpu, fused=True)
    assert fused.fused_long and not fused.long_seqs and fused.fused_short[1].tolist() == query_lens
    assert not torch_path.fused_long and [s.query_len for s in torch_path.long_seqs] == [40, 100]
    assert not decode_stack.step_fits(torch.zeros(len(slots), dtype=torch.long), torch.bfloat16, fused)
    serves = cpu_attention.serves_prefill(torch.bfloat16, torch.bfloat16)
    assert dispatch.plan(cpu, torch.bfloat16, torch.bfloat16).fused_prefill == serves
    assert not dispatch.plan(cpu, torch.float32, torch.float32).fused_prefill
    assert serves == (cpu_attention.available() and cpu_isa.tier() in ("avx512_bf16", "amx"))
    if not serves:
        return
    got = paged_attention(q, k, v, kc, vc, fused, D**-0.5)
    want = reference(q, kc, vc, query_lens, context_lens, tables, D**-0.5)
    assert (got.double() - want).abs().max().item() < TOL[torch.bfloat16]
    assert (got.double() - paged_attention(q, k, v, kc, vc, torch_path, D**-0.5).double()).abs().max() < 0.04
