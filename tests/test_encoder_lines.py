"""Batch lines on encoder checkpoints through a real worker process: /v1/embeddings on a sentence-transformers
BERT, /v1/rerank and /v1/score on a cross-encoder, /v1/moderations on a classifier."""

from __future__ import annotations

import base64
import functools
import json
import struct

import pytest
import torch

from sluice.contract.settings import Settings
from sluice.engine import LLM
from sluice.producer import BatchStatus, Client
from sluice.producer.validation import validate_lines
from tests.checkpoints import make_encoder_checkpoint, sentence_transformers_files
from tests.openai_types import openai_body
from tests.services import start_worker, stop_worker

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "to be or not to be"]


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def by_url(lines: list[dict]) -> list[list[dict]]:
    """The lines split into one file per url (a batch's lines all name one url), in first-seen order."""
    files: dict[str, list[dict]] = {}
    for x in lines:
        files.setdefault(x["url"], []).append(x)
    return list(files.values())


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = make_encoder_checkpoint(tmp_path_factory.mktemp("st-bert"), "bert")
    return sentence_transformers_files(path, "pooling_mode_mean_tokens", max_seq_length=24)


def run_batch(model, redis_url, tmp_path, lines: list[dict], *flags: str) -> tuple[dict, dict]:
    """Submit the lines (a batch per url), run a real worker process (with these flags) over them; response
    bodies and errors by custom_id."""
    client = Client(redis_url)
    batches = [client.submit_batch(x, output=tmp_path.as_uri(), shard_size=4) for x in by_url(lines)]
    worker = start_worker(model, redis_url, tmp_path / "worker.log", *flags)
    try:
        done = [client.wait(batch.id, timeout=180, progress=False) for batch in batches]
    finally:
        stop_worker(worker)
    for batch in done:
        assert batch.status == BatchStatus.completed, (tmp_path / "worker.log").read_text()[-3000:]
    bodies = {r.custom_id: r.response.body for batch in done for r in client.results(batch.id)}
    errors = {r.custom_id: r.error.model_dump()
              for batch in done for r in client.results(batch.id, errors=True)}
    return bodies, errors


def test_embedding_lines_on_a_sentence_transformers_bert(embedder, redis_url, tmp_path):
    url = "/v1/embeddings"
    lines = [line("one", url, input=TEXTS[0]), line("many", url, input=TEXTS),
             line("ids", url, input=[2, 40, 41, 3]), line("dims", url, input=TEXTS[1], dimensions=8),
             line("b64", url, input=TEXTS[:2], encoding_format="base64"),
             line("long", url, input=[TEXTS[0], "the quick brown fox " * 12])]
    bodies, errors = run_batch(embedder, redis_url, tmp_path, lines)
    llm = LLM(str(embedder), dtype="float32", device="cpu")
    want = [o.embedding for o in llm.embed(TEXTS, progress=False)]
    parsed = {cid: openai_body(b) for cid, b in bodies.items() if cid != "b64"}
    many = parsed["many"]
    close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=0)
    close(torch.tensor([d.embedding for d in many.data]), torch.tensor(want))
    assert many.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    close(torch.tensor(parsed["one"].data[0].embedding), torch.tensor(want[0]))
    ids = llm.embed([2, 40, 41, 3], progress=False)[0].embedding
    close(torch.tensor(parsed["ids"].data[0].embedding), torch.tensor(ids))
    dims = parsed["dims"].data[0].embedding
    assert len(dims) == 8 and abs(float(torch.tensor(dims).norm()) - 1) < 1e-5
    decoded = [struct.unpack("<64f", base64.b64decode(d["embedding"])) for d in bodies["b64"]["data"]]
    close(torch.tensor(decoded), torch.tensor(want[:2]))
    assert list(errors) == ["long"] and errors["long"]["code"] == "request_rejected"
    message = errors["long"]["message"]
    assert "input 1: input (" in message and "exceeds the 24 tokens" in message


QUERY = "what glitters?"
DOCS = ["all that glitters is not gold", "the lazy dog", "a stitch in time saves nine", "to be or not to be"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return make_encoder_checkpoint(tmp_path_factory.mktemp("cross-encoder"), "bert", num_labels=1, seed=3)


def test_rerank_and_score_lines_on_a_cross_encoder(cross_encoder, redis_url, tmp_path):
    lines = [line("rerank", "/v1/rerank", query=QUERY, documents=DOCS),
             line("top2", "/v1/rerank", query=QUERY, documents=DOCS, top_n=2, return_documents=False),
             line("score", "/v1/score", text_1=QUERY, text_2=DOCS[:3]),
             line("score-nn", "/v1/score", text_1=DOCS[:2], text_2=DOCS[2:]),
             line("too-long", "/v1/rerank", query=QUERY, documents=[DOCS[0], "the lazy dog " * 40])]
    bodies, errors = run_batch(cross_encoder, redis_url, tmp_path, lines)
    llm = LLM(str(cross_encoder), dtype="float32", device="cpu")
    want = [o.score for o in llm.score(QUERY, DOCS, progress=False)]
    results = bodies["rerank"]["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5
        assert r["document"] == {"text": DOCS[r["index"]]}
    tokens = sum(len(o.prompt_token_ids) for o in llm.score(QUERY, DOCS, progress=False))
    assert bodies["rerank"]["usage"] == {"total_tokens": tokens}
    assert bodies["rerank"]["id"].startswith("rerank-")
    assert bodies["top2"]["results"] == [{"index": r["index"], "relevance_score": r["relevance_score"]}
                                         for r in results[:2]]
    score = bodies["score"]
    assert score["object"] == "list" and [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(score["data"], want[:3], strict=True))
    nn = [o.score for o in llm.score(DOCS[:2], DOCS[2:], progress=False)]
    assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(bodies["score-nn"]["data"], nn, strict=True))
    assert list(errors) == ["too-long"] and errors["too-long"]["code"] == "request_rejected"
    assert "input 1: input (" in errors["too-long"]["message"]


def test_rerank_score_and_moderation_lines_are_validated_by_field():
    lines = [
        line("ok", "/v1/rerank", query="q", documents=["a"]),
        line("no-docs", "/v1/rerank", query="q", documents=[]),
        line("top", "/v1/rerank", query="q", documents=["a"], top_n=0),
        line("uneven", "/v1/score", text_1=["a", "b"], text_2=["a", "b", "c"]),
        line("mod-empty", "/v1/moderations", input=[]),
        line("mod-extra", "/v1/moderations", input="x", threshold=0.3)]
    files = [validate_lines([json.dumps(x).encode() for x in file], Settings()) for file in by_url(lines)]
    assert len(files) == 3 and not any(checked.errors for checked in files)  # bad bodies: each its line's 400
    requests = [r for checked in files for r in checked.requests]
    assert [r.custom_id for r in requests if r.answer() is None] == ["ok"]
    refused = {r.custom_id: r.answer().response for r in requests if r.answer() is not None}
    assert {cid: (resp.status_code, resp.body["error"]["param"]) for cid, resp in refused.items()} == {
        "no-docs": (400, "documents"), "top": (400, "top_n"), "uneven": (400, None),
        "mod-empty": (400, "input"), "mod-extra": (400, "threshold")}
    assert "give one, or as many on each side" in refused["uneven"].body["error"]["message"]


LABELS = {0: "toxic", 1: "hate", 2: "insult"}


@pytest.fixture(scope="module")
def moderator(tmp_path_factory):
    return make_encoder_checkpoint(tmp_path_factory.mktemp("moderator"), "roberta", num_labels=3, seed=5,
                                   id2label=LABELS, label2id={v: k for k, v in LABELS.items()})


def test_moderation_lines_on_a_classifier_with_thresholds(moderator, redis_url, tmp_path):
    from openai.types import ModerationCreateResponse

    llm = LLM(str(moderator), dtype="float32", device="cpu")
    probs = [o.probs for o in llm.classify(TEXTS, progress=False)]
    # a "toxic" threshold between the two lowest toxic scores: the lowest input passes, the others are flagged
    toxic = sorted(p[0] for p in probs)
    thresholds = {"toxic": (toxic[0] + toxic[1]) / 2, "default": 1.0}
    low = min(range(len(TEXTS)), key=lambda i: probs[i][0])
    lines = [line("one", "/v1/moderations", input=TEXTS[low]), line("many", "/v1/moderations", input=TEXTS)]
    bodies, errors = run_batch(moderator, redis_url, tmp_path, lines, "--moderation-thresholds",
                               json.dumps(thresholds))
    assert not errors
    many = ModerationCreateResponse.model_validate(bodies["many"], strict=True)
    assert many.id.startswith("modr-") and len(many.results) == len(TEXTS)
    for result, p in zip(many.results, probs, strict=True):
        scores = result.category_scores.model_dump(by_alias=True)
        assert [scores[name] for name in LABELS.values()] == pytest.approx(p, abs=1e-5)
        assert scores["violence"] == 0.0 and result.categories.violence is False
        flagged = p[0] >= thresholds["toxic"]
        assert result.flagged == flagged
        cats = result.categories.model_dump(by_alias=True)
        assert cats["toxic"] == flagged and cats["hate"] is False and cats["insult"] is False
        assert result.category_applied_input_types.model_dump(by_alias=True)["toxic"] == ["text"]
    one = bodies["one"]["results"][0]
    assert one["flagged"] is False
    assert one["category_scores"]["toxic"] == pytest.approx(probs[low][0], abs=1e-5)
