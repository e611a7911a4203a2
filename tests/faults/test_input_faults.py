"""Input faults against real redis-server, moto and HTTP servers: unreadable inputs, odd names, files
mid-write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore
from sluice.contract.jobs import shard_job_id
from sluice.contract.redis_conn import connect
from sluice.contract.schemas import Batch, BatchStatus
from sluice.contract.shards import shard_requests
from sluice.contract.storage import open_storage
from sluice.producer.client import Client
from sluice.producer.cron import CronPipeline, idempotency_key, processed, tick
from tests.test_webhooks import ROOT


def line(custom_id: str, **body) -> bytes:
    body = body or {"prompt": f"hello {custom_id}", "max_tokens": 4}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    ).encode()


def jsonl(*ids: str) -> bytes:
    return b"".join(line(i) + b"\n" for i in ids)


class Forbidding(BaseHTTPRequestHandler):
    """An S3 endpoint that answers every request 403 AccessDenied, as a bucket with a deny policy does."""

    def _deny(self) -> None:
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.send_response(403)
        self.send_header("content-type", "application/xml")
        self.send_header("content-length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _deny

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def forbidding_s3(s3_server, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Forbidding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    yield
    server.shutdown()


def test_s3_403_on_the_input_fails_the_batch_and_cron_records_it(redis_url, forbidding_s3):
    client = Client(redis_url)
    batch = client.submit_batch("s3://locked/in.jsonl")
    assert batch.status == BatchStatus.failed
    assert batch.errors[0].code == "input_unreadable" and "403" in batch.errors[0].message
    assert batch.request_counts.total == 0


def test_unexpected_errors_after_the_record_exists_fail_the_batch(redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch([{"custom_id": "a", "body": object()}], output=tmp_path.as_uri())
    assert batch.status == BatchStatus.failed and "TypeError" in batch.errors[0].message
    deep = client.submit_batch([b'{"custom_id": "a", "body": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
    assert deep.status == BatchStatus.failed and deep.errors[0].code == "invalid_json"
    assert deep.errors[0].line == 1 and "nested deeper" in deep.errors[0].message
    assert not [b for b in client.list(100) if b.status == BatchStatus.validating]


def test_empty_input_fails_with_zero_requests(redis_url, tmp_path):
    batch = Client(redis_url).submit_batch(b"\n\n", output=tmp_path.as_uri())
    assert batch.status == BatchStatus.failed and batch.request_counts.total == 0
    assert batch.errors[0].code == "empty_file" and "no requests" in batch.errors[0].message


def test_cron_keeps_hash_and_question_mark_in_file_names(redis_url, tmp_path):
    (tmp_path / "in").mkdir()
    names = ["a#1.jsonl", "b?x.jsonl", "c 100%.jsonl"]
    for n, name in enumerate(names):
        (tmp_path / "in" / name).write_bytes(jsonl(*[f"{name}-{i}" for i in range(n + 1)]))
    pipeline = CronPipeline(name="odd", input=f"file://{tmp_path}/in/*.jsonl", every=60, settle=0,
                            output=tmp_path.joinpath("out").as_uri())  # fmt: skip
    client = Client(redis_url)
    ids = tick(connect(redis_url), pipeline, client)
    batches = sorted((client.get(i) for i in ids), key=lambda b: b.input_file)
    assert [os.path.basename(b.input_file) for b in batches] == names
    assert [(b.status, b.request_counts.total) for b in batches] == [
        (BatchStatus.in_progress, n) for n in (1, 2, 3)
    ]


def test_cron_keeps_hash_and_question_mark_in_s3_keys(redis_url, s3_server, s3_bucket, tmp_path):
    s3 = s3_server.client()
    keys = ["in/a#1.jsonl", "in/b?x.jsonl", "in/c 100%.jsonl"]
    for n, key in enumerate(keys):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=jsonl(*[f"{n}-{i}" for i in range(n + 1)]))
    pipeline = CronPipeline(name="odd", input=f"s3://{s3_bucket}/in/*.jsonl", every=60,
                            output=tmp_path.as_uri())  # fmt: skip
    client = Client(redis_url)
    batches = [client.get(i) for i in tick(connect(redis_url), pipeline, client)]
    assert sorted(b.request_counts.total for b in batches) == [1, 2, 3]
    assert all(b.status == BatchStatus.in_progress for b in batches)


def test_cron_waits_until_a_file_stops_changing(redis_url, tmp_path):
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "growing.jsonl"
    path.write_bytes(jsonl("a"))
    pipeline = CronPipeline(name="settle", input=f"file://{tmp_path}/in/*.jsonl", every=60, settle=1.5,
                            output=tmp_path.joinpath("out").as_uri())  # fmt: skip
    connection, client = connect(redis_url), Client(redis_url)
    assert tick(connection, pipeline, client) == []
    time.sleep(1.0)
    with path.open("ab") as f:
        f.write(jsonl("b"))
    assert tick(connection, pipeline, client) == []
    time.sleep(1.7)
    (batch_id,) = tick(connection, pipeline, client)
    assert client.get(batch_id).request_counts.total == 2


def test_cron_does_not_record_an_object_whose_batch_is_still_validating(redis_url, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(jsonl("a"))
    pipeline = CronPipeline(name="stuck", input=f"file://{tmp_path}/in/*.jsonl", every=60, settle=0,
                            output=tmp_path.joinpath("out").as_uri())  # fmt: skip
    connection, client = connect(redis_url), Client(redis_url)
    url = f"file://{tmp_path}/in/a.jsonl"
    st = os.stat(url.removeprefix("file://"))
    object_id = f"{url}#{st.st_size}-{st.st_mtime_ns}"
    store = BatchStore(connection)
    store.create(Batch(id="batch_midway", created_at=time.time()))
    store.claim_idempotency_key(idempotency_key("stuck", object_id), "batch_midway", ttl=60)
    assert tick(connection, pipeline, client) == [] and processed(connection, "stuck") == {}
    store.transition("batch_midway", BatchStatus.failed)
    assert tick(connection, pipeline, client) == ["batch_midway"]
    assert processed(connection, "stuck") == {object_id: "batch_midway"}


RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('system messages are not "
    "supported') }}{% endif %}{{ m.content }}{% endfor %}"
)


def test_a_raising_chat_template_or_unknown_model_fails_only_that_request(tiny_llama):
    from sluice.contract.settings import Settings
    from sluice.engine import LLM
    from sluice.worker.shard_run import ShardRun, model_name, served_models

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    llm.tokenizer.chat_template = RAISING_TEMPLATE
    name = model_name(llm)
    chat, completions = "/v1/chat/completions", "/v1/completions"
    batches = {  # a batch's lines, and so its shards', all name one url
        "batch_c": [
            {
                "custom_id": "ok",
                "url": chat,
                "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            },
            {"custom_id": "bad", "url": chat, "body": {"messages": [{"role": "system", "content": "x"}]}},
        ],
        "batch_t": [
            {"custom_id": "other", "url": completions, "body": {"prompt": "hi", "model": "gpt-4o"}},
            {
                "custom_id": "named",
                "url": completions,
                "body": {"prompt": "hi", "model": name, "max_tokens": 2},
            },
        ],
    }
    records = {}
    for batch_id, lines in batches.items():
        run = ShardRun.from_args(f"{batch_id}-shard-0", (batch_id, 0, lines))
        run.start(llm, served_models(llm, Settings()))
        while not run.done:
            for out in llm.engine.step():
                run.finish(out, name)
        records |= run.records
    assert set(records) == {"ok", "bad", "other", "named"}
    assert records["bad"].error.code == "chat_template_error"
    assert "system messages are not supported" in records["bad"].error.message
    assert records["other"].error.code == "model_not_found" and name in records["other"].error.message
    assert records["ok"].response is not None and records["named"].response.body["model"] == name


def test_submit_refuses_a_model_that_is_not_served(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_SERVED_MODELS", "sluice-tiny, sluice-tiny-draft")
    client = Client(redis_url)
    batch = client.submit_batch([line("a", prompt="x", model="sluice-tiny"),
                                 line("b", prompt="x", model="gpt-4o")],
                                output=tmp_path.as_uri())  # fmt: skip
    assert batch.status == BatchStatus.in_progress and not batch.errors
    job = Job.fetch(shard_job_id(batch.id, 0), connection=client.connection, serializer=JSONSerializer)
    stored = shard_requests(open_storage(tmp_path.as_uri()), job.args[2])
    (carried,) = [r.model_dump() for r in stored if r.record is not None]
    error = carried["record"]["response"]["body"]["error"]
    assert carried["custom_id"] == "b" and carried["record"]["response"]["status_code"] == 400
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "sluice-tiny" in error["message"]


MEMORY_PROBE = """
import json, resource, sys
from pathlib import Path
from sluice.contract.settings import Settings
from sluice.producer.validation import input_lines, validate_lines
path = Path(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
checked = validate_lines(input_lines(str(path), Settings()), Settings())
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"requests": len(checked.requests), "grown_mib": (after - before) / 1024}))
"""


def test_validating_a_large_input_costs_about_its_size_in_memory(tmp_path):
    path = tmp_path / "in.jsonl"
    with path.open("wb") as f:
        for i in range(50_000):
            f.write(line(f"r{i}", prompt="word " * 40, max_tokens=16) + b"\n")
    size_mib = path.stat().st_size / 2**20
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], cwd=ROOT, capture_output=True,
                         text=True, check=True)  # fmt: skip
    probe = json.loads(out.stdout)
    assert probe["requests"] == 50_000
    assert probe["grown_mib"] < 2.5 * size_mib, (probe, size_mib)
