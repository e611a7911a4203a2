"""A bad body is its own line's 400, in OpenAI's error shape; the other lines of the batch run (real
redis-server, the engine worker driven through rq)."""

from __future__ import annotations

import json

import pytest
import redis

from sluice.contract.storage import read_url
from sluice.engine import LLM
from sluice.producer import BatchStatus, Client
from sluice.worker.worker import EngineWorker

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
BAD_BODIES = {
    "bad-n": ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    "bad-bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias.5"),
    "bad-messages": (CHAT, {"max_tokens": 3}, "messages"),
    "bad-tool": (CHAT, {"messages": USER, "tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 "tool_choice.function.name"),
}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=64)


def run_worker(llm, redis_url: str) -> None:
    worker = EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5)
    worker.work(burst=True, logging_level="WARNING")


def lines_37() -> list[dict]:
    """33 good completions with the 4 bad bodies spread among them."""
    body = {"max_tokens": 3, "temperature": 0}
    good = [{"custom_id": f"ok{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"the quick brown fox {i}", **body}} for i in range(33)]
    bad = [{"custom_id": cid, "method": "POST", "url": url, "body": body}
           for cid, (url, body, _) in BAD_BODIES.items()]
    for n, line in enumerate(bad):
        good.insert(3 + n * 9, line)
    return good  # fmt: skip


def test_four_bad_bodies_fail_only_their_lines(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(lines_37(), output=tmp_path.as_uri(), shard_size=8)
    assert batch.status == BatchStatus.in_progress and not batch.errors
    run_worker(llm, redis_url)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert done.request_counts.model_dump() == {"total": 37, "completed": 33, "failed": 4}
    results = list(client.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(f"ok{i}" for i in range(33))
    assert all(r.response.status_code == 200 and r.response.body["choices"] for r in results)
    raw = [json.loads(line) for line in read_url(done.error_file).splitlines()]
    assert sorted(r["custom_id"] for r in raw) == sorted(BAD_BODIES)
    for record in raw:
        response = record["response"]
        assert response["status_code"] == 400 and response["request_id"].startswith("req_")
        error = response["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == BAD_BODIES[record["custom_id"]][2]
        assert record["error"]["code"] == error["code"]


def test_a_schema_keyword_the_grammar_would_ignore_is_that_lines_400(llm, redis_url, tmp_path):
    """Remote $ref, uniqueItems, an unknown format, multipleOf on a number: refused by name at submit, never
    run unconstrained."""
    schemas = {
        "remote-ref": ({"$ref": "https://example.com/schema.json"}, "remote"),
        "unique": ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        "format": ({"type": "string", "format": "iri"}, "'iri'"),
        "multiple": ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        "fine": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, None),
    }
    def body(schema: dict) -> dict:
        formatted = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        return {"messages": USER, "max_tokens": 8, "temperature": 0, "response_format": formatted}

    lines = [{"custom_id": cid, "method": "POST", "url": CHAT, "body": body(schema)}
             for cid, (schema, _) in schemas.items()]
    client = Client(redis_url)
    batch = client.submit_batch(lines, output=tmp_path.as_uri())
    run_worker(llm, redis_url)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert done.request_counts.model_dump() == {"total": 5, "completed": 1, "failed": 4}
    errors = {r.custom_id: r.response.body["error"] for r in client.results(batch.id, errors=True)}
    assert set(errors) == {cid for cid, (_, word) in schemas.items() if word}
    for cid, error in errors.items():
        assert schemas[cid][1] in error["message"] and error["param"] == "response_format.json_schema.schema"
    (fine,) = client.results(batch.id)
    assert fine.custom_id == "fine" and fine.response.status_code == 200

