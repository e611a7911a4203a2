"""Producer side against a real redis-server: validation, shards as JSON rq jobs, idempotency, priority,
cancel."""

from __future__ import annotations

import json
import zlib

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.batch import TransitionError
from sluice.contract.jobs import finalize_job_id, shard_job_id
from sluice.contract.queues import queue_for
from sluice.contract.settings import Settings
from sluice.contract.shards import input_key, shard_requests
from sluice.contract.storage import open_storage
from sluice.producer import BatchStatus, Client
from sluice.producer.client import window_seconds
from sluice.producer.validation import validate_lines
from sluice.worker.finalize import finalize_batch


def line(custom_id: str, url: str = "/v1/completions", **body) -> dict:
    body = body or {"prompt": f"hello {custom_id}", "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def raw(*items) -> list[bytes]:
    return [i if isinstance(i, bytes) else json.dumps(i).encode() for i in items]


def test_validation_names_line_code_and_field():
    lines = raw(
        line("a"),
        b"{not json",
        line("a"),
        {**line("b"), "method": "GET"},
        line("c", prompt="hi", temperature=3),
        line("d", prompt=["two", "prompts"]),
        line("e", prompt="x", frequency_penalti=0.5),
        line("f", "/v1/images/generations"),  # an endpoint batch lines cannot name
        b"",
        line("g", prompt="ok"),
    )
    checked = validate_lines(lines, Settings())
    assert [r.custom_id for r in checked.requests] == ["a", "c", "d", "e", "g"]
    got = [(e.line, e.code, e.param) for e in checked.errors]
    assert got == [
        (2, "invalid_json", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_request", "method"),
        (8, "invalid_request", "url"),
    ]
    assert "line 1" in checked.errors[1].message
    refused = {r.custom_id: r.answer() for r in checked.requests if r.record is not None}
    errors = {cid: record.response.body["error"] for cid, record in refused.items()}
    assert {cid: (e["code"], e["param"], e["type"]) for cid, e in errors.items()} == {
        "c": ("invalid_value", "temperature", "invalid_request_error"),
        "d": ("invalid_value", "prompt", "invalid_request_error"),
        "e": ("unknown_parameter", "frequency_penalti", "invalid_request_error"),
    }
    assert all(record.response.status_code == 400 for record in refused.values())
    assert "line 5" in errors["c"]["message"] and refused["c"].error.code == "invalid_value"


def test_chat_validation_names_the_field_and_accepts_content_parts():
    lines = raw(
        line("c", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], temperature=3),
        line(
            "g",
            "/v1/chat/completions",
            messages=[{"role": "user", "content": [{"type": "text", "text": "ok"}]}],
        ),
    )
    checked = validate_lines(lines, Settings())
    assert checked.errors == [] and [r.custom_id for r in checked.requests] == ["c", "g"]
    refused = {r.custom_id: r.answer() for r in checked.requests if r.record is not None}
    assert list(refused) == ["c"] and refused["c"].response.status_code == 400
    error = refused["c"].response.body["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "temperature")
    assert error["type"] == "invalid_request_error"
    assert "line 1" in error["message"]


ONE_OF_EACH = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"},
    "/v1/responses": {"input": [{"role": "user", "content": "hi"}]},
    "/v1/rerank": {"query": "hi", "documents": ["a", "b"]},
    "/v1/score": {"text_1": "hi", "text_2": "there"},
    "/v1/moderations": {"input": "hi"},
}


def test_a_file_mixing_urls_is_refused_naming_the_line_and_both_urls():
    lines = raw(
        b"{not json",
        line("a"),
        line("b", "/v1/chat/completions", **ONE_OF_EACH["/v1/chat/completions"]),
        line("c"),
        line("d", "/v1/embeddings", **ONE_OF_EACH["/v1/embeddings"]),
    )
    checked = validate_lines(lines, Settings())
    assert [(e.line, e.code, e.param) for e in checked.errors] == [
        (1, "invalid_json", None), (3, "invalid_url", "url"), (5, "invalid_url", "url"),
    ]
    chat, embeddings = checked.errors[1].message, checked.errors[2].message
    for message, url in ((chat, "/v1/chat/completions"), (embeddings, "/v1/embeddings")):
        assert url in message and "'/v1/completions' of line 2" in message
        assert "one endpoint" in message and "split the file by url" in message
    assert chat.startswith("line 3:") and embeddings.startswith("line 5:")
    assert [r.custom_id for r in checked.requests] == ["a", "c"]
    assert checked.num_lines == 5, "every line is a request or a line-numbered error"


@pytest.mark.parametrize("url", sorted(ONE_OF_EACH))
def test_a_file_of_one_url_passes_for_every_endpoint(url):
    lines = raw(*(line(f"r{i}", url, **ONE_OF_EACH[url]) for i in range(3)))
    checked = validate_lines(lines, Settings())
    assert checked.errors == []
    got = [(r.custom_id, r.url, r.record) for r in checked.requests]
    assert got == [(f"r{i}", url, None) for i in range(3)]


def test_size_limits_are_enforced_per_line_and_per_batch():
    settings = Settings(max_line_bytes=200, max_lines=3)
    lines = raw(line("a"), line("b", prompt="x" * 300), line("c"), line("d"), line("e"))
    checked = validate_lines(lines, settings)
    codes = [(e.line, e.code) for e in checked.errors]
    assert (2, "line_too_large") in codes
    assert (4, "too_many_lines") in codes
    assert validate_lines([], settings).errors[0].code == "empty_file"


def test_invalid_batch_fails_with_line_numbered_errors_and_enqueues_nothing(redis_url):
    client = Client(redis_url)
    batch = client.submit_batch(raw(line("a"), b"[1, 2", line("a")), output="file:///tmp/unused")
    assert batch.status == BatchStatus.failed and batch.failed_at
    assert [(e.line, e.code) for e in batch.errors] == [(2, "invalid_json"), (3, "duplicate_custom_id")]
    assert batch.request_counts.total == 3
    assert Queue("default", connection=client.connection).count == 0


def test_submit_batch_of_a_file_mixing_urls_fails_and_enqueues_nothing(redis_url, tmp_path):
    client = Client(redis_url)
    lines = [line("a"), line("b"), line("c", "/v1/embeddings", input="hi")]
    batch = client.submit_batch(lines, output=tmp_path.as_uri())
    assert batch.status == BatchStatus.failed and batch.failed_at
    assert [(e.line, e.code, e.param) for e in batch.errors] == [(3, "invalid_url", "url")]
    message = batch.errors[0].message
    assert "'/v1/embeddings'" in message and "'/v1/completions' of line 1" in message
    assert batch.request_counts.total == 3 and batch.request_counts.failed == 3
    queues = [Queue(q, connection=client.connection) for q in ("high", "default", "low")]
    assert [q.count for q in queues] == [0, 0, 0]
    assert not (tmp_path / input_key(batch.id)).exists(), "no input is published"


def test_submit_enqueues_json_shards_and_a_finalize_job_depending_on_them(redis_url, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(line(f"r{i}")) for i in range(10)) + "\n")
    client = Client(redis_url)
    batch = client.submit_batch(str(path), output=tmp_path.as_uri(), shard_size=4, metadata={"team": "x"})
    assert batch.status == BatchStatus.in_progress and batch.num_shards == 3
    assert batch.request_counts.total == 10 and batch.metadata == {"team": "x"}
    queue = Queue("default", connection=client.connection, serializer=JSONSerializer)
    assert queue.job_ids == [shard_job_id(batch.id, n) for n in range(3)]
    data = client.connection.hget(Job.key_for(shard_job_id(batch.id, 2)), "data")
    func, _, args, _ = json.loads(zlib.decompress(data))
    assert func == "sluice.worker.shard_run.run_shard"
    assert b"r8" not in zlib.decompress(data), "the job carries a slice of the stored input, no requests"
    storage = open_storage(tmp_path.as_uri())
    requests = list(shard_requests(storage, args[2]))
    assert [r.custom_id for r in requests] == ["r8", "r9"]
    stored = storage.get(input_key(batch.id))
    compact = [r.model_dump_json().encode() for r in requests]
    assert stored.endswith(b"\n".join(compact) + b"\n"), "the validated requests' JSON, stored once, in order"
    assert len(stored.splitlines()) == 10
    finalize = Job.fetch(finalize_job_id(batch.id), connection=client.connection, serializer=JSONSerializer)
    assert finalize.get_status() == JobStatus.DEFERRED
    assert set(finalize._dependency_ids) == set(queue.job_ids)


def test_idempotency_key_returns_the_same_batch(redis_url):
    client = Client(redis_url)
    first = client.submit_batch([line("a")], idempotency_key="nightly-2026-12-02")
    again = client.submit_batch([line("a"), line("b")], idempotency_key="nightly-2026-12-02")
    other = client.submit_batch([line("a")], idempotency_key="nightly-2026-12-03")
    assert again.id == first.id and other.id != first.id
    assert Queue("default", connection=client.connection).count == 2


def test_priority_selects_the_queue(redis_url):
    client = Client(redis_url)
    client.submit_batch([line("a")], priority="high")
    client.submit_batch([line("b")], priority="low")
    counts = {q: Queue(q, connection=client.connection).count for q in ("high", "default", "low")}
    assert counts == {"high": 1, "default": 0, "low": 1}
    with pytest.raises(ValueError, match="priority"):
        client.submit_batch([line("c")], priority="urgent")


def test_submit_single_request_builds_chat_or_completion(redis_url):
    client = Client(redis_url)
    chat = client.submit([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    text = client.submit("once upon", max_tokens=2)
    queue = Queue("default", connection=client.connection, serializer=JSONSerializer)
    jobs = [queue.fetch_job(shard_job_id(b.id, 0)) for b in (chat, text)]
    storage = open_storage(client.settings.output_url)
    requests = [next(shard_requests(storage, j.args[2])) for j in jobs]
    assert [r.url for r in requests] == ["/v1/chat/completions", "/v1/completions"]
    assert requests[0].body["max_tokens"] == 3 and chat.request_counts.total == 1


def test_cancel_drops_queued_shards_and_finalizes_as_cancelled(redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch([line(f"r{i}") for i in range(6)], output=tmp_path.as_uri(), shard_size=2)
    cancelling = client.cancel(batch.id)
    assert cancelling.status == BatchStatus.cancelling
    assert set(CanceledJobRegistry("default", connection=client.connection).get_job_ids()) == {
        shard_job_id(batch.id, n) for n in range(3)
    }
    queue = Queue("default", connection=client.connection)
    assert queue.job_ids == [finalize_job_id(batch.id)]
    finalize_batch(batch.id)
    done = client.get(batch.id)
    assert done.status == BatchStatus.cancelled and done.cancelled_at
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 6)
    errors = list(client.results(batch.id, errors=True))
    assert sorted(r.custom_id for r in errors) == [f"r{i}" for i in range(6)]
    assert {r.error.code for r in errors} == {"batch_cancelled"}
    with pytest.raises(TransitionError):
        client.cancel(batch.id)


def test_completion_window_and_metadata_are_checked(redis_url):
    assert window_seconds("24h") == 86400 and window_seconds("90m") == 5400
    client = Client(redis_url)
    with pytest.raises(ValueError, match="completion_window"):
        client.submit_batch([line("a")], completion_window="tomorrow")
    with pytest.raises(ValueError, match="metadata"):
        client.submit_batch([line("a")], metadata={f"k{i}": "v" for i in range(17)})
    batch = client.submit_batch([line("a")], completion_window="2h")
    assert batch.expires_at == pytest.approx(batch.created_at + 7200)


def test_webhook_is_checked_at_submit_and_notified_on_finalize(redis_url, tmp_path, monkeypatch):
    from sluice.contract.events import DUE_KEY, delivery_key

    client = Client(redis_url)
    with pytest.raises(ValueError, match="internal address"):
        client.submit_batch([line("a")], webhook="http://127.0.0.1:9/hook")
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW", "127.0.0.1")  # read once, when a client is made
    client = Client(redis_url)
    batch = client.submit_batch([line("a")], output=tmp_path.as_uri(), webhook="http://127.0.0.1:9/hook")
    assert batch.webhook == "http://127.0.0.1:9/hook"
    client.cancel(batch.id)
    finalize_batch(batch.id)
    (event_id,) = [e.decode() for e in client.connection.zrange(DUE_KEY, 0, -1)]
    event = client.connection.hgetall(delivery_key(event_id))
    body = json.loads(event[b"body"])
    assert body["type"] == "batch.cancelled" and body["data"]["id"] == batch.id


def test_input_can_be_an_s3_object(redis_url, s3_server, s3_bucket):
    body = "".join(json.dumps(line(f"r{i}")) + "\n" for i in range(3))
    s3_server.client().put_object(Bucket=s3_bucket, Key="incoming/a.jsonl", Body=body.encode())
    client = Client(redis_url)
    batch = client.submit_batch(f"s3://{s3_bucket}/incoming/a.jsonl", output=f"s3://{s3_bucket}/out")
    assert batch.status == BatchStatus.in_progress and batch.request_counts.total == 3
    missing = client.submit_batch(f"s3://{s3_bucket}/incoming/nope.jsonl")
    assert missing.status == BatchStatus.failed and missing.errors[0].code == "input_unreadable"


def test_shards_are_capped_by_count_and_by_bytes(redis_url):
    client = Client(redis_url, settings=Settings(max_shard_bytes=450))
    small = [line(f"s{i}") for i in range(5)]
    big = [line(f"b{i}", prompt="x" * 300) for i in range(3)]
    batch = client.submit_batch(small + big, shard_size=4)
    queue = queue_for(client.connection, "default")
    storage = open_storage(client.settings.output_url)
    jobs = [queue.fetch_job(shard_job_id(batch.id, n)) for n in range(batch.num_shards)]
    sizes = [len(list(shard_requests(storage, j.args[2]))) for j in jobs]
    assert sizes == [4, 1, 1, 1, 1] and batch.num_shards == 5
