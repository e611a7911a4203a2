"""/v1/rerank, /v1/score and /v1/moderations batches through the HTTP Batch API: a live `sluice serve`, the
`openai` client, and a real worker process on a tiny encoder checkpoint (a cross-encoder, a classifier)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.engine import LLM
from sluice.producer.server.keys import KeyStore
from tests.checkpoints import make_encoder_checkpoint
from tests.server_stack import Stack, jsonl, start_server, wait_status
from tests.services import RedisServer, start_worker, stop_worker

QUERY = "what glitters?"
DOCS = ["all that glitters is not gold", "the lazy dog", "a stitch in time saves nine", "to be or not to be"]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "to be or not to be"]
LABELS = {0: "toxic", 1: "hate", 2: "insult"}
DONE = {"completed", "failed", "cancelled", "expired"}


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, tmp_path_factory) -> Iterator[Stack]:
    """A live server; each test starts its own worker on the checkpoint its endpoint needs."""
    redis_server.client().flushall()
    tmp = tmp_path_factory.mktemp("serve-encoders")
    process, url = start_server(redis_server.url, tmp)
    try:
        yield Stack(url, redis_server.url, KeyStore(redis_server.client()), tmp)
    finally:
        stop_worker(process)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return make_encoder_checkpoint(tmp_path_factory.mktemp("cross-encoder"), "bert", num_labels=1, seed=3)


@pytest.fixture(scope="module")
def moderator(tmp_path_factory) -> Path:
    return make_encoder_checkpoint(tmp_path_factory.mktemp("moderator"), "roberta", num_labels=3, seed=5,
                                   id2label=LABELS, label2id={v: k for k, v in LABELS.items()})


def run_http_batch(server: Stack, model: Path, endpoint: str, lines: list[dict], tmp_path: Path,
                   *flags: str) -> dict[str, dict]:
    """Upload the lines, create a batch for endpoint, run a worker on model until it is done; every record
    (output and error files) by custom_id."""
    client = server.openai(server.key(f"enc-{tmp_path.name}"))
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    assert batch.endpoint == endpoint
    worker = start_worker(model, server.redis_url, tmp_path / "worker.log", *flags)
    try:
        done = wait_status(client, batch.id, DONE)
    finally:
        stop_worker(worker)
    assert done.status == "completed", (tmp_path / "worker.log").read_text()[-3000:]
    assert done.request_counts.total == len(lines)
    records = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id is not None:
            records += [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(x["custom_id"] for x in lines)
    return {r["custom_id"]: r for r in records}


def test_rerank_batch_through_the_http_batch_api(server, cross_encoder, tmp_path):
    lines = [line("all", "/v1/rerank", query=QUERY, documents=DOCS),
             line("top2", "/v1/rerank", query=QUERY, documents=DOCS, top_n=2, return_documents=False),
             line("no-docs", "/v1/rerank", query=QUERY, documents=[])]
    records = run_http_batch(server, cross_encoder, "/v1/rerank", lines, tmp_path)
    llm = LLM(str(cross_encoder), dtype="float32", device="cpu")
    want = [o.score for o in llm.score(QUERY, DOCS, progress=False)]
    tokens = sum(len(o.prompt_token_ids) for o in llm.score(QUERY, DOCS, progress=False))
    body = records["all"]["response"]["body"]
    assert records["all"]["response"]["status_code"] == 200 and body["id"].startswith("rerank-")
    assert body["usage"] == {"total_tokens": tokens}
    assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    top2 = records["top2"]["response"]["body"]["results"]
    assert top2 == [{"index": r["index"], "relevance_score": r["relevance_score"]}
                    for r in body["results"][:2]]
    refused = records["no-docs"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "documents"


def test_score_batch_through_the_http_batch_api(server, cross_encoder, tmp_path):
    lines = [line("1-n", "/v1/score", text_1=QUERY, text_2=DOCS[:3]),
             line("n-n", "/v1/score", text_1=DOCS[:2], text_2=DOCS[2:]),
             line("uneven", "/v1/score", text_1=DOCS[:2], text_2=DOCS[:3])]
    records = run_http_batch(server, cross_encoder, "/v1/score", lines, tmp_path)
    llm = LLM(str(cross_encoder), dtype="float32", device="cpu")
    for cid, (text_1, text_2) in {"1-n": (QUERY, DOCS[:3]), "n-n": (DOCS[:2], DOCS[2:])}.items():
        body = records[cid]["response"]["body"]
        assert records[cid]["response"]["status_code"] == 200 and body["object"] == "list"
        want = [o.score for o in llm.score(text_1, text_2, progress=False)]
        assert body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == list(range(len(want)))
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        tokens = sum(len(o.prompt_token_ids) for o in llm.score(text_1, text_2, progress=False))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    refused = records["uneven"]["response"]
    assert refused["status_code"] == 400
    assert "give one, or as many on each side" in refused["body"]["error"]["message"]


def test_moderation_batch_through_the_http_batch_api(server, moderator, tmp_path):
    from openai.types import ModerationCreateResponse

    llm = LLM(str(moderator), dtype="float32", device="cpu")
    probs = [o.probs for o in llm.classify(TEXTS, progress=False)]
    toxic = sorted(p[0] for p in probs)
    thresholds = {"toxic": (toxic[0] + toxic[1]) / 2, "default": 1.0}  # the lowest input alone passes
    lines = [line("one", "/v1/moderations", input=TEXTS[0]), line("many", "/v1/moderations", input=TEXTS),
             line("empty", "/v1/moderations", input=[])]
    records = run_http_batch(server, moderator, "/v1/moderations", lines, tmp_path,
                             "--moderation-thresholds", json.dumps(thresholds))
    many = ModerationCreateResponse.model_validate(records["many"]["response"]["body"], strict=True)
    one = ModerationCreateResponse.model_validate(records["one"]["response"]["body"], strict=True)
    assert many.id.startswith("modr-") and len(many.results) == len(TEXTS) and len(one.results) == 1
    assert one.results[0].flagged == many.results[0].flagged
    one_toxic = one.results[0].category_scores.model_dump(by_alias=True)["toxic"]
    assert one_toxic == pytest.approx(probs[0][0], abs=1e-5)
    for result, p in zip(many.results, probs, strict=True):
        scores = result.category_scores.model_dump(by_alias=True)
        assert [scores[name] for name in LABELS.values()] == pytest.approx(p, abs=1e-5)
        flagged = p[0] >= thresholds["toxic"]
        assert result.flagged == flagged == result.categories.model_dump(by_alias=True)["toxic"]
        assert scores["violence"] == 0.0 and result.categories.violence is False
    assert sum(r.flagged for r in many.results) == len(TEXTS) - 1
    refused = records["empty"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "input"
