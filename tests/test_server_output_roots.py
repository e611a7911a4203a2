"""Server and worker started in different folders: one fleet-wide output setting, and a batch whose output a
worker may not write fails at once with a reason, its requests never run (real server, worker and redis)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from redis import Redis
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.jobs import MODELS, shard_job_id
from sluice.producer.server.keys import KeyStore
from tests.server_stack import MODEL, Stack, completion, jsonl, start_server, wait_http
from tests.services import free_port, stop_worker

OUTPUT_ENV = ("SLUICE_OUTPUT_URL", "SLUICE_OUTPUT_ROOTS", "XDG_DATA_HOME")


def bare_env(redis_url: str, **extra: str) -> dict[str, str]:
    """This environment without any output setting, plus Redis and extra."""
    env = {k: v for k, v in os.environ.items() if k not in OUTPUT_ENV}
    env.update(SLUICE_REDIS_URL=redis_url, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", SLUICE_SHARD_SIZE="4")
    return {**env, **extra}


def launch_worker(cwd: Path, env: dict[str, str], metrics_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sluice.worker", "--model", str(MODEL), "--dtype", "float32", "--device",
           "cpu", "--max-num-seqs", "8", "--metrics-port", str(metrics_port)]  # fmt: skip
    with open(cwd / "worker.log", "ab") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


def fleet(redis_server, tmp: Path, server_env: dict, worker_env: dict) -> Iterator[tuple[Stack, int]]:
    """A server in tmp/server and a ready worker in tmp/worker (different working directories)."""
    redis_server.client().flushall()
    (tmp / "server").mkdir()
    (tmp / "worker").mkdir()
    port = free_port()
    worker = launch_worker(tmp / "worker", worker_env, port)
    server, url = start_server(redis_server.url, tmp, cwd=tmp / "server", env=server_env)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 120, worker)
        yield Stack(url, redis_server.url, KeyStore(redis_server.client()), tmp), port
    finally:
        stop_worker(worker)
        stop_worker(server)


@pytest.fixture
def data_home_fleet(redis_server, tmp_path) -> Iterator[tuple[Stack, int]]:
    """Neither process told where outputs go: both default to the same data folder."""
    env = bare_env(redis_server.url, XDG_DATA_HOME=str(tmp_path / "data"))
    yield from fleet(redis_server, tmp_path, env, env)


@pytest.fixture
def split_fleet(redis_server, tmp_path) -> Iterator[tuple[Stack, int]]:
    """A worker whose roots do not hold the server's output location (each its own ./results)."""
    server_env = bare_env(redis_server.url, SLUICE_OUTPUT_URL=(tmp_path / "server" / "results").as_uri())
    worker_env = bare_env(redis_server.url, SLUICE_OUTPUT_ROOTS=(tmp_path / "worker" / "results").as_uri())
    yield from fleet(redis_server, tmp_path, server_env, worker_env)


def submit(stack: Stack, n: int = 8):
    client = stack.openai(stack.key("roots"))
    upload = client.files.create(file=jsonl([completion(i) for i in range(n)]), purpose="batch")
    return client, client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                         completion_window="24h")  # fmt: skip


def engine_requests(metrics_port: int) -> float:
    """Requests the worker's engine finished (any outcome), from its /metrics."""
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    lines = [line.split() for line in text.splitlines() if line.startswith("sluice_requests_total")]
    return sum(float(parts[-1]) for parts in lines)


def settled_statuses(connection: Redis, batch_id: str, wait: float = 10.0) -> list[str]:
    """The two shard jobs' rq statuses once neither is queued or running any more (the batch's failed state is
    written while the refusing shard is still finishing, so its job may still read "started" for a moment)."""
    deadline = time.monotonic() + wait
    while True:
        jobs = Job.fetch_many([shard_job_id(batch_id, n) for n in range(2)], connection=connection,
                              serializer=JSONSerializer)  # fmt: skip
        statuses = sorted(str(j.get_status().value) for j in jobs)
        if not {"queued", "started"} & set(statuses) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


def test_server_and_worker_in_different_folders_agree_by_default(data_home_fleet, tmp_path):
    stack, _ = data_home_fleet
    client, batch = submit(stack, 4)
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.3)
    assert batch.status == "completed" and batch.errors is None and batch.request_counts.completed == 4
    assert (tmp_path / "data" / "sluice" / "results" / batch.id / "output.jsonl").is_file()
    assert not (tmp_path / "server" / "results").exists() and not (tmp_path / "worker" / "results").exists()


def test_an_output_the_worker_may_not_write_fails_the_batch_at_once(split_fleet, tmp_path):
    stack, metrics_port = split_fleet
    assert Redis.from_url(stack.redis_url).hexists(MODELS, MODEL.name), "the worker is ready"
    client, batch = submit(stack, 8)
    start = time.monotonic()
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() - start < 10, f"batch still {batch.status} {batch.request_counts} after 10 s"
        time.sleep(0.2)
    assert batch.status == "failed", batch
    [error] = batch.errors.data
    server_out = (tmp_path / "server" / "results").as_uri()
    worker_root = (tmp_path / "worker" / "results").as_uri()
    assert error.code == "output_not_allowed"
    assert server_out in error.message and worker_root in error.message, error.message
    assert batch.request_counts.failed == batch.request_counts.total == 8
    assert engine_requests(metrics_port) == 0, "the engine ran a request of a batch it could not save"
    connection = Redis.from_url(stack.redis_url)
    statuses = settled_statuses(connection, batch.id)
    assert statuses in (["canceled", "failed"], ["failed", "failed"]), statuses
    time.sleep(3)  # nothing retries it or brings it back
    assert client.batches.retrieve(batch.id).status == "failed"
    assert engine_requests(metrics_port) == 0
    scheduled = ScheduledJobRegistry("default", connection=connection, serializer=JSONSerializer)
    assert scheduled.get_job_ids() == [], "no retry of the refused shard is scheduled"
