"""The engine against Hugging Face transformers on small random checkpoints of each architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluice.engine import LLM, RequestRejected, SamplingParams
from tests.checkpoints import make_checkpoint

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def random_prompts(n: int = 10, lo: int = 2, hi: int = 120, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, 400, (n_,), generator=g).tolist() for n_ in lengths]


def hf_greedy(path, prompts, max_new_tokens=24) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, checkpoint_factory):
    path = checkpoint_factory(request.param)
    prompts = random_prompts()
    return request.param, path, prompts, hf_greedy(path, prompts)


def test_greedy_matches_transformers(arch_case):
    _, path, prompts, ref = arch_case
    llm = LLM(path, dtype="float32", device="cpu")
    outs = llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_greedy_matches_with_chunked_prefill(arch_case):
    _, path, prompts, ref = arch_case
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["steps"] > sum(len(p) for p in prompts) // 16


def test_greedy_matches_under_preemption(arch_case):
    _, path, prompts, ref = arch_case
    llm = LLM(path, dtype="float32", device="cpu", block_size=16)
    per_block = llm.engine.kv_block_bytes
    assert per_block == 16 * 2 * 4 * 2 * 16 * 4  # block, k+v, layers, kv heads, head dim, fp32
    llm = LLM(path, dtype="float32", device="cpu", block_size=16, kv_cache_memory_gb=20 * per_block / 1024**3)
    assert llm.engine.num_blocks == 20
    outs = llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["num_preemptions"] > 0


def test_greedy_matches_with_prefix_cache_hits(arch_case):
    _, path, prompts, _ = arch_case
    system = random_prompts(1, 70, 71, seed=7)[0]
    shared = [system + p[:20] for p in prompts[:6]]
    ref = hf_greedy(path, shared)
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=2)
    outs = llm.generate(shared, GREEDY, progress=False)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 4 * 64
    assert llm.stats()["prefix_cache_hit_rate"] > 0.3


def test_prompt_logits_match_transformers(arch_case):
    _, path, prompts, _ = arch_case
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32)
    got = llm.score(prompts[:4])
    for p, logits in zip(prompts[:4], got, strict=True):
        want = model(torch.tensor([p])).logits[0]
        assert logits.shape == want.shape
        assert (logits - want).abs().max().item() < 1e-4


def test_seeded_sampling_independent_of_batch(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    target = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], target, progress=False)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 5
    mixed = llm.generate([[9, 9]] * 2 + [[5, 6, 7]] + [[11, 12, 13, 14]] * 3,
                         others[:2] + [target] + others[2:5], progress=False)
    assert mixed[2].token_ids == alone
    unseeded = llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
                            progress=False)
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompts = random_prompts(4)
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY, progress=False)]
    for p in (SamplingParams(max_tokens=24, top_k=1), SamplingParams(max_tokens=24, top_p=1e-6),
              SamplingParams(max_tokens=24, min_p=1.0)):
        assert [o.token_ids for o in llm.generate(prompts, p, progress=False)] == greedy


def test_top_k_restricts_support(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = [5, 6, 7, 8]
    allowed = set(model(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    params = [SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=s) for s in range(40)]
    firsts = {o.token_ids[0] for o in llm.generate([prompt] * 40, params, progress=False)}
    assert firsts <= allowed and len(firsts) > 1


def test_stops_and_logprobs(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = random_prompts(1, 10, 11)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3),
                        progress=False)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    by_id = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]), progress=False)[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]
    stop_str = free.text[len(free.text) // 2:][:3]
    by_str = llm.generate([prompt],
                          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_str]),
                          progress=False)[0]
    assert by_str.finish_reason == "stop" and stop_str not in by_str.text
    assert free.text.startswith(by_str.text) and free.text[len(by_str.text):].startswith(stop_str)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    logp = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    lp0 = free.logprobs[0]
    assert len(lp0) == 3 and free.token_ids[0] in lp0
    for tok, v in lp0.items():
        assert abs(v - logp[tok].item()) < 1e-4


def test_rejects_what_can_never_fit_and_keeps_serving(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=64)
    eng = llm.engine
    with pytest.raises(RequestRejected, match="exceeds max_model_len"):
        eng.add_request("long", list(range(5, 65)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="empty prompt"):
        eng.add_request("empty", [], SamplingParams())
    eng.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(RequestRejected, match="duplicate"):
        eng.add_request("ok", [5], SamplingParams())
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].token_ids) == 5
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_abort_returns_partial_output(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.add_request("b", [8, 9], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finish_reason == "abort" and 0 < len(outs["a"].token_ids) < 50
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs["b"].finish_reason == "length"
    assert eng.block_manager.num_used_blocks == 0


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    import json
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(tmp_path / "m", device="cpu")


def test_sharded_tied_llama3_checkpoint(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True, rope_parameters=rope,
                           max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    prompts = random_prompts(4, 60, 100)
    ref = hf_greedy(path, prompts)
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.model.lm_head is None
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, progress=False)] == ref


def test_chat_uses_template(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    msgs = [{"role": "user", "content": "hello world"}]
    ids = llm.encode_chat(msgs)
    assert llm.tokenizer.decode(ids).endswith("<|assistant|>")
    out = llm.chat([msgs], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False)[0]
    assert out.prompt_token_ids == ids and len(out.token_ids) == 4


def test_bfloat16_runs_and_stats(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", device="cpu")
    outs = llm.generate(random_prompts(6), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        progress=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    s = llm.stats()
    assert s["generated_tokens"] == 48 and s["kv_blocks_used"] == 0 and s["num_running"] == 0
    assert outs[0].metrics.ttft is not None and outs[0].metrics.total_time >= outs[0].metrics.ttft
