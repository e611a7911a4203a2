"""`sluice serve` driven by the official openai SDK: files → batch → results, cancel, pagination, errors."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time

import openai
import pytest
import requests
from standardwebhooks import Webhook

from tests.server_stack import SLUICE, WEBHOOK_SECRET, completion, jsonl, wait_status


def test_file_to_batch_to_results(stack):
    client = stack.openai(stack.key("alpha"))
    lines = [completion(i) for i in range(6)]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0 and uploaded.filename == "input.jsonl"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).text.splitlines()[0] == json.dumps(lines[0])
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h", metadata={"team": "a"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "a"}
    done = wait_status(client, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert done.status == "completed", done
    assert (
        done.request_counts.total == 6
        and done.request_counts.completed == 6
        and done.request_counts.failed == 0
    )
    assert done.completed_at >= done.in_progress_at >= done.created_at and done.error_file_id is None
    records = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"r{i}" for i in range(6)]
    bodies = [r["response"]["body"] for r in records]
    assert all(b["object"] == "text_completion" and b["choices"][0]["text"] for b in bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    assert done.usage.input_tokens == prompt > 0 and done.usage.output_tokens == generated > 0
    assert done.usage.total_tokens == prompt + generated
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.bytes > 0
    listed = [f.id for f in client.files.list()]
    assert uploaded.id in listed and done.output_file_id in listed
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_usage_grows_with_finished_shards_while_in_progress(stack):
    """The Batch object's usage is summed over the shards finished so far, not zero until the batch is
    done."""
    client = stack.openai(stack.key("usage"))
    lines = [completion(i, max_tokens=32, ignore_eos=True) for i in range(64)]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    running = []
    while (seen := client.batches.retrieve(batch.id)).status in ("validating", "in_progress"):
        if seen.status == "in_progress" and seen.usage and seen.usage.output_tokens:
            running.append(seen)
        time.sleep(0.05)
    seen = wait_status(client, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert seen.status == "completed", seen
    assert running, "never saw the batch in progress with finished shards"
    for partial in running:  # request_counts move per request (live), usage per finished shard
        assert partial.usage.output_tokens % 32 == 0 and partial.usage.output_tokens <= 32 * 64
        assert 0 < partial.usage.input_tokens <= seen.usage.input_tokens
        assert partial.usage.total_tokens == partial.usage.input_tokens + partial.usage.output_tokens
    assert seen.usage.output_tokens == 32 * 64


def test_shard_usage_sums_entries_and_reads_older_ones_as_zero_tokens(stack):
    from sluice.contract.batch import BatchStore, shards_key

    store = BatchStore(stack.keys.connection)
    store.record_shard("batch_usage_unit", 0, 4, 0, 40, 32)
    store.record_shard("batch_usage_unit", 1, 3, 1, 30, 24)
    store.record_shard("batch_usage_unit", 1, 4, 0, 41, 33)  # a re-run shard overwrites its entry
    stack.keys.connection.hset(shards_key("batch_usage_unit"), "2", json.dumps([4, 0]))
    assert store.shard_usage("batch_usage_unit") == (81, 65)
    assert store.shard_counts("batch_usage_unit") == (12, 0)


def test_chat_batch_and_models(stack):
    client = stack.openai(stack.key("chat"))
    line = {
        "custom_id": "c0",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Speak, friend."}], "max_tokens": 6},
    }
    uploaded = client.files.create(file=jsonl([line]), purpose="batch")
    with pytest.raises(openai.BadRequestError) as mismatch:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert mismatch.value.code == "invalid_url"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.endpoint == "/v1/chat/completions"
    record = json.loads(client.files.content(done.output_file_id).text)
    assert record["response"]["body"]["object"] == "chat.completion"
    assert "sluice-tiny" in [m.id for m in client.models.list()]


def test_cancel(stack):
    client = stack.openai(stack.key("cancel"))
    lines = [completion(i, max_tokens=200, ignore_eos=True) for i in range(60)]
    batch = client.batches.create(
        input_file_id=client.files.create(file=jsonl(lines), purpose="batch").id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_status(client, batch.id, {"cancelled"}, timeout=120)
    assert done.cancelled_at >= done.cancelling_at
    counts = done.request_counts
    assert counts.failed > 0 and counts.completed + counts.failed == 60
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)


def test_list_pagination(stack):
    client = stack.openai(stack.key("pages"))
    bad = client.files.create(
        file=jsonl([{"custom_id": "x", "method": "POST", "url": "/v1/completions"}]),  # no body: not a line
        purpose="batch",
    )
    made = [
        client.batches.create(input_file_id=bad.id, endpoint="/v1/completions", completion_window="24h")
        for _ in range(5)
    ]
    assert all(b.status == "failed" and b.errors.data[0].code == "invalid_request" for b in made)
    assert made[0].errors.data[0].line == 1 and made[0].failed_at is not None
    newest_first = [b.id for b in reversed(made)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == newest_first[:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == newest_first[2:4] and second.has_more
    assert [b.id for b in client.batches.list(limit=2)] == newest_first
    raw = requests.get(
        stack.url + "/v1/batches",
        params={"limit": 3, "after": newest_first[2]},
        headers={"Authorization": f"Bearer {client.api_key}"},
    ).json()
    assert (
        raw["first_id"] == newest_first[3] and raw["last_id"] == newest_first[4] and raw["has_more"] is False
    )


def test_keys_and_projects(stack):
    alpha, beta = stack.openai(stack.key("p-alpha")), stack.openai(stack.key("p-beta"))
    uploaded = alpha.files.create(file=jsonl([completion(0)]), purpose="batch")
    batch = alpha.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        beta.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.id not in [b.id for b in beta.batches.list()]
    with pytest.raises(openai.AuthenticationError) as wrong:
        stack.openai("sk-sluice-not-a-key").batches.list()
    assert wrong.value.code == "invalid_api_key"
    missing = requests.get(stack.url + "/v1/batches")
    assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_keys_cli_create_list_revoke(stack):
    env_args = ["--redis-url", stack.redis_url]
    made = subprocess.run(
        [SLUICE, "keys", "create", "cli-proj", "--name", "ci", "--json", *env_args],
        capture_output=True,
        text=True,
        check=True,
    )
    key = json.loads(made.stdout)
    client = stack.openai(key["secret"])
    assert client.batches.list().data == []
    listed = subprocess.run(
        [SLUICE, "keys", "list", "--json", *env_args], capture_output=True, text=True, check=True
    )
    entry = next(k for k in json.loads(listed.stdout) if k["id"] == key["id"])
    assert entry["project"] == "cli-proj" and key["secret"] not in listed.stdout
    assert key["secret"].encode() not in b"".join(v for v in stack.keys.connection.hvals("sluice:apikeys"))
    subprocess.run([SLUICE, "keys", "revoke", key["id"], *env_args], check=True, capture_output=True)
    with pytest.raises(openai.AuthenticationError):
        client.batches.list()


def test_bad_files_are_refused(stack):
    client = stack.openai(stack.key("bad"))
    with pytest.raises(openai.BadRequestError) as not_json:
        client.files.create(file=("x.jsonl", b'{"custom_id": "a"}\nnot json\n'), purpose="batch")
    assert "line 2" in not_json.value.message and not_json.value.param == "file"
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=jsonl([completion(0)]), purpose="fine-tune")
    assert purpose.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.files.create(file=jsonl([completion(i) for i in range(201)]), purpose="batch")
    assert too_many.value.code == "too_many_requests"
    big = jsonl([completion(i, user="x" * 9000) for i in range(150)])
    with pytest.raises(openai.BadRequestError) as too_big:
        client.files.create(file=big, purpose="batch")
    assert too_big.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("e.jsonl", b"\n\n"), purpose="batch")
    assert client.files.list().data == []


def test_project_webhook_is_called_when_its_batches_end(stack):
    received: list[tuple[bytes, dict]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append((self.rfile.read(int(self.headers["content-length"])), dict(self.headers)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    env = dict(os.environ, SLUICE_WEBHOOK_ALLOW="127.0.0.1")
    args = ["--redis-url", stack.redis_url]
    subprocess.run(
        [SLUICE, "keys", "webhook", "hooked", url, *args], check=True, capture_output=True, env=env
    )
    refused = subprocess.run(
        [SLUICE, "keys", "webhook", "hooked", "ftp://x/y", *args], capture_output=True, text=True
    )
    assert refused.returncode == 1 and "http" in refused.stderr
    try:
        client = stack.openai(stack.key("hooked"))
        batch = client.batches.create(
            input_file_id=client.files.create(file=jsonl([completion(0)]), purpose="batch").id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        assert wait_status(client, batch.id, {"completed"}).status == "completed"
        deadline = time.monotonic() + 60
        while not any(batch.id.encode() in body for body, _ in received) and time.monotonic() < deadline:
            time.sleep(0.2)
        body, headers = next((b, h) for b, h in received if batch.id.encode() in b)
        event = Webhook(WEBHOOK_SECRET).verify(body, {k.lower(): v for k, v in headers.items()})
        assert "completed" in json.dumps(event)
    finally:
        receiver.shutdown()


def test_logs_are_json_with_ids_and_without_keys(stack):
    """Runs last in the module: everything above went through these logs."""
    lines = {name: (stack.tmp / name).read_text() for name in ("server.log", "worker.log")}
    records = {
        name: [json.loads(x) for x in text.splitlines() if x.startswith("{")] for name, text in lines.items()
    }
    assert any(
        r["message"].startswith("POST /v1/batches 200") and r["project"] for r in records["server.log"]
    )
    assert any(r.get("batch_id") and r.get("shard") is not None for r in records["worker.log"])
    assert any("ready in" in r["message"] for r in records["worker.log"])
    for secret in stack.secrets:
        assert all(secret not in text for text in lines.values())


def typed(raw, model):
    """The raw body of an SDK call validated (strictly, by pydantic) against the SDK's own type."""
    body = json.loads(raw.text)
    return model.model_validate(body)


def typed_list(raw, model, paged: bool = True) -> list:
    body = json.loads(raw.text)
    assert body["object"] == "list", body
    if paged:  # cursor pages (files, batches); the models list has none
        assert isinstance(body["has_more"],
                          bool) and body["first_id"] == (body["data"][0]["id"] if body["data"] else None)
    return [model.model_validate(item) for item in body["data"]]


def test_every_route_through_the_openai_package_answers_its_types(stack):
    """files create/list/retrieve/content/delete, batches create/retrieve/list/cancel, models: each body
    validated against the openai package's pydantic types (the SDK itself only constructs them)."""
    from openai.types import Batch, FileDeleted, FileObject, Model

    raw = stack.openai(stack.key("typed")).with_raw_response
    lines = [completion(i, max_tokens=64, ignore_eos=True) for i in range(12)]
    upload = typed(raw.files.create(file=jsonl(lines), purpose="batch"), FileObject)
    assert upload.purpose == "batch" and upload.status == "processed"
    assert typed(raw.files.retrieve(upload.id), FileObject) == upload
    assert [f.id for f in typed_list(raw.files.list(purpose="batch", limit=5, order="asc"),
                                     FileObject)] == [upload.id]
    assert raw.files.content(upload.id).text.splitlines() == [json.dumps(line) for line in lines]
    batch = typed(raw.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                     completion_window="24h", metadata={"k": "v"}), Batch)  # fmt: skip
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"k": "v"}
    assert typed(raw.batches.retrieve(batch.id), Batch).id == batch.id
    assert [b.id for b in typed_list(raw.batches.list(limit=3), Batch)] == [batch.id]
    cancelled = typed(raw.batches.cancel(batch.id), Batch)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
    done = wait_status(stack.openai(raw._client.api_key), batch.id, {"cancelled"}, timeout=120)
    done = typed(raw.batches.retrieve(done.id), Batch)
    assert (done.request_counts.total == 12
            and done.request_counts.completed + done.request_counts.failed == 12)
    for file_id in filter(None, (done.output_file_id, done.error_file_id)):
        assert typed(raw.files.retrieve(file_id), FileObject).purpose == "batch_output"
    models = typed_list(raw.models.list(), Model, paged=False)
    assert "sluice-tiny" in [m.id for m in models]
    deleted = typed(raw.files.delete(upload.id), FileDeleted)
    assert deleted.deleted and deleted.id == upload.id
    with pytest.raises(openai.NotFoundError) as missing:
        raw.files.retrieve(upload.id)
    assert set(missing.value.body) >= {"message", "type", "code"}


def test_request_counts_move_while_a_shard_runs_and_never_double_count(stack):
    """One shard of four requests of very different lengths: completed moves (1, 2 or 3) before the shard is
    saved; a request recorded again (a retried shard) or moved from failed to completed counts once."""
    from redis import Redis

    from sluice.contract.batch import BatchStore, shards_key

    client = stack.openai(stack.key("progress"))
    lines = [completion(i, max_tokens=n, ignore_eos=True) for i, n in enumerate((2, 60, 130, 240))]
    batch = client.batches.create(input_file_id=client.files.create(file=jsonl(lines), purpose="batch").id,
                                  endpoint="/v1/completions", completion_window="24h")  # fmt: skip
    connection = Redis.from_url(stack.redis_url)
    seen = set()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        counts = client.batches.retrieve(batch.id).request_counts
        if not connection.hlen(shards_key(batch.id)):  # the shard is not saved yet
            seen.add(counts.completed)
        if counts.completed == 4:
            break
        time.sleep(0.1)
    # the worker flushes counts every second and the whole shard may take little more: one value between 0 and
    # 4 seen before the shard was saved shows the counts moving while it ran
    assert {1, 2, 3} & seen, f"completed seen while the shard ran: {sorted(seen)}"
    assert wait_status(client, batch.id, {"completed"}).request_counts.completed == 4
    store = BatchStore(connection)
    store.record_progress("batch_x", ["a", "b"], ["c"])
    store.record_progress("batch_x", ["a", "c"], [])  # the shard ran again; c now succeeded
    assert store.live_counts("batch_x") == (3, 0)
