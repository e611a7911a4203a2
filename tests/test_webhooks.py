"""Webhooks against real components: redis-server, an HTTP receiver on loopback, delivery processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from redis import Redis
from standardwebhooks import Webhook

from sluice.contract.events import delivery_log, notify
from sluice.contract.schemas import Batch, BatchStatus, RequestCounts
from sluice.contract.signing import (
    UnsafeWebhookURL,
    WebhookSettings,
    WebhookVerificationError,
    check_url,
    generate_secret,
    parse_schedule,
    sign_headers,
    verify,
)
from sluice.producer.client import Client
from sluice.worker.webhooks import run

ROOT = Path(__file__).resolve().parents[1]
SECRET = generate_secret()


@pytest.fixture
def redis(redis_url):
    """A client of the test's (emptied) Redis."""
    return Redis.from_url(redis_url)


class Receiver:
    """A loopback HTTP endpoint that answers with scripted statuses and records every request."""

    def __init__(self, replies: list):
        self.replies, self.requests = list(replies), []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                reply = receiver.replies.pop(0) if receiver.replies else 200
                receiver.requests.append({"headers": dict(self.headers), "body": body, "reply": reply})
                if reply == "hang":
                    time.sleep(3.0)
                    reply = 200
                self.send_response(reply)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def receiver():
    made = []

    def make(*replies):
        made.append(Receiver(list(replies)))
        return made[-1]

    yield make
    for r in made:
        r.close()


def settings(**overrides) -> WebhookSettings:
    values = dict(
        webhook_secret=SECRET,
        webhook_allow="127.0.0.0/8",
        webhook_retry_schedule="0.2s,0.2s,0.2s",
        webhook_timeout=5.0,
    )
    return WebhookSettings(**{**values, **overrides})


def batch(url: str, status: str = "completed", batch_id: str = "batch_1") -> Batch:
    return Batch(
        id=batch_id,
        status=BatchStatus(status),
        request_counts=RequestCounts(total=3, completed=3, failed=0),
        output_file="s3://out/batch_1/output.jsonl",
        metadata={"k": "v"},
        webhook=url,
    )


def delivery_env(redis_url: str, schedule: str) -> dict:
    return {
        **os.environ,
        "SLUICE_REDIS_URL": redis_url,
        "SLUICE_WEBHOOK_SECRET": SECRET,
        "SLUICE_WEBHOOK_ALLOW": "127.0.0.0/8",
        "SLUICE_WEBHOOK_RETRY_SCHEDULE": schedule,
        "SLUICE_WEBHOOK_TIMEOUT": "1.5",
    }


def start_delivery(redis_url: str, schedule: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sluice.worker.webhooks", "run", "--poll", "0.05", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=delivery_env(redis_url, schedule), stderr=subprocess.PIPE)


def wait_for(predicate, timeout: float = 15.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_signature_verified_by_us_and_by_standardwebhooks(redis, receiver):
    r = receiver(200)
    result = {"custom_id": "request", "response": {"status_code": 200}}
    event_id = notify(redis, batch(r.url), result=result, settings=settings())
    run(redis, settings(), burst=True)
    [request] = r.requests
    headers, body = request["headers"], request["body"]
    assert headers["webhook-id"] == event_id
    payload = verify(SECRET, headers, body)
    assert payload == Webhook(SECRET).verify(body, headers)
    assert payload["type"] == "batch.completed" and payload["id"] == event_id
    assert payload["data"]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert payload["data"]["output_file"] == "s3://out/batch_1/output.jsonl"
    assert payload["data"]["result"] == result and "webhook" not in payload["data"]
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, body + b" ")
    with pytest.raises(WebhookVerificationError):
        verify(generate_secret(), headers, body)
    stale = sign_headers(SECRET, event_id, body, timestamp=int(time.time()) - 301)
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, stale, body)


def test_fails_twice_then_succeeds_with_one_webhook_id(redis, receiver, redis_url):
    r = receiver("hang", 503, 200)
    event_id = notify(redis, batch(r.url, status="failed"), settings=settings())
    proc = start_delivery(redis_url, "0.2s,0.2s,0.2s", "--burst")
    assert proc.wait(30) == 0, proc.stderr.read().decode()
    assert [q["reply"] for q in r.requests] == ["hang", 503, 200]
    assert {q["headers"]["webhook-id"] for q in r.requests} == {event_id}
    assert len({q["body"] for q in r.requests}) == 1
    for q in r.requests:
        Webhook(SECRET).verify(q["body"], q["headers"])
    entries = delivery_log(redis, "batch_1")
    assert [e["attempt"] for e in entries] == [1, 2, 3]
    assert [e["status_code"] for e in entries] == [None, 503, 200]
    assert "Timeout" in entries[0]["error"] and entries[-1]["outcome"] == "delivered"
    assert SECRET not in proc.stderr.read().decode()


def test_gone_stops_retrying(redis, receiver):
    r = receiver(410, 200)
    notify(redis, batch(r.url, status="cancelled"), settings=settings())
    run(redis, settings(), burst=True)
    assert [q["reply"] for q in r.requests] == [410]
    assert [(e["status_code"], e["outcome"]) for e in delivery_log(redis, "batch_1")] == [(410, "gone")]


def test_retries_end_after_the_schedule(redis, receiver):
    r = receiver(500, 500, 500, 500, 500)
    notify(redis, batch(r.url, status="expired"), settings=settings(webhook_retry_schedule="0.1s,0.1s"))
    run(redis, settings(webhook_retry_schedule="0.1s,0.1s"), burst=True)
    assert len(r.requests) == 3
    assert delivery_log(redis, "batch_1")[-1]["outcome"] == "exhausted"


def test_notify_once_per_event_and_only_final_statuses(redis, receiver):
    r = receiver(200, 200)
    first = notify(redis, batch(r.url), settings=settings())
    assert notify(redis, batch(r.url), settings=settings()) == first
    assert notify(redis, batch(r.url, status="in_progress"), settings=settings()) is None
    run(redis, settings(), burst=True)
    assert len(r.requests) == 1


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://localhost/hook",
        "http://10.1.2.3/",
        "http://192.168.0.1/",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://metadata.google.internal/",
        "http://100.100.100.200/",
        "ftp://example.com/x",
        "file:///etc/passwd",
    ],
)
def test_internal_or_non_http_urls_are_refused(url):
    with pytest.raises(UnsafeWebhookURL):
        check_url(url, allow="")


def test_allow_list_admits_hosts_and_networks():
    assert check_url("http://127.0.0.1:8080/hook", allow="10.0.0.0/8, 127.0.0.0/8")
    assert check_url("http://localhost:8080/hook", allow="localhost")
    assert check_url("https://93.184.215.14/hook", allow="")
    with pytest.raises(UnsafeWebhookURL):
        check_url("http://10.1.2.3/", allow="127.0.0.0/8")


def test_private_target_refused_at_notify_unless_allowed(redis, receiver):
    r = receiver(200)
    assert notify(redis, batch(r.url), settings=settings(webhook_allow="")) is None
    run(redis, settings(), burst=True)
    assert r.requests == []
    [entry] = delivery_log(redis, "batch_1")
    assert entry["attempt"] == 0 and "SLUICE_WEBHOOK_ALLOW" in entry["error"]


def test_retries_survive_a_restart_of_the_delivery_process(redis, receiver, redis_url):
    r = receiver(500, 200)
    event_id = notify(redis, batch(r.url), settings=settings())
    first = start_delivery(redis_url, "1.5s")
    wait_for(lambda: len(delivery_log(redis, "batch_1")) == 1)
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    time.sleep(0.2)
    assert len(r.requests) == 1
    second = start_delivery(redis_url, "1.5s", "--burst")
    assert second.wait(30) == 0
    assert [q["reply"] for q in r.requests] == [500, 200]
    assert {q["headers"]["webhook-id"] for q in r.requests} == {event_id}
    assert [e["outcome"] for e in delivery_log(redis, "batch_1")] == ["retry", "delivered"]


def test_schedule_parsing():
    assert parse_schedule(WebhookSettings().webhook_retry_schedule)[:5] == [5, 30, 120, 600, 3600]
    assert 20 * 3600 < sum(parse_schedule(WebhookSettings().webhook_retry_schedule)) < 26 * 3600
    assert json.loads(json.dumps(parse_schedule("500ms, 2s"))) == [0.5, 2]


def test_submit_refuses_a_private_webhook_unless_allowed(redis_url, monkeypatch, tmp_path):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}]
    client = Client(redis_url)
    monkeypatch.delenv("SLUICE_WEBHOOK_ALLOW", raising=False)
    with pytest.raises(UnsafeWebhookURL):
        client.submit_batch(lines, output=tmp_path.as_uri(), webhook="http://127.0.0.1:9/hook")
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW", "127.0.0.1/32")  # read once, when a client is made
    with pytest.raises(UnsafeWebhookURL):
        client.submit_batch(lines, output=tmp_path.as_uri(), webhook="http://127.0.0.1:9/hook")
    client = Client(redis_url)
    batch = client.submit_batch(lines, output=tmp_path.as_uri(), webhook="http://127.0.0.1:9/hook")
    assert client.get(batch.id).webhook == "http://127.0.0.1:9/hook"


def test_batch_failing_validation_sends_batch_failed(redis, redis_url, receiver, monkeypatch, tmp_path):
    hook = receiver()
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW", "127.0.0.0/8")
    bad = [{"custom_id": "a", "method": "POST", "url": "/v1/nope", "body": {"prompt": "hi"}}]
    failed = Client(redis_url).submit_batch(bad, output=tmp_path.as_uri(), webhook=hook.url)
    assert failed.status == BatchStatus.failed
    run(redis, settings(), burst=True)
    assert len(hook.requests) == 1
    event = json.loads(hook.requests[0]["body"])
    assert event["type"] == "batch.failed" and event["data"]["id"] == failed.id
    assert event["data"]["errors"][0]["line"] == 1
