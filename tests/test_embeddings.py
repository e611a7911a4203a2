"""/v1/embeddings: pooled prefill hidden states against transformers, in the engine's continuous batch,
through the offline API, batch files (Client + worker) and the HTTP Batch API."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import pytest
import redis
import torch

from sluice.cli.batch_commands import response_text
from sluice.contract.settings import Settings
from sluice.engine import LLM, PoolingParams, SamplingParams
from sluice.engine.pooling import PoolingError, PoolingRequest, pooler_for
from sluice.producer import BatchStatus, Client
from sluice.producer.validation import validate_lines
from sluice.worker.worker import EngineWorker
from tests.openai_types import openai_body
from tests.server_stack import jsonl, wait_status

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sluice-tiny"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog. " * 5, "to be or not to be"]


def sentence_transformers(folder: Path, mode: str) -> Path:
    """Mark a checkpoint folder as a sentence-transformers model pooling by `mode`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  mode: True}))
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


@pytest.mark.parametrize(("arch", "pooling"), [("llama", "mean"), ("qwen3", "last"), ("gpt_neox", "mean"),
                                               ("gemma2", "last")])
def test_embeddings_match_transformers_pooled_the_same_way(checkpoint_factory, tmp_path, arch, pooling):
    """Native (llama, qwen3) and generic-path (gpt_neox, gemma2: transformers' modules) checkpoints alike."""
    path = Path(shutil.copytree(checkpoint_factory(arch), tmp_path / arch))
    if pooling == "last":
        sentence_transformers(path, "pooling_mode_lasttoken")
    # 16-token steps: the long input's prefill is chunked, its mean summed over three steps
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert (type(llm.engine.model).__name__ == "GenericModel") == (arch in ("gpt_neox", "gemma2"))
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


# gpt_neox: the generic path's logits and hidden states
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_embeddings_share_the_step_with_generation_and_keep_no_kv(checkpoint_factory, arch):
    llm = LLM(str(checkpoint_factory(arch)), dtype="float32", device="cpu")
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


def embedding_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"input": TEXTS[0], **body}}


def embedding_lines(token_ids: list[int]) -> list[dict]:
    return [
        embedding_line("one"),
        embedding_line("many", input=TEXTS),
        embedding_line("ids", input=token_ids),
        embedding_line("many-ids", input=[token_ids, token_ids[:3]]),
        embedding_line("dims", dimensions=8),
        embedding_line("b64", encoding_format="base64", input=TEXTS),
        embedding_line("too-wide", dimensions=100_000),
    ]


def check_embeddings(bodies: dict[str, dict], errors: dict[str, dict], llm: LLM, tol: float) -> None:
    """What every door must give for embedding_lines(): CreateEmbeddingResponse bodies equal to LLM.embed."""
    want = {t: o.embedding for t, o in zip(TEXTS, llm.embed(TEXTS, progress=False), strict=True)}
    parsed = {cid: openai_body(b) for cid, b in bodies.items() if cid != "b64"}
    assert cosine(parsed["one"].data[0].embedding, torch.tensor(want[TEXTS[0]])) >= 1 - tol
    many = parsed["many"]
    assert [d.index for d in many.data] == [0, 1,
                                            2] and many.usage.prompt_tokens == many.usage.total_tokens == sum(
        len(llm.tokenizer.encode(t)) for t in TEXTS)
    for d, text in zip(many.data, TEXTS, strict=True):
        assert cosine(d.embedding, torch.tensor(want[text])) >= 1 - tol
    assert cosine(parsed["ids"].data[0].embedding, torch.tensor(want[TEXTS[0]])) >= 1 - tol
    assert len(parsed["many-ids"].data) == 2 and parsed["many-ids"].usage.prompt_tokens == len(
        llm.tokenizer.encode(TEXTS[0])) + 3
    assert len(parsed["dims"].data[0].embedding) == 8
    decoded = [struct.unpack(f"<{len(want[TEXTS[0]])}f", base64.b64decode(d["embedding"]))
               for d in bodies["b64"]["data"]]
    close([list(v) for v in decoded], [d.embedding for d in many.data], 1e-6)
    assert list(errors) == ["too-wide"] and "dimensions" in errors["too-wide"]["message"]


def test_embedding_lines_are_validated_and_bad_ones_name_the_field():
    raw = [json.dumps(x).encode() for x in (
        embedding_line("ok", input=["a", "b"]), embedding_line("empty", input=[]),
        embedding_line("format", encoding_format="hex"), embedding_line("extra", truncate=True))]
    checked = validate_lines(raw, Settings())
    assert not checked.errors  # a bad body is its own line's 400; the file is fine
    assert [r.custom_id for r in checked.requests if r.answer() is None] == ["ok"]
    refused = [(r.custom_id, r.answer()) for r in checked.requests if r.answer() is not None]
    assert [(cid, a.response.status_code, a.response.body["error"]["param"]) for cid, a in refused] == [
        ("empty", 400, "input"), ("format", 400, "encoding_format"), ("extra", 400, "truncate")]
    assert all(f"line {n}" in a.response.body["error"]["message"]
               for n, (_, a) in zip((2, 3, 4), refused, strict=True))


@pytest.fixture(scope="module")
def tiny():
    return LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=16)


def test_embeddings_through_client_and_worker_beside_a_generation_batch(tiny, redis_url, tmp_path):
    client = Client(redis_url)
    completion = {"custom_id": "gen", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "KING HENRY:", "max_tokens": 4, "temperature": 0}}
    ids = tiny.tokenizer.encode(TEXTS[0])
    batch = client.submit_batch(embedding_lines(ids), output=tmp_path.as_uri(), shard_size=8)
    generation = client.submit_batch([completion], output=tmp_path.as_uri())
    EngineWorker(["high", "default", "low"], tiny, redis.Redis.from_url(redis_url), heartbeat_ttl=5).work(
        burst=True, logging_level="WARNING")
    assert [client.get(b.id).status for b in (batch, generation)] == [BatchStatus.completed] * 2
    bodies = {r.custom_id: r.response.body for r in client.results(batch.id)}
    errors = {r.custom_id: r.error.model_dump() for r in client.results(batch.id, errors=True)}
    [gen] = client.results(generation.id)
    assert gen.custom_id == "gen" and openai_body(gen.response.body).choices[0].finish_reason == "length"
    assert (response_text(bodies["many"]) == "3 embedding(s) of "
                                             f"{len(bodies['many']['data'][0]['embedding'])} values")
    check_embeddings(bodies, errors, tiny, 1e-5)


def test_embeddings_through_the_http_batch_api(stack, tiny):
    client = stack.openai(stack.key("embeddings"))
    uploaded = client.files.create(file=jsonl(embedding_lines(tiny.tokenizer.encode(TEXTS[0]))),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    done = wait_status(client, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert done.status == "completed", done
    records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    records += [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    bodies = {r["custom_id"]: r["response"]["body"] for r in records if not r["error"]}
    errors = {r["custom_id"]: r["error"] for r in records if r["error"]}
    check_embeddings(bodies, errors, tiny, 1e-2)  # the server's worker runs the checkpoint's bf16


def test_fresh_prefills_in_padded_batches_match_one_attention_each():
    from types import SimpleNamespace

    import torch.nn.functional as F

    from sluice.kernels.prefill import attend, padded_batches

    lens = [5, 17, 16, 3, 40, 9]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    seqs = [SimpleNamespace(query_start=s, query_len=n, context_len=n)
            for s, n in zip(starts, lens, strict=True)]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, 8, generator=gen) for h in (4, 2, 2))
    out = torch.full_like(q, float("nan"))
    batches, served = padded_batches(seqs, q.device)
    assert batches and len(served) > len(batches)  # some sequences share a call
    for batch in batches:
        attend(q, k, v, out, batch, 0.3)
    for s, n, seq in zip(starts, lens, seqs, strict=True):
        if id(seq) not in served:
            continue
        sl = slice(s, s + n)
        want = F.scaled_dot_product_attention(*(x[sl].transpose(0, 1)[None] for x in (q, k, v)),
                                              is_causal=True, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[sl], want, atol=1e-5, rtol=1e-5)


def test_embeddings_on_the_device_path_match_the_default_path(tiny_llama):
    """The flat layout (CUDA's path, Triton interpreted here): pooled rows and sampled rows from one
    forward."""
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=40, max_num_seqs=8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base = LLM(str(tiny_llama), device_path=False, **kw)
    want = base.embed(TEXTS, progress=False), base.generate(TEXTS[0], params, progress=False)[0].token_ids
    llm = LLM(str(tiny_llama), device_path=True, **kw)
    assert llm.engine.runner.plan.flat and not base.engine.runner.plan.flat
    llm.engine.add_request("g", TEXTS[0], params)
    llm.engine.add_request("e", TEXTS, PoolingParams())
    got = {}
    while llm.engine.has_unfinished():
        got |= {o.request_id: o for o in llm.engine.step()}
    close([o.embedding for o in got["e"].items], [o.embedding for o in want[0]], 1e-4)
    assert got["g"].token_ids == want[1]
