"""OpenAI's sampling fields in the engine (offline LLM door): logprobs as bytes, logit_bias, penalties,
min_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine import LLM, SamplingParams
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.request import Request

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sluice-tiny"
DRAFT = ROOT / "models" / "sluice-tiny-draft"
PROMPTS = ["To be, or not to be", "O Romeo, Romeo, wherefore", "Now is the winter of our", "Friends, Romans"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=16)


def test_logprobs_carry_the_bytes_of_every_token(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    for out in llm.generate(PROMPTS, params, progress=False):
        assert out.token_bytes is not None and all(len(step) in (3, 4) for step in out.logprobs)
        assert b"".join(out.token_bytes[t] for t in out.token_ids).decode() == out.text
        assert all(t in out.token_bytes for step in out.logprobs for t in step)


def test_logit_bias_100_yields_only_that_token(llm):
    target = llm.tokenizer.encode(" king", add_special_tokens=False)[0]
    for temperature in (0, 1.0):
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=1, logit_bias={target: 100})
        for out in llm.generate(PROMPTS, params, progress=False):
            assert out.token_ids == [target] * 10
    banned = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS[0], banned, progress=False)[0].token_ids
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={plain[0]: -100})
    assert llm.generate(PROMPTS[0], params, progress=False)[0].token_ids[0] != plain[0]


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                        p: SamplingParams) -> torch.Tensor:
    """vLLM's repetition penalty over prompt + output, then OpenAI's frequency and presence penalties."""
    out = logits.clone()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= count * p.frequency_penalty + p.presence_penalty
    return out


def test_penalties_match_a_reference_on_the_logits():
    vocab, gen = 64, torch.Generator().manual_seed(0)
    procs = LogitsProcessors(vocab, torch.device("cpu"), {2})
    cases = [
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.0),
        SamplingParams(presence_penalty=0.0, frequency_penalty=-0.7),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3),
        SamplingParams(),
    ]
    reqs = []
    for i, p in enumerate(cases):
        req = Request(f"r{i}", torch.randint(4, vocab, (7,), generator=gen).tolist(), p)
        req.output_token_ids = torch.randint(4, 20, (9,), generator=gen).tolist()
        reqs.append(req)
    logits = torch.randn(len(reqs), vocab, generator=gen) * 3
    for step in range(2):  # the second step syncs only the tokens appended since the first
        got = procs.apply(logits, reqs)
        for row, req in enumerate(reqs):
            want = reference_penalties(logits[row], req.prompt_token_ids, req.output_token_ids, req.params)
            torch.testing.assert_close(got[row], want)
        for req in reqs:
            req.output_token_ids += [5, 5, 6 + step]


def test_penalties_steer_generation_like_the_reference(llm):
    """Greedy tokens with penalties are the argmax of the reference-penalized logits at every step."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=0.5, repetition_penalty=1.2)
    prompt = llm.tokenizer.encode(PROMPTS[1])
    out = llm.generate(prompt, params, progress=False)[0].token_ids
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                         progress=False)
    assert out != plain[0].token_ids
    logits = llm.score([prompt + out[:-1]])[0][len(prompt) - 1:]
    for j, tok in enumerate(out):
        assert int(reference_penalties(logits[j], prompt, out[:j], params).argmax()) == tok


def test_min_tokens_holds_back_eos(llm):
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logit_bias={eos: 100})
    out = llm.generate(PROMPTS[0], params, progress=False)[0]
    assert out.token_ids[5:] == [eos] and eos not in out.token_ids[:5] and out.finish_reason == "stop"


PENALIZED = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=0.8,
                   presence_penalty=0.4),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5, min_tokens=3),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias={100: 5.0, 200: -50}),
]


@pytest.mark.parametrize("spec", [
    {"method": "draft", "model": str(DRAFT), "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 4},
])
def test_penalties_under_speculation_and_preemption_match_plain(llm, spec):
    prompts = PROMPTS * 3
    params = [PENALIZED[i % 3] for i in range(len(prompts))]
    want = [o.token_ids for o in llm.generate(prompts, params, progress=False)]
    blocks = 14
    spec_llm = LLM(str(TINY), dtype="float32", device="cpu",
                   kv_cache_memory_gb=blocks * llm.engine.kv_block_bytes
                   / 1024**3, speculative={"disable_by_batch_size": 64, **spec})
    got = [o.token_ids for o in spec_llm.generate(prompts, params, progress=False)]
    assert got == want
    stats = spec_llm.stats()
    assert stats["spec_accepted"] > 0 and stats["num_preemptions"] > 0


def test_bad_values_are_named():
    for kwargs, name in [({"presence_penalty": 3}, "presence_penalty"),
                         ({"logit_bias": {5: 101}}, "logit_bias"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_tokens": 20}, "min_tokens")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_logprobs_are_the_models_raw_distribution_before_bias_and_penalties(llm):
    """vLLM's default (logprobs_mode raw_logprobs): what the model gave, not what logit_bias/penalties sampled
    from."""
    target = llm.tokenizer.encode(" king", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={target: 100}, presence_penalty=2.0,
                            logprobs=2)
    out = llm.generate(PROMPTS[0], params, progress=False)[0]
    assert out.token_ids == [target] * 4
    raw = torch.log_softmax(llm.score([out.prompt_token_ids + out.token_ids[:-1]])[0].float(), -1)
    first = len(out.prompt_token_ids) - 1
    for i, step in enumerate(out.logprobs):
        assert step[target] == pytest.approx(raw[first + i, target].item(), abs=1e-4)
        assert step[target] < -0.1  # the biased distribution would give it ~0
