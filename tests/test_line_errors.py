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


GOOD = {"/v1/completions": 33, CHAT: 12}  # good lines of each url's batch


def batch_lines(url: str) -> list[dict]:
    """GOOD[url] good lines of url with that url's bad bodies spread among them."""
    params = {"max_tokens": 3, "temperature": 0}

    def line(custom_id: str, body: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    def good_body(i: int) -> dict:
        text = f"the quick brown fox {i}"
        prompt = {"messages": [{"role": "user", "content": text}]} if url == CHAT else {"prompt": text}
        return {**prompt, **params}

    lines = [line(f"ok{i}", good_body(i)) for i in range(GOOD[url])]
    for n, cid in enumerate(bad_ids(url)):
        lines.insert(3 + n * 9, line(cid, BAD_BODIES[cid][1]))
    return lines


def bad_ids(url: str) -> list[str]:
    return [cid for cid, (bad_url, _, _) in BAD_BODIES.items() if bad_url == url]


def test_four_bad_bodies_fail_only_their_lines(llm, redis_url, tmp_path):
    client = Client(redis_url)
    output = tmp_path.as_uri()
    batches = {url: client.submit_batch(batch_lines(url), output=output, shard_size=8) for url in GOOD}
    assert all(b.status == BatchStatus.in_progress and not b.errors for b in batches.values())
    run_worker(llm, redis_url)
    raw = []
    for url, batch in batches.items():
        done = client.get(batch.id)
        assert done.status == BatchStatus.completed
        counts = {"total": GOOD[url] + 2, "completed": GOOD[url], "failed": 2}
        assert done.request_counts.model_dump() == counts
        results = list(client.results(batch.id))
        assert sorted(r.custom_id for r in results) == sorted(f"ok{i}" for i in range(GOOD[url]))
        assert all(r.response.status_code == 200 and r.response.body["choices"] for r in results)
        errors = [json.loads(line) for line in read_url(done.error_file).splitlines()]
        assert sorted(r["custom_id"] for r in errors) == sorted(bad_ids(url))
        raw += errors
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

