"""Embeddings: pooled prefill hidden states against transformers, in the engine's continuous batch (offline API)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sluice.engine import LLM, PoolingParams, SamplingParams
from sluice.engine.pooling import PoolingError, PoolingRequest, pooler_for

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog. " * 5, "to be or not to be"]


def sentence_transformers(folder: Path, mode: str) -> Path:
    """Mark a checkpoint folder as a sentence-transformers model pooling by `mode`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
    return folder


def reference(path: Path, texts: list[str], pooling: str) -> list[torch.Tensor]:
    """transformers' final hidden states (AutoModel) pooled by `pooling`, not normalized."""
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(input_ids=torch.tensor([tok.encode(text)])).last_hidden_state[0]
            out.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    return out


def close(a: list, b: list, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.mark.parametrize(("arch", "pooling"), [("llama", "mean"), ("qwen3", "last")])
def test_embeddings_match_transformers_pooled_the_same_way(checkpoint_factory, tmp_path, arch, pooling):
    path = Path(shutil.copytree(checkpoint_factory(arch), tmp_path / arch))
    if pooling == "last":
        sentence_transformers(path, "pooling_mode_lasttoken")
    # 16-token steps: the long input's prefill is chunked, its mean summed over three steps
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16)
    outs = llm.embed(TEXTS, progress=False)
    assert len(outs[1].prompt_token_ids) > 32
    ref = reference(path, TEXTS, pooling)
    for out, want in zip(outs, ref, strict=True):
        assert cosine(out.embedding, want) >= 1 - 1e-3
        assert abs(torch.tensor(out.embedding).norm().item() - 1) < 1e-5
    short = llm.embed(TEXTS, dimensions=16, progress=False)
    for out, want in zip(short, ref, strict=True):
        assert len(out.embedding) == 16 and abs(torch.tensor(out.embedding).norm().item() - 1) < 1e-5
        assert cosine(out.embedding, want[:16]) >= 1 - 1e-3
    ids = llm.embed([llm.tokenizer.encode(t) for t in TEXTS], progress=False)
    close([o.embedding for o in ids], [o.embedding for o in outs], 1e-5)


def test_pooling_rule_reads_sentence_transformers_then_architecture(tmp_path):
    assert pooler_for(tmp_path, {"architectures": ["LlamaForCausalLM"]}) == "mean"
    assert pooler_for(tmp_path, {"architectures": ["MistralModel"]}) == "last"
    assert pooler_for(sentence_transformers(tmp_path, "pooling_mode_cls_token"), {}) == "cls"
    sentence_transformers(tmp_path, "pooling_mode_max_tokens")
    with pytest.raises(PoolingError, match="pooling_mode_max_tokens"):
        pooler_for(tmp_path, {})


def test_embeddings_share_the_step_with_generation_and_keep_no_kv(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["hello world, this is", "a stitch in time"]
    alone = [o.text for o in llm.generate(prompts, params, progress=False)]
    embedded = [o.embedding for o in llm.embed(TEXTS, progress=False)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    engine.add_request("e", TEXTS, PoolingParams())
    first = engine.step()  # one forward over every prompt: the embeddings finish in it, no decode step
    assert [o.request_id for o in first] == ["e"] and first[0].num_prompt_tokens == sum(
        len(llm.tokenizer.encode(t)) for t in TEXTS)
    close([o.embedding for o in first[0].items], embedded, 1e-5)
    running = engine.scheduler.running
    assert len(running) == 2 and not any(isinstance(r, PoolingRequest) for r in running)
    assert engine.block_manager.num_used_blocks == sum(len(r.block_table) for r in running)
    rest = {}
    while engine.has_unfinished():
        rest |= {o.request_id: o.text for o in engine.step()}
    assert [rest["g0"], rest["g1"]] == alone
