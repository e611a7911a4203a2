"""Speculative decoding: greedy equality, the rejection sampler's distribution, acceptance metrics,
settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from sluice.engine import LLM, SamplingParams
from sluice.engine.quantization.linears import Int8WeightOnlyLinear
from tests.checkpoints import build_tokenizer
from tests.test_engine import random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def copy_prompts() -> list[list[int]]:
    """Prompts with repeated spans, so n-gram lookup finds something to propose."""
    base = random_prompts(6, 10, 40, seed=3)
    return [p * 3 for p in base] + random_prompts(6, 2, 100, seed=4)


def spec_llm(path, spec, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", speculative={"disable_by_batch_size": 64, **spec}, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    return [o.token_ids for o in llm.generate(copy_prompts(), GREEDY, progress=False)]


@pytest.fixture(scope="module")
def draft(checkpoint_factory):
    return checkpoint_factory("llama", seed=5, num_hidden_layers=1)


@pytest.mark.parametrize("kv_blocks", [None, 24])
def test_ngram_greedy_equals_plain(tiny_llama, reference, kv_blocks):
    kw = {}
    if kv_blocks:
        plain = LLM(tiny_llama, dtype="float32", device="cpu")
        kw["kv_cache_memory_gb"] = kv_blocks * plain.engine.kv_block_bytes / 1024**3
    llm = spec_llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 4}, **kw)
    outs = llm.generate(copy_prompts(), GREEDY, progress=False)
    assert [o.token_ids for o in outs] == reference
    s = llm.stats()
    assert s["spec_proposed"] > 0 and s["spec_accepted"] > 0
    assert (s["num_preemptions"] > 0) == bool(kv_blocks)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert sum(o.metrics.spec_proposed for o in outs) == s["spec_proposed"]


@pytest.mark.parametrize("quantization", [None, "int8_weight_only"])
def test_draft_greedy_equals_plain_under_preemption(tiny_llama, draft, reference, quantization):
    plain = LLM(tiny_llama, dtype="float32", device="cpu")
    budget = 24 * plain.engine.kv_block_bytes / 1024**3
    llm = spec_llm(
        tiny_llama,
        {"method": "draft", "model": str(draft), "num_speculative_tokens": 3, "quantization": quantization},
        kv_cache_memory_gb=budget,
    )
    outs = llm.generate(copy_prompts(), GREEDY, progress=False)
    assert [o.token_ids for o in outs] == reference
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_proposed"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0 and llm.engine.proposer.blocks.num_used_blocks == 0


def test_greedy_requests_stay_exact_beside_sampled_ones(tiny_llama, draft, reference):
    llm = spec_llm(
        tiny_llama,
        {
            "method": "draft",
            "model": str(draft),
            "num_speculative_tokens": 3,
            "quantization": "int8_weight_only",
        },
    )
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(reference))]
    outs = llm.generate(copy_prompts(), params, progress=False)
    assert [o.token_ids for o in outs[::2]] == reference[::2]
    assert all(len(o.token_ids) == 24 for o in outs[1::2])
    assert isinstance(llm.engine.proposer.model.layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    assert sum(o.metrics.spec_accepted for o in outs[1::2]) > 0


def test_draft_equal_to_target_accepts_everything(tiny_llama, reference):
    llm = spec_llm(
        tiny_llama,
        {"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 4},
        enable_prefix_caching=True,
    )
    outs = llm.generate(copy_prompts(), GREEDY, progress=False)
    assert [o.token_ids for o in outs] == reference
    s = llm.stats()
    assert s["spec_acceptance_rate"] == 1.0 and s["spec_mean_accepted_length"] > 3


def test_speculation_off_above_batch_threshold(tiny_llama):
    llm = LLM(
        tiny_llama,
        dtype="float32",
        device="cpu",
        speculative={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2},
    )
    llm.generate(
        copy_prompts()[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False
    )
    assert llm.stats()["spec_proposed"] == 0


def tiny_vocab_model(path, seed: int, layers: int = 2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    GenerationConfig().save_pretrained(path)
    return path


def exact_marginals(path, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 2) and P(token 3) after the prompt under the target, by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        seq2 = torch.tensor([prompt + [a] for a in range(8)])
        p2 = model(seq2).logits[:, -1].softmax(-1)
        seq3 = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        p3 = model(seq3).logits[:, -1].softmax(-1).view(8, 8, 8)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampler_matches_target_distribution(tmp_path):
    target = tiny_vocab_model(tmp_path / "t", seed=11)
    draft = tiny_vocab_model(tmp_path / "d", seed=12, layers=1)
    prompt = [1, 2, 3]
    m2, m3 = exact_marginals(target, prompt)
    llm = LLM(
        target,
        dtype="float32",
        device="cpu",
        max_num_seqs=512,
        speculative={
            "method": "draft",
            "model": str(draft),
            "num_speculative_tokens": 2,
            "disable_by_batch_size": 10_000,
        },
    )
    n = 3000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params, progress=False)
    s = llm.stats()
    assert 0.05 < s["spec_acceptance_rate"] < 0.98, s
    c2 = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=8).float()
    c3 = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=8).float()
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert chi_square(c2, m2) < critical and chi_square(c3, m3) < critical
    draft_only = LLM(draft, dtype="float32", device="cpu", max_num_seqs=512)
    biased = draft_only.generate([prompt] * n, params, progress=False)
    c3_biased = torch.bincount(torch.tensor([o.token_ids[2] for o in biased]), minlength=8).float()
    assert chi_square(c3_biased, m3) > critical


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "medusa"}, "unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
        ({"method": "draft"}, "needs 'model'"),
        ({"method": "ngram", "quantization": "int8_weight_only"}, "only a draft model"),
        ({"method": "ngram", "disable_by_batch_size": -1}, "disable_by_batch_size must be an integer >= 0"),
    ],
)
def test_bad_speculative_settings(tiny_llama, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, dtype="float32", device="cpu", speculative=spec)


def test_draft_quantization_is_checked_at_construction(tiny_llama, draft):
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(
            tiny_llama,
            dtype="float32",
            device="cpu",
            speculative={"method": "draft", "model": str(draft), "quantization": "int3"},
        )


def test_draft_with_other_vocabulary_is_refused(tiny_llama, tmp_path):
    other = tiny_vocab_model(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(
            tiny_llama,
            dtype="float32",
            device="cpu",
            speculative={"method": "draft", "model": str(other), "num_speculative_tokens": 2},
        )


def test_bundled_draft_backs_off_when_its_kv_cache_is_full():
    """Issue 12: a draft with a ~26-block cache once crashed in allocate; speculation now backs off
    instead."""
    models = Path(__file__).resolve().parent.parent / "models"
    target, draft = str(models / "sluice-tiny"), str(models / "sluice-tiny-draft")
    plain = LLM(target, dtype="float32", device="cpu")
    budget = 26 * plain.engine.kv_block_bytes / 1024**3
    prompts = [f"{p} {n}" for p in ("To be, or not to be,", "O Romeo, Romeo!", "My lord,") for n in range(4)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params, progress=False)]
    llm = LLM(target, dtype="float32", device="cpu", kv_cache_memory_gb=budget,
              speculative={"method": "draft", "model": draft, "num_speculative_tokens": 4,
                           "disable_by_batch_size": 64})
    assert llm.engine.num_blocks == 26
    outs = llm.generate(prompts, params, progress=False)
    assert [o.token_ids for o in outs] == want
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["spec_proposed"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0 and llm.engine.proposer.blocks.num_used_blocks == 0
