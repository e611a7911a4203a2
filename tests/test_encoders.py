"""Encoder checkpoints (BERT, RoBERTa, XLM-R): embeddings, classification and cross-encoder scores against
transformers, through the offline API."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from sluice.engine import LLM, PoolingParams, RequestRejected, SamplingParams
from sluice.engine.encoder_engine import EncoderEngine
from sluice.engine.models.bert import AttentionPlan
from tests.checkpoints import make_encoder_checkpoint, sentence_transformers_files

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog. " * 4, "to be or not to be",
         "a stitch in time saves nine", "numbers 0 1 2 3", "all that glitters is not gold. " * 2]
QUERY = "what glitters?"
DOCS = ["all that glitters is not gold", "the lazy dog", "a stitch in time saves nine. " * 3]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """factory(family, num_labels=0, seed=0) -> a fresh copy of a tiny random encoder checkpoint folder."""
    def make(family: str, num_labels: int = 0, seed: int = 0) -> Path:
        return make_encoder_checkpoint(tmp_path_factory.mktemp(f"enc-{family}"), family, num_labels, seed)

    return make


@functools.cache
def hf_model(path: Path, classifier: bool) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModel
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def hf_tokens(path: Path, *texts: str) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(path)(*texts, return_token_type_ids=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]}


def hf_pooled(path: Path, ids: list[int], mode: str) -> torch.Tensor:
    """transformers' final hidden states of one input, pooled as sentence-transformers pools them."""
    with torch.no_grad():
        hidden = hf_model(path, False)(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return {"cls": hidden[0], "mean": hidden.mean(0), "max": hidden.max(0).values, "last": hidden[-1]}[mode]


def hf_logits(path: Path, *texts: str) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path, True)(**hf_tokens(path, *texts)).logits[0]


@pytest.mark.parametrize(("family", "mode", "normalize"), [
    ("bert", "mean", True), ("roberta", "cls", True), ("xlm-roberta", "max", False), ("bert", "last", False)])
def test_embed_matches_transformers_pooled_as_the_checkpoint_says(encoders, family, mode, normalize):
    key = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
           "max": "pooling_mode_max_tokens", "last": "pooling_mode_lasttoken"}[mode]
    path = sentence_transformers_files(encoders(family), key, normalize=normalize)
    # a 48-token budget: two steps, each a flat batch of mixed lengths (padded attention groups, lone ones)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40, max_model_len=48)
    assert isinstance(llm.engine, EncoderEngine) and llm.runner_type == "pooling"
    outs = llm.embed(TEXTS, progress=False)
    assert 1 < llm.engine.counters["steps"] < len(TEXTS)
    for out, text in zip(outs, TEXTS, strict=True):
        assert out.prompt_token_ids == hf_tokens(path, text)["input_ids"][0].tolist()
        want = hf_pooled(path, out.prompt_token_ids, mode)
        want = torch.nn.functional.normalize(want, dim=0) if normalize else want
        got = torch.tensor(out.embedding)
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= 0.9999
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one = llm.embed(TEXTS[:2], params=PoolingParams(dimensions=8, normalize=True), progress=False)
    assert [len(o.embedding) for o in one] == [8, 8]
    assert abs(float(torch.tensor(one[1].embedding).norm()) - 1) < 1e-5


def test_one_request_of_many_inputs_comes_back_as_one_output_in_order(encoders):
    llm = LLM(str(sentence_transformers_files(encoders("bert"), "pooling_mode_mean_tokens")), dtype="float32",
              device="cpu", max_num_batched_tokens=40)
    alone = [o.embedding for o in llm.embed(TEXTS, progress=False)]
    llm.engine.add_request("many", TEXTS, PoolingParams())
    llm.engine.add_request("ids", [1, 5, 9, 2], PoolingParams())
    outs = {}
    while llm.engine.has_unfinished():
        outs |= {o.request_id: o for o in llm.engine.step()}
    assert len(outs["many"].items) == len(TEXTS) and outs["many"].num_prompt_tokens == sum(
        len(llm.tokenizer.encode(t)) for t in TEXTS)
    torch.testing.assert_close(torch.tensor([i.embedding for i in outs["many"].items]), torch.tensor(alone),
                               atol=1e-6, rtol=0)
    assert outs["ids"].items is None and len(outs["ids"].embedding) == 64
    assert llm.stats()["prompt_tokens"] == outs["many"].num_prompt_tokens + 4 + sum(
        len(llm.tokenizer.encode(t)) for t in TEXTS)


def test_a_step_runs_the_oldest_input_and_the_waiting_ones_nearest_its_length(encoders):
    llm = LLM(str(encoders("bert")), dtype="float32", device="cpu", max_num_batched_tokens=90,
              max_model_len=32)
    lens = {"a": 30, "b": 5, "c": 29, "d": 6, "e": 28, "f": 7, "g": 27}
    alone = {rid: llm.embed([list(range(10, 10 + n))], progress=False)[0].embedding
             for rid, n in lens.items()}
    for rid, n in lens.items():
        llm.engine.add_request(rid, list(range(10, 10 + n)), PoolingParams())
    llm.engine.abort("g")
    steps = []
    while llm.engine.has_unfinished():
        steps.append({o.request_id: o for o in llm.engine.step()})
    # a (oldest) with c and e (nearest, 87 of 90 tokens), g's abort reported; then b (oldest left), d, f
    assert [sorted(s) for s in steps] == [["a", "c", "e", "g"], ["b", "d", "f"]]
    assert steps[0]["g"].finish_reason == "abort"
    for rid in lens.keys() - {"g"}:
        out = next(s[rid] for s in steps if rid in s)
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone[rid]), atol=1e-5, rtol=0)


def test_a_step_takes_at_most_step_tokens_whatever_the_batched_token_limit(encoders):
    from sluice.engine.encoder_engine import STEP_TOKENS

    llm = LLM(str(encoders("bert")), dtype="float32", device="cpu", max_num_batched_tokens=1 << 20)
    inputs = [list(range(10, 10 + 40 + i % 8)) for i in range(3 * STEP_TOKENS // 40)]
    for i, ids in enumerate(inputs):
        llm.engine.add_request(str(i), ids, PoolingParams())
    done = []
    while llm.engine.has_unfinished():
        before = llm.engine.counters["computed_tokens"]
        done += llm.engine.step()
        assert 0 < llm.engine.counters["computed_tokens"] - before <= STEP_TOKENS
    assert sorted(int(o.request_id) for o in done) == list(range(len(inputs)))
    assert llm.engine.counters["steps"] >= 3

def test_too_long_inputs_are_refused_by_name_and_the_rest_run(encoders):
    path = sentence_transformers_files(encoders("roberta"), "pooling_mode_cls_token", max_seq_length=20)
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert llm.engine.max_model_len == 20
    with pytest.raises(RequestRejected, match=r"input 1: input \(\d+ tokens\) exceeds the 20 tokens"):
        llm.engine.add_request("long", [TEXTS[0], TEXTS[1]], PoolingParams())
    with pytest.raises(RequestRejected, match="does not generate text"):
        llm.engine.add_request("gen", TEXTS[0], SamplingParams())
    with pytest.raises(RequestRejected, match="classify needs a ...ForSequenceClassification"):
        llm.engine.add_request("cls", TEXTS[0], PoolingParams(task="classify"))
    with pytest.raises(RequestRejected, match=r"dimensions \(65\) exceeds"):
        llm.engine.add_request("wide", TEXTS[0], PoolingParams(dimensions=65))
    assert not llm.engine.has_unfinished()
    assert len(llm.embed(TEXTS[0], progress=False)[0].embedding) == 64
    with pytest.raises(ValueError, match="max_model_len=200 exceeds the model's limit 96"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=200)


def test_abort_reports_the_request_without_a_vector(encoders):
    llm = LLM(str(encoders("bert")), dtype="float32", device="cpu")
    llm.engine.add_request("a", TEXTS, PoolingParams())
    llm.engine.add_request("b", TEXTS[0], PoolingParams())
    llm.engine.abort("a")
    outs = {o.request_id: o for o in llm.engine.step()}
    assert outs["a"].finish_reason == "abort" and outs["a"].embedding is None
    assert outs["b"].finish_reason == "stop" and llm.engine.counters["computed_tokens"] == len(
        outs["b"].prompt_token_ids)
    assert not llm.engine.has_unfinished()


def test_unsupported_sentence_transformers_modules_are_named_at_load(encoders):
    path = sentence_transformers_files(encoders("bert"), "pooling_mode_mean_tokens")
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LSTM", "type": "sentence_transformers.models.LSTM"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module.s. LSTM not supported"):
        LLM(str(path), dtype="float32", device="cpu")
    (path / "modules.json").write_text(json.dumps(modules[:3]))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_weightedmean_tokens"):
        LLM(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_classify_matches_the_sequence_classification_head(encoders, family):
    path = encoders(family, num_labels=3)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40)
    outs = llm.classify(TEXTS, progress=False)
    for out, text in zip(outs, TEXTS, strict=True):
        want = hf_logits(path, text).softmax(-1)
        torch.testing.assert_close(torch.tensor(out.probs), want, atol=1e-5, rtol=1e-5)
    embedded = llm.embed(TEXTS[0], progress=False)[0]  # a classifier's encoder embeds too ([CLS] by default)
    assert len(embedded.embedding) == 64
    with pytest.raises(RequestRejected, match="one label; this classifier has 3"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match=r"moderation_thresholds must lie in \[0, 1\]: \{'label_0': 2\}"):
        LLM(str(path), dtype="float32", device="cpu", moderation_thresholds={"label_0": 2, "default": 0.5})


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_score_matches_the_cross_encoders_logits_over_pairs(encoders, family):
    path = encoders(family, num_labels=1, seed=1)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=48)
    outs = llm.score(QUERY, DOCS, progress=False)
    for out, doc in zip(outs, DOCS, strict=True):
        tokens = hf_tokens(path, QUERY, doc)
        assert out.prompt_token_ids == tokens["input_ids"][0].tolist()
        assert bool(tokens["token_type_ids"].any()) == (family == "bert")  # BERT's pairs: types 0 then 1
        assert abs(out.score - float(hf_logits(path, QUERY, doc).sigmoid()[0])) < 1e-5
    swapped = llm.score(DOCS, QUERY, progress=False)
    assert [o.prompt_token_ids for o in swapped] != [o.prompt_token_ids for o in outs]
    with pytest.raises(ValueError, match="pairs 3 texts with 2"):
        llm.score(DOCS, DOCS[:2])


def test_classify_and_pair_scores_need_an_encoder(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    assert llm.runner_type == "generate"
    with pytest.raises(ValueError, match="classify needs an encoder checkpoint"):
        llm.classify(TEXTS)
    with pytest.raises(ValueError, match="score needs an encoder checkpoint"):
        llm.score(QUERY, DOCS)
    with pytest.raises(RequestRejected, match="task 'classify' needs a sequence-classification encoder"):
        llm.engine.add_request("c", TEXTS[0], PoolingParams(task="classify"))


def test_attention_plan_matches_one_bidirectional_attention_per_sequence():
    import torch.nn.functional as F

    lens = [4, 4, 4, 9, 16, 17, 40, 41, 90]  # a group read in place, padded groups, a lone sequence
    heads, dim = 4, 8
    qkv = torch.randn(sum(lens), 3 * heads * dim, generator=torch.Generator().manual_seed(0))
    plan = AttentionPlan(lens, torch.device("cpu"))
    padded = [(g.size, g.valid is not None) for g in plan.groups]
    assert padded == [(3, False), (3, True), (2, True), (1, False)]
    out = plan.attend(qkv, heads, 0.3)
    start = 0
    for n in lens:
        q, k, v = qkv[start:start + n].view(n, 3, heads, dim).permute(1, 2, 0, 3)
        want = F.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(0, 1).reshape(n, heads * dim)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_dense_modules_project_the_pooled_vector_before_normalizing(encoders):
    from safetensors.torch import save_file

    path = sentence_transformers_files(encoders("bert"), "pooling_mode_mean_tokens")
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    modules.insert(2, dense)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "2_Dense").mkdir()
    (path / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 64, "out_features": 24, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh"}))
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 64, generator=gen) * 0.3, torch.randn(24, generator=gen)
    save_file({"linear.weight": weight, "linear.bias": bias}, path / "2_Dense" / "model.safetensors")
    llm = LLM(str(path), dtype="float32", device="cpu")
    for out in llm.embed(TEXTS[:3], progress=False):
        want = torch.tanh(hf_pooled(path, out.prompt_token_ids, "mean") @ weight.T + bias)
        torch.testing.assert_close(torch.tensor(out.embedding), torch.nn.functional.normalize(want, dim=0),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(RequestRejected, match=r"dimensions \(32\) exceeds the model's embedding size \(24\)"):
        llm.engine.add_request("wide", TEXTS[0], PoolingParams(dimensions=32))



@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"])
def test_activations_apply_in_place_as_transformers_defines_them(name):
    from transformers.activations import ACT2FN

    from sluice.engine.models.bert import ACTIVATIONS

    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 3
    y = x.clone()
    out = ACTIVATIONS[name](y)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(out, ACT2FN[name](x), atol=1e-5, rtol=1e-5)


def test_steps_write_their_activations_into_buffers_kept_from_step_to_step(encoders):
    path = sentence_transformers_files(encoders("bert"), "pooling_mode_mean_tokens")
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=40, max_model_len=48)
    first = llm.embed(TEXTS, progress=False)
    buffers = llm.engine.model.workspace.buffers
    assert set(buffers) == {"qkv", "attn", "sum", "up"}
    places = {name: buf.data_ptr() for name, buf in buffers.items()}
    again = llm.embed(TEXTS, progress=False)
    assert llm.engine.counters["steps"] > 2
    assert {name: buf.data_ptr() for name, buf in buffers.items()} == places
    assert [o.embedding for o in again] == [o.embedding for o in first]
    for out in again:
        want = torch.nn.functional.normalize(hf_pooled(path, out.prompt_token_ids, "mean"), dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=1e-5)


def test_a_bf16_encoder_is_as_near_the_fp32_reference_as_transformers_in_bf16(encoders):
    """bf16 encoders attend through the varlen kernel too (fp32 sums, bf16 in and out): each embedding's
    cosine to transformers' fp32 one at least that of transformers' own bf16 model, less 1e-4."""
    from transformers import AutoModel

    path = sentence_transformers_files(encoders("bert"), "pooling_mode_mean_tokens")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", max_num_batched_tokens=40, max_model_len=48)
    hf16 = AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval()
    for out in llm.embed(TEXTS, progress=False):
        want = torch.nn.functional.normalize(hf_pooled(path, out.prompt_token_ids, "mean"), dim=0)
        with torch.no_grad():
            theirs = hf16(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0].float().mean(0)
        cos = torch.nn.functional.cosine_similarity
        their_cos = float(cos(theirs, want, dim=0))
        assert float(cos(torch.tensor(out.embedding), want, dim=0)) >= min(their_cos, 0.9999) - 1e-4
