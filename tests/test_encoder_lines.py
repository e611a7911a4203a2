"""Batch lines on encoder checkpoints through a real worker process: /v1/embeddings on a sentence-transformers
BERT."""

from __future__ import annotations

import base64
import functools
import struct

import pytest
import torch

from sluice.engine import LLM
from sluice.producer import BatchStatus, Client
from tests.checkpoints import make_encoder_checkpoint, sentence_transformers_files
from tests.openai_types import openai_body
from tests.services import start_worker, stop_worker

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "to be or not to be"]


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = make_encoder_checkpoint(tmp_path_factory.mktemp("st-bert"), "bert")
    return sentence_transformers_files(path, "pooling_mode_mean_tokens", max_seq_length=24)


def run_batch(model, redis_url, tmp_path, lines: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Submit the lines, run a real worker process over them; response bodies and errors by custom_id."""
    client = Client(redis_url)
    batch = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=4)
    worker = start_worker(model, redis_url, tmp_path / "worker.log")
    try:
        done = client.wait(batch.id, timeout=180, progress=False)
    finally:
        stop_worker(worker)
    assert done.status == BatchStatus.completed, (tmp_path / "worker.log").read_text()[-3000:]
    bodies = {r.custom_id: r.response.body for r in client.results(batch.id)}
    errors = {r.custom_id: r.error.model_dump() for r in client.results(batch.id, errors=True)}
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
