"""Real faults against real processes: SIGKILL/SIGTERM loops, Redis and S3 outages, a full disk, lost
dequeues.

Every test ends with each custom_id exactly once in the output or error file and every batch terminal.
The counts of these runs are in docs/reliability.md.
"""

from __future__ import annotations

import random
import resource
import signal
import time

import pytest

from sluice.producer import BatchStatus, Client
from tests.faults.conftest import assert_exactly_once, request, spawn, wait_until
from tests.services import stop_worker

pytestmark = pytest.mark.slow


def ids_of(n: int, offset: int = 0) -> list[str]:
    return [f"r{i}" for i in range(offset, offset + n)]


def test_sigkill_and_sigterm_loop(tiny_llama, redis_url, tmp_path):
    """24 kills (every 4th a SIGTERM) at random points of two workers' loops, over three batches."""
    client = Client(redis_url)
    batches = [
        (client.submit_batch([request(i, 24) for i in range(b * 20, b * 20 + 20)], output=tmp_path.as_uri(),
                             shard_size=3), ids_of(20, b * 20))
        for b in range(3)
    ]
    rng = random.Random(13)
    log = tmp_path / "workers.log"
    workers = [spawn(tiny_llama, redis_url, log) for _ in range(2)]
    kills = 0
    try:
        while kills < 24:
            victim = kills % 2
            time.sleep(rng.uniform(1.0, 5.0))
            if kills % 4 == 3:
                workers[victim].send_signal(signal.SIGTERM)
                workers[victim].wait(60)
            else:
                workers[victim].kill()
                workers[victim].wait()
            kills += 1
            workers[victim] = spawn(tiny_llama, redis_url, log)
        wait_until(lambda: all(client.get(b.id).done for b, _ in batches), 300, "every batch to end")
    finally:
        for w in workers:
            stop_worker(w)
    for batch, ids in batches:
        done = client.get(batch.id)
        assert done.status == BatchStatus.completed, done
        assert assert_exactly_once(client, done, ids) == (20, 0)


def test_redis_killed_and_restarted_with_aof(tiny_llama, aof_redis, tmp_path):
    client = Client(aof_redis.url)
    batch = client.submit_batch([request(i, 32) for i in range(24)], output=tmp_path.as_uri(), shard_size=3)
    log = tmp_path / "worker.log"
    worker = spawn(tiny_llama, aof_redis.url, log)
    try:
        wait_until(lambda: client.get(batch.id).request_counts.completed >= 3, 180, "a first shard")
        for _ in range(2):
            aof_redis.kill()
            time.sleep(4)
            aof_redis.start()
            time.sleep(2)
        client = Client(aof_redis.url)
        wait_until(lambda: client.get(batch.id).done, 240, "the batch")
        assert worker.poll() is None, "the worker survived both outages"
    finally:
        stop_worker(worker)
    text = log.read_text()
    assert "Redis unavailable" in text or "could not connect to Redis" in text
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, ids_of(24)) == (24, 0)


def test_s3_stopped_during_shard_writes_and_finalize(tiny_llama, redis_url, moto, tmp_path):
    import boto3

    boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="faults")
    client = Client(redis_url)
    batch = client.submit_batch([request(i, 16) for i in range(18)], output="s3://faults/out", shard_size=3)
    worker = spawn(tiny_llama, redis_url, tmp_path / "worker.log")
    try:
        wait_until(lambda: client.get(batch.id).request_counts.completed >= 9, 180, "half the shards")
        moto.stop()
        time.sleep(5)
        moto.start()
        wait_until(lambda: client.get(batch.id).done, 240, "the batch")
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, ids_of(18)) == (18, 0)


def limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def test_full_disk_while_running_then_freed(tiny_llama, redis_url, tmp_path):
    """The kernel refuses every write past 0 bytes (EFBIG, as on a full disk) until the test lifts the
    limit."""
    import subprocess
    import sys

    from tests.faults.conftest import FAST
    from tests.services import worker_env

    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(9)], output=(tmp_path / "out").as_uri(),
                                shard_size=3)
    cmd = [sys.executable, "-m", "sluice.worker", "--model", str(tiny_llama), "--dtype", "float32",
           "--device", "cpu"]
    worker = subprocess.Popen(cmd, env=worker_env(redis_url, **FAST), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, preexec_fn=limit_file_size(0))
    try:
        # (request_counts move as requests finish, before their shard is saved: only the retry tells a failed
        # save)
        wait_until(lambda: _failed_once(client, batch.id), 180, "a shard save to fail")
        resource.prlimit(worker.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_until(lambda: client.get(batch.id).done, 180, "the batch")
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed, done.errors
    assert assert_exactly_once(client, done, ids_of(9)) == (9, 0)


def _failed_once(client: Client, batch_id: str) -> bool:
    from rq.job import Job
    from rq.serializers import JSONSerializer

    job = Job.fetch(f"{batch_id}-shard-0", connection=client.connection, serializer=JSONSerializer)
    return job.retries_left is not None and job.retries_left < client.settings.shard_retries


def test_full_disk_for_good_fails_the_batch(tiny_llama, redis_url, tmp_path, monkeypatch):
    import subprocess
    import sys

    from tests.faults.conftest import FAST
    from tests.services import worker_env

    monkeypatch.setenv("SLUICE_SHARD_RETRIES", "1")
    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(4)], output=(tmp_path / "out").as_uri(),
                                shard_size=2)
    env = worker_env(redis_url, **{**FAST, "SLUICE_SHARD_RETRIES": "1", "SLUICE_FINALIZE_RETRIES": "1"})
    cmd = [sys.executable, "-m", "sluice.worker", "--model", str(tiny_llama), "--dtype", "float32",
           "--device", "cpu"]
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=limit_file_size(0))
    try:
        wait_until(lambda: client.get(batch.id).done, 180, "the batch to end")
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.failed
    assert done.errors[-1].code == "finalize_failed"


def test_shard_lost_by_a_worker_killed_right_after_dequeue(tiny_llama, redis_url, tmp_path):
    """A multi-queue dequeue is an LPOP: a worker SIGKILLed right after it leaves the shard in no queue and no
    registry. That state is made here by the same LPOP; the reaper must bring the shard back."""
    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(6)], output=tmp_path.as_uri(), shard_size=3)
    popped = client.connection.lpop("rq:queue:default")
    assert popped.decode() == f"{batch.id}-shard-0"
    worker = spawn(tiny_llama, redis_url, tmp_path / "worker.log")
    try:
        wait_until(lambda: client.get(batch.id).done, 180, "the batch")
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, ids_of(6)) == (6, 0)
