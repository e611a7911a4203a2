"""Architectures beyond the dense native four against transformers: the generic path (transformers' modules
over our paged KV cache) and the native MoE forward."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

import sluice.engine.models.generic as generic
from sluice.engine import LLM, SamplingParams
from sluice.engine.models import GENERIC, NATIVE, LlamaModel, ModelConfig, forced_generic, model_path_for
from sluice.engine.models.generic import GenericModel, SiblingLinear
from sluice.engine.models.loader import read_config
from sluice.kernels import cpu_isa
from sluice.kernels import expert_kernel as moe_kernel
from sluice.kernels.linear import Linear
from tests.test_engine import random_prompts
from tests.tiers import tier_fixture

# The architectures beyond the dense native four, and the path each takes (Mixtral and Qwen3-MoE: native MoE).
ARCH_PATHS = {"gemma2": GENERIC, "gemma3_text": GENERIC, "phi3": GENERIC, "olmo2": GENERIC,
              "granite": GENERIC,
              "gpt_neox": GENERIC, "qwen2_moe": GENERIC, "starcoder2": GENERIC, "mixtral": NATIVE,
              "qwen3_moe": NATIVE}
GREEDY = SamplingParams(max_tokens=24, temperature=0)
BLOCK = 16
cpu_tier = tier_fixture(autouse=False)  # the MoE kernel test runs on every CPU tier this host can execute


def hf_model(path):
    """The reference: transformers' eager attention (the one that honors windows and soft-caps exactly)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_greedy(path, prompts, max_new_tokens=24) -> list[list[int]]:
    model = hf_model(path)
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                           do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def block_bytes(path) -> int:
    c = ModelConfig.from_hf(read_config(path))
    return BLOCK * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # fp32


@pytest.fixture(scope="module", params=list(ARCH_PATHS))
def generic_case(request, checkpoint_factory):
    path = checkpoint_factory(request.param)
    prompts = random_prompts(8)
    return request.param, path, prompts, hf_greedy(path, prompts)


def test_greedy_matches_transformers_with_chunks_and_preemption(generic_case):
    arch, path, prompts, ref = generic_case
    assert model_path_for(read_config(path))[0] == ARCH_PATHS[arch]
    llm = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, max_num_batched_tokens=32,
              kv_cache_memory_gb=16 * block_bytes(path) / 1024**3)
    model_class = GenericModel if ARCH_PATHS[arch] == GENERIC else LlamaModel
    assert isinstance(llm.engine.model, model_class) and llm.engine.num_blocks == 16
    outs = llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["steps"] > sum(len(p) for p in prompts) // 32


def test_prompt_logits_match_transformers(generic_case):
    _, path, prompts, _ = generic_case
    model = hf_model(path)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=48)
    for p, logits in zip(prompts[:4], llm.score(prompts[:4]), strict=True):
        want = model(torch.tensor([p])).logits[0]
        assert logits.shape == want.shape
        assert (logits - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "olmo2"])
def test_prefix_cache_hits_match(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    system = random_prompts(1, 70, 71, seed=7)[0]
    shared = [system + p[:20] for p in random_prompts(5)]
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=2)
    ref = hf_greedy(path, shared, max_new_tokens=8)  # transformers stops at EOS too: compare up to it
    outs = llm.generate(shared, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), progress=False)
    assert [o.token_ids[: len(r)] for o, r in zip(outs, ref, strict=True)] == ref
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 3 * 64


@pytest.mark.parametrize("arch", ["gemma2", "olmo2"])
def test_int8_kv_cache_close_to_transformers(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompts = random_prompts(4, 20, 80)
    model = hf_model(path)
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype="int8", max_num_batched_tokens=32)
    for p, logits in zip(prompts, llm.score(prompts), strict=True):
        want = model(torch.tensor([p])).logits[0]
        err = (logits - want).norm() / want.norm()
        assert 0 < err < 0.05


def test_speculative_decoding_with_generic_target_and_draft(checkpoint_factory):
    target = checkpoint_factory("olmo2")
    draft = checkpoint_factory("olmo2", seed=5, num_hidden_layers=1)
    prompts = [p * 3 for p in random_prompts(4, 10, 30, seed=3)]
    ref = hf_greedy(target, prompts)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}):
        llm = LLM(target, dtype="float32", device="cpu", speculative={"disable_by_batch_size": 64, **spec})
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, progress=False)] == ref
        assert llm.stats()["spec_proposed"] > 0


def test_model_path_for_says_which_path_and_why(checkpoint_factory):
    llama = read_config(checkpoint_factory("llama"))
    assert model_path_for(llama)[0] == NATIVE
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 256}
    path, why = model_path_for({**llama, "rope_parameters": yarn})
    assert path == GENERIC and "yarn" in why
    path, why = model_path_for(read_config(checkpoint_factory("gemma2")))
    assert path == GENERIC and "Gemma2ForCausalLM" in why


@pytest.mark.parametrize(("cfg", "feature"), [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModel": "x.Y"},
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "trust_remote_code"),
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, "linear_attention"),
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "latent attention"),
    ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, "attention sinks"),
    ({"model_type": "llama", "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
])
def test_unservable_models_are_refused_naming_the_feature(cfg, feature):
    with pytest.raises(ValueError, match=feature):
        model_path_for(cfg)
    with pytest.raises(ValueError, match=f"{feature}.*natively supported: LlamaForCausalLM"):
        ModelConfig.from_hf(cfg)


def test_length_dependent_rope_is_capped_at_its_original_context(checkpoint_factory):
    cfg = read_config(checkpoint_factory("phi3"))
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8, "original_max_position_embeddings": 256}
    c = ModelConfig.from_hf({**cfg, "rope_parameters": rope, "original_max_position_embeddings": 256})
    assert c.path == GENERIC and c.max_position_embeddings == 256


@pytest.mark.parametrize(("method", "linear"),
                         [("int8_weight_only", "Int8WeightOnlyLinear"), ("int8", "LLMInt8Linear")])
def test_native_moe_quantizes_every_expert_and_keeps_the_router(method, linear, checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    prompts = random_prompts(3, 20, 60)
    ref = LLM(path, dtype="bfloat16", device="cpu").score(prompts)
    llm = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    for layer in llm.engine.model.layers:
        assert {type(p).__name__ for e in layer.mlp.experts for p in e.children()} == {linear}
        assert type(layer.mlp.gate).__name__ == "Router"
    got = llm.score(prompts)
    # bound: the error measured on this random checkpoint plus a margin (docs/benchmarks.md)
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(got, ref, strict=True)]
    assert 0 < max(errors) < 0.03


def test_moe_groups_tokens_by_expert_exactly_as_transformers(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    hf = hf_model(path).model.layers[1].mlp
    ours = LLM(path, dtype="float32", device="cpu").engine.model.layers[1].block_sparse_moe
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    calls = []
    for e in ours.experts:  # every expert runs once per step on all of its tokens
        e.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    with torch.inference_mode():
        got, want = ours(x), hf(x[None])[0]
    assert (got - want).abs().max().item() < 1e-5
    assert len(calls) <= len(ours.experts) and sum(calls) == 300 * ours.top_k


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generic_path_on_a_native_architecture_matches_transformers(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompts = random_prompts(6)
    with forced_generic():
        assert model_path_for(read_config(path)) == (GENERIC, f"{read_config(path)['architectures'][0]}: "
                                                               f"generic path forced")
        llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32)
    assert isinstance(llm.engine.model, GenericModel)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, progress=False)] == hf_greedy(path, prompts)


def test_generic_path_runs_sibling_linears_as_one_product(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    prompts = random_prompts(3, 20, 40)
    with forced_generic():
        fused = LLM(path, dtype="bfloat16", device="cpu")
        with monkeypatch.context() as m:
            m.setattr(generic, "SIBLINGS", ())
            plain = LLM(path, dtype="bfloat16", device="cpu")
    layers = fused.engine.model.hf.model.layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        assert all(isinstance(p, SiblingLinear) and p.group is attn.q_proj.group for p in qkv)
        assert (
            attn.v_proj.weight.data_ptr() == attn.q_proj.group.weight[-attn.v_proj.out_features:].data_ptr())
        assert mlp.gate_proj.group is mlp.up_proj.group
        assert type(mlp).forward is generic._swiglu_forward  # the fused SwiGLU
    products = []
    real = generic.linear
    monkeypatch.setattr(generic, "linear", lambda *a: products.append(a[1].shape) or real(*a))
    got = fused.score(prompts[:1])
    assert len(products) == 2 * len(layers)  # one q/k/v product and one gate/up product per layer
    monkeypatch.setattr(generic, "linear", real)
    want = plain.score(prompts[:1])
    assert ((got[0].float() - want[0].float()).norm() / want[0].float().norm()).item() < 1e-2
    outs = [o.token_ids
            for o in fused.generate(prompts, SamplingParams(max_tokens=8, temperature=0), progress=False)]
    assert all(len(o) == 8 for o in outs)


def transformers_forwards(llm: LLM) -> None:
    """Put back transformers' own forwards where use_our_kernels fused a decoder layer, an attention or a
    rotary slot."""
    for mod in llm.engine.model.hf.modules():
        if type(mod).__name__.endswith(("DecoderLayer", "Attention")):
            generic.restore_forward(mod)
        slot = (vars(mod).get("_kernel_funcs") or {}).get(generic.ROPE_SLOT)
        if slot is not None:
            generic.restore_forward(slot)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generic_path_fuses_llama_shaped_modules_bit_for_bit(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompts = random_prompts(4, 20, 60)
    with forced_generic():
        fused, plain = (LLM(path, dtype="bfloat16", device="cpu", max_num_batched_tokens=48)
                        for _ in range(2))
    transformers_forwards(plain)
    # qwen3's attention (q/k norms) is not Llama's: only its layer (transformers wraps it)
    for layer in fused.engine.model.hf.model.layers:
        assert inspect.unwrap(type(layer).forward) is generic._decoder_layer_forward
        assert (type(layer.self_attn).forward is generic._attention_forward) == (arch == "llama")
        rope = type(layer.self_attn._kernel_funcs[generic.ROPE_SLOT]).forward
        assert rope is generic.fused_rope
    arena = fused.engine.model.weight_arena  # the weights in huge pages, as the native loader keeps its own
    attn = fused.engine.model.hf.model.layers[0].self_attn
    assert arena.holds(attn.q_proj.group.weight) and arena.holds(attn.o_proj.weight)
    assert attn.q_proj.group.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    for got, want in zip(fused.score(prompts), plain.score(prompts), strict=True):
        assert torch.equal(got, want)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got, want = (llm.generate(prompts, params, progress=False) for llm in (fused, plain))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_fused_rope_only_replaces_a_rotary_that_computes_llamas():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

    def interleaved(q, k, cos, sin):  # GPT-J style pairs: not Llama's rotation
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        return q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]

    def llama(q, k, cos, sin):
        return q * cos[:, None] + rotate_half(q) * sin[:, None], k * cos[:,
                                                                         None] + rotate_half(k) * sin[:, None]

    class Slot(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, *args):
            return self.fn(*args)

    for dtype in (torch.bfloat16, torch.float32):
        assert generic._same_rope(apply_rotary_pos_emb, functools.partial(generic.fused_rope, Slot(llama)),
                                  dtype, 64)
        slot = Slot(interleaved)
        assert not generic._same_rope(slot, functools.partial(generic.fused_rope, slot), dtype, 64)


QUANT_DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
QUANT_LINEARS = {"int8": "LLMInt8Linear", "int4": "Linear4bitCpu", "int8_weight_only": "Int8WeightOnlyLinear",
                 "int4_weight_only": "Int4WeightOnlyLinear"}


def quantized_linears(llm: LLM) -> list[torch.nn.Module]:
    """The linears of a generic-path model's decoder layers, none of them left a plain nn.Linear."""
    mods = [m for m in llm.engine.model.hf.model.layers.modules()]
    assert not any(type(m) in (torch.nn.Linear, Linear)
                   for m in mods), "a decoder linear was left unquantized"
    return [m for m in mods if type(m).__name__ in QUANT_LINEARS.values()]


@pytest.mark.parametrize("method", list(QUANT_LINEARS))
def test_generic_path_quantizes_as_the_native_path_does(method, checkpoint_factory):
    path = checkpoint_factory("llama", **QUANT_DIMS)
    prompts = random_prompts(3, 20, 60)
    native = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    with forced_generic():
        generic = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    parts = quantized_linears(generic)
    assert len(parts) == 7 * 4 and {type(p).__name__ for p in parts} == {QUANT_LINEARS[method]}
    head = generic.engine.model.hf.lm_head
    assert (type(head).__name__ == QUANT_LINEARS[method]) == method.endswith("weight_only")
    # the same quantized weights through the same kernels: measured bit-identical on CPU; the bound leaves
    # room for another kernel order elsewhere
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(generic.score(prompts), native.score(prompts), strict=True)]
    assert max(errors) < 1e-3
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got, want = (llm.generate(prompts, params, progress=False) for llm in (generic, native))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# Logits relative error vs the unquantized generic model (bf16), measured on these random checkpoints (gemma2
# / phi3): int8 3.5% / 2.0%, nf4 34% / 20%, int8_weight_only 3.7% / 2.3%, int4_weight_only 27% / 21%, as the
# native path's (tests/test_quantization.py); bounds: measured + ~35%.
GENERIC_MAX_REL_ERR = {"int8": 0.05, "int4": 0.45, "int8_weight_only": 0.05, "int4_weight_only": 0.36}


@pytest.mark.parametrize("method", list(GENERIC_MAX_REL_ERR))
@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_generic_architectures_quantize_close_to_their_bf16(arch, method, checkpoint_factory):
    path = checkpoint_factory(arch, **QUANT_DIMS)
    prompts = random_prompts(3, 20, 60)
    ref = LLM(path, dtype="bfloat16", device="cpu").score(prompts)
    llm = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    assert {type(p).__name__ for p in quantized_linears(llm)} == {QUANT_LINEARS[method]}
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(llm.score(prompts), ref, strict=True)]
    assert 0 < max(errors) < GENERIC_MAX_REL_ERR[method]


@pytest.mark.parametrize(("method", "bound"), [("int4", 0.32), ("int4_weight_only", 0.23)])
def test_int4_experts_off_the_block_width_are_zero_padded(method, bound, checkpoint_factory):
    # bounds: measured (nf4 23%, int4_weight_only 17%) + ~35%
    path = checkpoint_factory("qwen3_moe")  # expert width 48: not whole groups of 32 / blocks of 64 columns
    assert read_config(path)["moe_intermediate_size"] % 32
    prompts = random_prompts(3, 20, 60)
    ref = LLM(path, dtype="bfloat16", device="cpu").score(prompts)
    llm = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    experts = [e for layer in llm.engine.model.layers for e in layer.mlp.experts]
    assert all(e.down_proj.pad == 64 - 48 for e in experts)  # input columns to whole blocks / groups
    if method == "int4":  # our CPU 4-bit kernel takes any row count: gate/up keep their 48 rows, unpadded
        assert all(type(e.gate_proj).__name__ == "Linear4bitCpu" and e.gate_proj.out_features == 48
                   for e in experts)
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(llm.score(prompts), ref, strict=True)]
    print(f"{method} experts of width 48: logits relative error vs bf16 {max(errors):.4f}")
    assert 0 < max(errors) < bound
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), progress=False)
    assert all(len(o.token_ids) == 6 for o in outs)


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize(("hidden", "inner", "tokens"), [(96, 48, 9), (128, 64, 40)])
def test_moe_kernel_matches_fp64_on_every_tier(cpu_tier, dtype, bound, hidden, inner, tokens):
    # 96 x 48: widths off every vector size (the loops' tails); 128 x 64: whole AMX tiles, experts past 16
    # tokens
    g = torch.Generator().manual_seed(0)
    n_experts, k = 5, 2
    gate, up, down = ([torch.randn(*s, generator=g) * 0.2 for _ in range(n_experts)]
                      for s in ((inner, hidden), (inner, hidden), (hidden, inner)))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    ids[3] = ids[0]  # experts with several tokens, and (5 experts, 18 pairs) possibly one with none
    weights = torch.rand(tokens, k, generator=g)
    weights_in = [[w.to(dtype) for w in ws] for ws in (gate, up, down)]
    held = moe_kernel.experts(*weights_in)
    assert held is not None, f"csrc/moe.cpp did not build for {cpu_tier}"
    # AMX where it serves
    assert held.amx == (cpu_tier == "amx" and dtype is torch.bfloat16 and inner % 32 == 0)
    got = held.forward(x, ids, weights)
    # silu(gate) * up in bf16, as HF's experts
    rounded = dtype is torch.bfloat16 and moe_kernel.bf16_hidden(held)
    want = moe_kernel.moe_reference(x, ids, weights, *weights_in,
                                    torch.bfloat16 if rounded else torch.float64)
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.double() - want).norm() / want.norm()).item() < bound


@pytest.mark.parametrize(("width", "budget"), [(48, 32), (64, 256)])
def test_native_moe_runs_its_experts_in_one_cpp_call_in_bf16(width, budget, checkpoint_factory):
    # width 48: steps of up to CPP_MAX_TOKENS tokens take the C++ vector tiles, chunks of 32 keep every step
    # there; width 64 (hidden 64): whole AMX tiles where the tier has them, which take the prefill's longer
    # steps too
    path = checkpoint_factory("qwen3_moe", moe_intermediate_size=width)
    llm = LLM(path, dtype="bfloat16", device="cpu", max_num_batched_tokens=budget)
    prompts = random_prompts(3, 20, 60)
    got = llm.score(prompts)
    blocks = [layer.mlp for layer in llm.engine.model.layers]
    assert all(b.cpp_experts for b in blocks), "bf16 experts on CPU did not take the C++ kernel"
    assert all(b.cpp_experts.amx == (width % 32 == 0 and cpu_isa.tier() == "amx") for b in blocks)
    for b in blocks:
        b.cpp_experts = False  # the torch grouping, which rounds each expert's output to bf16
    want = llm.score(prompts)
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(got, want, strict=True)]
    assert max(errors) < 0.02
