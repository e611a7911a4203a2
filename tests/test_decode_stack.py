"""The decoder stack in one C++ call (kernels.decode_stack) against the Python layers it stands in for:
bitwise the same logits, KV writes and greedy tokens, and used only where every layer and the step fit."""

from __future__ import annotations

import pytest
import torch

from sluice.engine import LLM, SamplingParams
from sluice.kernels import build_metadata, decode_stack, int8_weights, options
from sluice.kernels import linear as linear_kernels
from tests.test_engine import random_prompts

pytestmark = pytest.mark.skipif(not decode_stack.available(),
                                reason="no C++ toolchain, or a tier without a bf16 GEMV (not x86)")

KV = dict(dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.004)
WIDE = dict(hidden_size=128, intermediate_size=192)  # head_dim 32: the bf16 attention fast path


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The token count of every step that ran on a stack (its layers only, or with the model's ends:
    `logits`)."""
    calls = []
    run, logits = decode_stack.DecodeStack.run, decode_stack.DecodeStack.logits

    def spy_run(self, x, cos_sin, meta):
        calls.append(x.shape[0])
        return run(self, x, cos_sin, meta)

    def spy_logits(self, ids, positions, tables, meta):
        calls.append(ids.shape[0])
        return logits(self, ids, positions, tables, meta)

    monkeypatch.setattr(decode_stack.DecodeStack, "run", spy_run)
    monkeypatch.setattr(decode_stack.DecodeStack, "logits", spy_logits)
    return calls


def python_layers(monkeypatch) -> None:
    monkeypatch.setattr(decode_stack, "step_fits", lambda ids, dtype, meta: False)


def step(llm: LLM, query_lens: list[int], seed: int = 0, rows: list[int] | None = None) -> torch.Tensor:
    """Logits of every token of one step straight through the model (or of the listed rows: logits_indices):
    sequences with these query lengths over random contexts of up to 60 earlier positions, in randomly placed
    blocks of the pool."""
    g = torch.Generator().manual_seed(seed)
    runner, bs = llm.engine.runner, llm.engine.runner.block_size
    perm = torch.randperm(runner.kv_caches[0].k.shape[1], generator=g).tolist()
    contexts = [q + int(torch.randint(0, 60, (), generator=g)) for q in query_lens]
    tables, slots, positions = [], [], []
    for q, c in zip(query_lens, contexts, strict=True):
        tables.append(perm[:-(-c // bs)])
        perm = perm[len(tables[-1]):]
        positions += range(c - q, c)
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(c - q, c)]
    meta = build_metadata(query_lens, contexts, tables, torch.tensor(slots), bs, torch.device("cpu"),
                          fused=True)
    ids = torch.randint(4, llm.engine.model_config.vocab_size, (len(slots),), generator=g)
    with torch.inference_mode():
        return runner.model(ids, torch.tensor(positions), runner.kv_caches, meta,
                            None if rows is None else torch.tensor(rows))


def test_stack_builds_where_the_gemv_does():
    """The stack serves wherever the bf16 GEMV does (a build that failed would fall back silently)."""
    assert decode_stack.available() == linear_kernels.gemv_available()


MODELS = {  # (arch, overrides, quantization)
    "llama-gqa": ("llama", WIDE, None),
    "qwen2-bias": ("qwen2", {}, None),
    "int4-llama": ("llama", WIDE, "int4_weight_only"),
    "int4-qwen2-bias": ("qwen2", {}, "int4_weight_only"),
    "int8-llama": ("llama", WIDE,
                   "int8_weight_only"),  # the int8 GEMV to 4 rows, the dynamic int8 matmul above
    # down: 200 % 16, no GEMV
    "int8-qwen2-bias-odd": ("qwen2", dict(intermediate_size=200), "int8_weight_only"),
    "llm-int8-llama": ("llama", WIDE, "int8"),  # LLM.int8(): outlier columns at llm_int8_threshold (OUTLIERS)
    "llm-int8-qwen2-bias": ("qwen2", {}, "int8"),
    "nf4-llama": ("llama", WIDE, "int4"),  # bitsandbytes-format NF4, our 4-bit GEMV
    "nf4-qwen2-bias": ("qwen2", {}, "int4"),
}
# LLM.int8()'s threshold in these tests: most steps have outlier columns (6.0: hardly any here)
OUTLIERS = 1.0


def make_llm(checkpoint_factory, model: str, **kw) -> LLM:
    arch, overrides, quantization = MODELS[model]
    extra = dict(llm_int8_threshold=OUTLIERS) if quantization == "int8" else {}
    return LLM(checkpoint_factory(arch, **overrides, **kw), quantization=quantization, **KV, **extra)


def llm_int8_stacks() -> bool:
    """Whether LLM.int8() linears stack here: the bf16 epilogue passes of x86 tiers (elsewhere its forward
    runs torch ops, which the stack does not)."""
    fused = int8_weights._fused()
    return fused is not None and fused.BNB_INT8_EPILOGUE


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("query_lens", [[1], [1, 2], [1] * 8 + [3, 5]], ids=["1", "3", "16"])
def test_logits_and_kv_writes_are_bitwise_the_layers(checkpoint_factory, monkeypatch, stack_calls, model,
                                                     query_lens):
    """Decode and verify steps of 1, 3 and 16 tokens over random caches: the same logits and cache contents,
    bf16 and weight-only quantized."""
    llm = make_llm(checkpoint_factory, model)
    stacked = MODELS[model][2] != "int8" or llm_int8_stacks()
    assert (llm.engine.model._decode_stack(llm.engine.runner.kv_caches) is not None) == stacked
    against_the_layers(llm, monkeypatch, stack_calls, query_lens, stacked=stacked)


def test_llm_int8_steps_with_outlier_columns_are_bitwise_the_layers(checkpoint_factory, monkeypatch,
                                                                    stack_calls):
    """LLM.int8() on the stack where it serves: steps whose activations have outlier columns (counted in the
    Python layers' run) give the layers' logits and KV writes bit for bit, and so does a step with none
    (threshold 0)."""
    arch, overrides, _ = MODELS["llm-int8-llama"]
    path = checkpoint_factory(arch, **overrides)
    if not llm_int8_stacks():
        llm = LLM(path, quantization="int8", **KV)
        assert llm.engine.model._decode_stack(llm.engine.runner.kv_caches) is None
        return
    act, outliers = int8_weights.bnb_int8_act, []

    def counted(x, threshold):
        codes, rows, cols = act(x, threshold)
        outliers.append(cols.numel())
        return codes, rows, cols

    monkeypatch.setattr(int8_weights, "bnb_int8_act", counted)
    fits = decode_stack.step_fits
    for threshold, query_lens in ((OUTLIERS, [1]), (OUTLIERS, [1] * 8 + [3, 5]), (0.0, [1, 2])):
        llm = LLM(path, quantization="int8", llm_int8_threshold=threshold, **KV)
        outliers.clear()
        stack_calls.clear()
        monkeypatch.setattr(decode_stack, "step_fits", fits)
        against_the_layers(llm, monkeypatch, stack_calls, query_lens, stacked=True)
        assert outliers and (max(outliers) > 0) == (threshold > 0), outliers


@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias", "int8-llama", "int4-llama", "llm-int8-llama",
                                   "nf4-llama"])
@pytest.mark.parametrize("query_lens", [[1] * 17, [1] * 30 + [2, 3, 5], [1] * 64], ids=["17", "40", "64"])
def test_past_16_tokens_only_bf16_stacks_where_the_gemv_serves(checkpoint_factory, monkeypatch, stack_calls,
                                                               model, query_lens):
    """Steps of 17 to 64 tokens run on the stack only where every linear is bf16 and our GEMV call serves bf16
    rows past 16 (`linear.bf16_stack_rows`: the avx2 tier's GEMM, SLUICE_CPU_ISA=avx2 with oneDNN held to
    AVX2; the GEMV itself on AVX512-BF16 without AMX), there bitwise the Python layers' logits and KV writes;
    anywhere else (quantized linears, AMX, avx512 without bf16) the Python layers."""
    quantization = MODELS[model][2]
    llm = make_llm(checkpoint_factory, model)
    stack = llm.engine.model._decode_stack(llm.engine.runner.kv_caches)
    if quantization == "int8" and not llm_int8_stacks():
        assert stack is None
        return
    assert stack is not None
    rows = linear_kernels.bf16_stack_rows(2048)  # the checkpoints' linears are narrower: every row count
    assert stack.max_tokens == (max(16, rows) if quantization is None else 16) and rows in (16, 64)
    against_the_layers(llm, monkeypatch, stack_calls, query_lens, stacked=stack.max_tokens >= sum(query_lens))


def against_the_layers(llm: LLM, monkeypatch, stack_calls: list[int], query_lens: list[int],
                       stacked: bool) -> None:
    """One step over random caches on the stack (if `stacked`, else the Python layers: asserted) and on the
    Python layers: the same logits and cache contents."""
    caches = llm.engine.runner.kv_caches
    g = torch.Generator().manual_seed(1)
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=g))
        c.v.copy_(torch.randn(c.v.shape, generator=g))
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    first = step(llm, query_lens)
    assert stack_calls == ([sum(query_lens)] if stacked else [])
    after = [(c.k.clone(), c.v.clone()) for c in caches]
    for c, (k, v) in zip(caches, before, strict=True):
        c.k.copy_(k)
        c.v.copy_(v)
    python_layers(monkeypatch)
    reference = step(llm, query_lens)
    assert len(stack_calls) == int(stacked)
    assert torch.equal(first, reference)
    assert all(torch.equal(c.k, k) and torch.equal(c.v, v) for c, (k, v) in zip(caches, after, strict=True))


@pytest.mark.parametrize(("model", "tied"), [("llama-gqa", False), ("llama-gqa", True), ("int4-llama", False),
                                             ("int8-llama", True), ("llm-int8-llama", False),
                                             ("nf4-llama", False)])
def test_model_ends_run_on_the_stack_where_every_row_is_wanted(checkpoint_factory, monkeypatch, model, tied):
    """Every row wanted (decode, verify): the embedding, final norm and LM head (tied or its own, quantized or
    not) run inside the stack's `logits`, bitwise what the stack's layers plus the Python ends give; a subset
    of rows keeps the Python ends."""
    llm = make_llm(checkpoint_factory, model, tie_word_embeddings=tied)
    stack = llm.engine.model._decode_stack(llm.engine.runner.kv_caches)
    if MODELS[model][2] == "int8" and not llm_int8_stacks():
        assert stack is None
        return
    assert stack is not None and stack.has_head
    ends = []
    real = decode_stack.DecodeStack.logits
    monkeypatch.setattr(decode_stack.DecodeStack, "logits", lambda self, *a: ends.append(1) or real(self, *a))
    query_lens = [1, 3, 1]
    snapshot = [(c.k.clone(), c.v.clone()) for c in llm.engine.runner.kv_caches]
    on_stack = step(llm, query_lens)
    assert ends == [1]
    for c, (k, v) in zip(llm.engine.runner.kv_caches, snapshot, strict=True):
        c.k.copy_(k)
        c.v.copy_(v)
    python_ends = step(llm, query_lens, rows=list(range(5)))
    assert ends == [1], "rows given: the stack's layers, the Python ends"
    assert on_stack.shape == (5, llm.engine.model_config.vocab_size) and torch.equal(on_stack, python_ends)
    subset = step(llm, query_lens, rows=[4, 0])
    if MODELS[model][2] is None:
        assert torch.equal(subset, on_stack[[4, 0]])
    else:  # a quantized head's row tiles (W4A8: 4 + 1 rows, or 2) may sum its groups in another order
        assert torch.allclose(subset.float(), on_stack[[4, 0]].float(), rtol=2**-7, atol=2**-10)


def test_used_for_short_queries_only(checkpoint_factory, stack_calls):
    """Up to `decode_stack.max_tokens()` tokens of short queries (16; a bf16 stack's to 64 where our GEMV call
    serves those rows); a long query (prefill) or one token more runs the Python layers."""
    llm = LLM(checkpoint_factory("llama"), **KV)
    most = decode_stack.max_tokens()
    assert most == max(16, linear_kernels.bf16_stack_rows(1)) and most in (16, 64)
    for query_lens in ([1], [16], [1] * 16, [17], [20, 1], [1] * most, [1] * (most + 1)):
        step(llm, query_lens)
    assert stack_calls == [1, 16, 16, most]
    out = llm.generate([list(range(4, 34))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       progress=False)
    assert len(out[0].token_ids) == 4 and stack_calls[4:] == [1, 1,
                                                              1], "prefill in Python, decode on the stack"


@pytest.mark.parametrize(("arch", "kw"), [("llama", dict(kv_cache_dtype="int8")), ("qwen3", {})],
                         ids=["int8-kv", "qk-norm"])
def test_not_used_where_a_layer_does_not_fit(checkpoint_factory, stack_calls, arch, kw):
    llm = LLM(checkpoint_factory(arch), **{**KV, **kw})
    out = llm.generate(random_prompts(3), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       progress=False)
    assert all(len(o.token_ids) == 4 for o in out)
    assert not stack_calls
    assert llm.engine.model._decode_stack(llm.engine.runner.kv_caches) is None


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize(("spec", "quantization"), [(None, None), (NGRAM, None), (None, "int4_weight_only"),
                                                    (NGRAM, "int8_weight_only"), (NGRAM, "int8"),
                                                    (NGRAM, "int4")],
                         ids=["decode", "ngram", "int4-decode", "int8-ngram", "llm-int8-ngram", "nf4-ngram"])
def test_greedy_generate_is_unchanged(checkpoint_factory, monkeypatch, stack_calls, spec, quantization):
    """Greedy tokens and their logprobs, with speculative verify steps too, as the Python layers give them."""
    path = checkpoint_factory("llama", **WIDE)
    base = random_prompts(4, 10, 30, seed=3)
    prompts = [p * 3 for p in base]  # repeated spans: n-gram lookup proposes
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    kw = {**KV, "quantization": quantization,
          **({} if spec is None else {"speculative": {"disable_by_batch_size": 64, **spec}}),
          **(dict(llm_int8_threshold=OUTLIERS) if quantization == "int8" else {})}
    stacked = LLM(path, **kw).generate(prompts, params, progress=False)
    if quantization == "int8" and not llm_int8_stacks():
        assert not stack_calls
        return
    assert stack_calls and (spec is None or max(stack_calls) > 4)
    python_layers(monkeypatch)
    calls = len(stack_calls)
    reference = LLM(path, **kw).generate(prompts, params, progress=False)
    assert len(stack_calls) == calls
    assert [o.token_ids for o in stacked] == [o.token_ids for o in reference]
    assert [o.logprobs for o in stacked] == [o.logprobs for o in reference]


def test_a_wide_linear_bounds_the_rows_of_a_bf16_stack(checkpoint_factory):
    """A bf16 stack runs our GEMV's rows for its widest linear: on AVX512-BF16 without AMX 64 rows while x
    stays in L2, so an MLP 4,096 wide takes 32 (64 at any width where its weights are packed into panels,
    `linear.panels_serve`); the avx2 tier's GEMM takes 64 at any width."""
    llm = LLM(checkpoint_factory("llama", hidden_size=128, intermediate_size=4096), **KV)
    stack = llm.engine.model._decode_stack(llm.engine.runner.kv_caches)
    assert stack is not None and stack.max_tokens == max(16, linear_kernels.bf16_stack_rows(4096))
    assert stack.max_tokens <= decode_stack.max_tokens()
    if linear_kernels.onednn_bf16() and not linear_kernels.onednn_amx():
        wide = 64 if linear_kernels.panels_serve() else 32
        assert [linear_kernels.bf16_stack_rows(k) for k in (4096, 2048)] == [wide, 64]
        options.use(options.current().merged(packed_weights=False))
        try:
            assert [linear_kernels.bf16_stack_rows(k) for k in (4096, 2048)] == [32, 64]
        finally:
            options.reset()
