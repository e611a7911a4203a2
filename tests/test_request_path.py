"""One request type from the batch line to the engine: validated at the edge, stored as JSON in the batch's
input (its shard job carries the slice), rebuilt by the worker without validating it again; its typed body
built once there."""

from __future__ import annotations

import json
from collections import Counter

from sluice.contract.schemas import BatchRequest, ChatBody, CompletionBody
from sluice.contract.settings import Settings
from sluice.contract.shards import shard_requests
from sluice.contract.storage import FileStorage
from sluice.producer.sharding import InputSpool
from sluice.producer.validation import validate_lines
from sluice.worker.shard_run import ShardRun, prepare

LINES = {  # one batch each: a batch's lines all name one url
    "b": {"custom_id": "c", "method": "POST", "url": "/v1/completions",
          "body": {"prompt": "hi", "max_tokens": 3}},
    "t": {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
          "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}},
}  # fmt: skip


class CountingValidator:
    """A model's pydantic validator that counts every validation (model_validate, _json, the constructor)."""

    def __init__(self, name: str, inner, counts: Counter) -> None:
        self.name, self.inner, self.counts = name, inner, counts

    def __getattr__(self, attr: str):
        method = getattr(self.inner, attr)
        if not attr.startswith("validate_"):
            return method

        def counted(*args, **kwargs):
            self.counts[self.name] += 1
            return method(*args, **kwargs)

        return counted


def count_validations(monkeypatch) -> Counter:
    """Validations of BatchRequest and of the typed bodies, by model name."""
    counts: Counter = Counter()
    for model in (BatchRequest, CompletionBody, ChatBody):
        validator = CountingValidator(model.__name__, model.__pydantic_validator__, counts)
        monkeypatch.setattr(model, "__pydantic_validator__", validator)
    return counts


def test_a_request_is_validated_at_the_edge_and_rebuilt_without_validation(monkeypatch, tmp_path):
    counts = count_validations(monkeypatch)
    storage = FileStorage(tmp_path)
    carried = {}
    for batch_id, line in LINES.items():
        with InputSpool(storage, batch_id, shard_size=10, max_bytes=1 << 20) as spool:
            checked = validate_lines([json.dumps(line).encode()], Settings(), into=spool)
            [piece] = spool.commit()
        assert checked.errors == []
        carried[batch_id] = json.loads(json.dumps(piece.arg()))  # the shard job holds the slice in Redis
    assert counts == {"CompletionBody": 1, "ChatBody": 1}, "validated once each; storing and slicing: nothing"
    runs = {batch_id: ShardRun.from_args(f"{batch_id}-shard-0", (batch_id, 0, carried[batch_id]))
            for batch_id in LINES}
    for run in runs.values():
        run.requests = list(shard_requests(storage, run.payload))  # what load() reads from storage
    assert [r.custom_id for run in runs.values() for r in run.requests] == ["c", "t"]
    assert counts == {"CompletionBody": 1, "ChatBody": 1}, "rebuilt without validation"
    completion = runs["b"].requests[0]
    prompt, params = prepare(None, completion, served=set())
    assert prompt == "hi" and params.max_tokens == 3
    assert completion.parsed_body() is completion.parsed_body()
    assert counts == {"CompletionBody": 2,
                      "ChatBody": 1}, "the worker builds the typed body once, and keeps it"


def test_a_forged_body_fails_only_its_own_request_in_the_worker():
    """trusted() does not validate, so a body no producer let through (a job forged in Redis) is caught when
    the worker builds the typed body: an invalid_request record (a 400 response) for that request alone."""
    good = {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "x"}}
    forged = {"custom_id": "bad", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 7}}
    run = ShardRun.from_args("b-shard-0", ("b", 0, [good, forged]))
    assert run.requests[1] == BatchRequest(custom_id="bad", url="/v1/completions", body=forged["body"])
    run.add(None, "b/1", run.requests[1], served=set())
    error = run.records["bad"].error
    assert error.code == "invalid_request" and "temperature" in error.message
    response = run.records["bad"].response
    assert response.status_code == 400 and response.body["error"]["type"] == "invalid_request_error"
    assert "ok" not in run.records and not run.pending
