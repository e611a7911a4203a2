"""n > 1 and best_of (offline LLM door): sequences share the prompt's KV blocks and equal separate
requests."""

from __future__ import annotations

import random

import pytest

from sluice.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=16)


def peak_blocks(llm: LLM, prompt: list[int], params: SamplingParams):
    engine, peak, outs = llm.engine, 0, []
    engine.add_request("kv", prompt, params)
    while engine.has_unfinished():
        outs += engine.step()
        peak = max(peak, engine.stats()["kv_blocks_used"])
    return peak, outs[0]


def test_n4_shares_the_prompt_blocks(llm):
    prompt = [random.Random(0).randrange(4, 200) for _ in range(512)]
    params = dict(max_tokens=32, temperature=0.9, seed=3, ignore_eos=True)
    single, _ = peak_blocks(llm, prompt, SamplingParams(**params))
    before = llm.stats()["prompt_tokens"]
    four, out = peak_blocks(llm, prompt, SamplingParams(n=4, **params))
    assert four <= 1.3 * single, (four, single)
    assert len(out.samples) == 4 and all(len(s.token_ids) == 32 for s in out.samples)
    assert out.request_id == "kv" and out.token_ids == out.samples[0].token_ids
    assert llm.stats()["prompt_tokens"] - before == 512


def test_each_sequence_equals_a_separate_request_seeded_seed_plus_k(llm):
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
                       progress=False)[0]
    alone = llm.generate([prompt] * 3,
                         [SamplingParams(max_tokens=12, temperature=1.0, seed=7 + k, ignore_eos=True)
                          for k in range(3)], progress=False)
    assert [s.token_ids for s in out.samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in out.samples}) > 1


def test_best_of_returns_the_most_likely_sequences(llm):
    prompt = "to be or not to be"
    out = llm.generate(prompt, SamplingParams(n=2, best_of=4, max_tokens=8, temperature=1.0, seed=11,
                                              ignore_eos=True), progress=False)[0]
    alone = llm.generate([prompt] * 4,
                         [SamplingParams(max_tokens=8, temperature=1.0, seed=11 + k, ignore_eos=True,
                                         logprobs=0) for k in range(4)], progress=False)
    scores = sorted(((sum(step[t] for t, step in zip(a.token_ids, a.logprobs, strict=True)), a.token_ids)
                     for a in alone), reverse=True)
    assert [s.token_ids for s in out.samples] == [ids for _, ids in scores[:2]]
    assert all(s.logprobs is None for s in out.samples)


def test_aborting_a_group_aborts_every_sequence(llm):
    llm.engine.add_request("group", "hello there", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort("group")
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert [o.request_id for o in outs] == ["group"] and len(outs[0].samples) == 3
    assert all(s.finish_reason == "abort" for s in outs[0].samples)
