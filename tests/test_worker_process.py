"""Worker processes: cancel mid-batch keeps partial results; SIGTERM hands in-flight shards back to rq."""

from __future__ import annotations

import time

import pytest
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from sluice.producer import BatchStatus, Client
from tests.services import start_worker, stop_worker


def long_request(i: int, max_tokens: int = 48) -> dict:
    body = {"prompt": f"hello world {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def test_cancel_mid_batch_keeps_partial_results(tiny_llama, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch([long_request(i) for i in range(40)], output=tmp_path.as_uri(), shard_size=4)
    worker = start_worker(tiny_llama, redis_url, tmp_path / "worker.log", "--max-num-seqs", "4")
    try:
        wait_until(lambda: client.get(batch.id).request_counts.completed >= 4, 120, "a finished shard")
        client.cancel(batch.id)
        done = client.wait(batch.id, timeout=60, progress=False)
    finally:
        stop_worker(worker)
    assert done.status == BatchStatus.cancelled
    counts = done.request_counts
    assert counts.completed >= 4 and counts.failed > 0 and counts.completed + counts.failed == 40
    ok = [r.custom_id for r in client.results(batch.id)]
    failed = list(client.results(batch.id, errors=True))
    assert {f.error.code for f in failed} == {"batch_cancelled"}
    assert sorted(ok + [f.custom_id for f in failed]) == sorted(f"r{i}" for i in range(40))
    assert len(CanceledJobRegistry("default", connection=client.connection)) > 0, "queued shards were dropped"


def test_sigterm_hands_in_flight_shards_back(tiny_llama, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(
        [long_request(i, 900) for i in range(16)], output=tmp_path.as_uri(), shard_size=8
    )  # a shard of 8 sequential 900-token requests outlasts the grace period even on a fast, quiet machine
    worker = start_worker(
        tiny_llama, redis_url, tmp_path / "worker.log", "--grace", "0.5", "--max-num-seqs", "1"
    )
    started = StartedJobRegistry("default", connection=client.connection)
    try:
        wait_until(lambda: len(started) == 1, 180, "a claimed shard")
        claimed = started.get_job_ids()[0]
    finally:
        code = stop_worker(worker, timeout=20)
    assert code == 0
    job = Job.fetch(claimed, connection=client.connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED
    assert len(started) == 0 and Worker.all(connection=client.connection) == []
    assert client.get(batch.id).status == BatchStatus.in_progress


def test_sigterm_stops_an_idle_worker_at_once(tiny_llama, redis_url, tmp_path):
    """After its work an idle worker leaves within 2 s of SIGTERM, not after rq's 60 s command-channel
    read."""
    client = Client(redis_url)
    batch = client.submit_batch([long_request(i, 8) for i in range(4)], output=tmp_path.as_uri(),
                                shard_size=2)
    log = tmp_path / "worker.log"
    worker = start_worker(tiny_llama, redis_url, log, "--max-num-seqs", "4")
    try:
        assert client.wait(batch.id, timeout=120, progress=False).status == BatchStatus.completed
        time.sleep(1.5)  # idle in its dequeue wait
        started = time.monotonic()
        worker.terminate()
        code = worker.wait(15)
        took = time.monotonic() - started
    finally:
        stop_worker(worker)
    assert code == 0 and took < 2, took
    text = log.read_text()
    assert "stop requested" in text and "dropped unreadable job" not in text
    assert Worker.all(connection=client.connection) == []
