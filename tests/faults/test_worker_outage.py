"""A Redis outage costs one warning line in the worker's log when it starts and one when it ends, not one
per attempt (real redis-server stopped for 20 s and restarted; real worker on a tiny model); a shard whose
start it cut short is kept and resumed."""

from __future__ import annotations

import time

from rq.job import Job
from rq.serializers import JSONSerializer

from sluice.contract.jobs import shard_job_id
from sluice.producer import BatchStatus, Client
from tests.faults.conftest import assert_exactly_once, request, spawn, wait_until
from tests.services import stop_worker


def test_one_log_line_per_redis_outage(tiny_llama, aof_redis, tmp_path):
    log = tmp_path / "worker.log"
    client = Client(aof_redis.url)
    first = client.submit_batch([request(i, 4) for i in range(3)], output=tmp_path.as_uri(), shard_size=3)
    worker = spawn(tiny_llama, aof_redis.url, log)
    try:
        wait_until(lambda: client.get(first.id).done, 600, "a first batch (the worker is up)")
        before = len(log.read_text().splitlines())
        aof_redis.kill()
        time.sleep(20)
        aof_redis.start()
        client = Client(aof_redis.url)
        second = client.submit_batch([request(i, 4) for i in range(3, 6)], output=tmp_path.as_uri(),
                                     shard_size=3)
        wait_until(lambda: client.get(second.id).done, 120, "a batch after the outage")
        assert client.get(second.id).status == BatchStatus.completed
        assert worker.poll() is None, "the worker rode the outage out"
    finally:
        stop_worker(worker)
    during = log.read_text().splitlines()[before:]
    noisy = [line for line in during if "ERROR" in line or "Traceback" in line]
    assert noisy == [], "\n".join(noisy[:20])
    down = [line for line in during if "Redis unavailable" in line or "could not connect to Redis" in line]
    back = [line for line in during if "Redis is back" in line]
    assert len(down) == 1 and len(back) == 1, "\n".join(during[:40])


def test_a_shard_whose_start_an_outage_cut_short_resumes_without_a_retry(tiny_llama, aof_redis, tmp_path):
    """Redis goes down once the worker has claimed and leased a shard, before it reads the shard's slice
    (`slow_load`), and comes back within the heartbeat TTL: the worker keeps the shard, resumes it and saves
    it; no retry is used and nothing is discarded."""
    log = tmp_path / "worker.log"
    client = Client(aof_redis.url)
    batch = client.submit_batch([request(i, 4) for i in range(3)], output=tmp_path.as_uri(), shard_size=3)
    job_id = shard_job_id(batch.id, 0)
    worker = spawn(tiny_llama, aof_redis.url, log, SLUICE_FAULTS="slow_load=2", SLUICE_HEARTBEAT_TTL="15")

    def claimed() -> bool:
        job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
        return job.get_status() == "started"

    try:
        wait_until(claimed, 600, "the worker to claim the shard", poll=0.02)
        aof_redis.kill()  # the worker is in its slow load: its read of the batch record meets the outage
        time.sleep(4)
        aof_redis.start()
        client = Client(aof_redis.url)
        wait_until(lambda: client.get(batch.id).done, 120, "the batch after the outage")
        assert worker.poll() is None, "the worker rode the outage out"
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, [f"r{i}" for i in range(3)]) == (3, 0)
    job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
    assert job.retries_left == client.settings.shard_retries, "the shard was resumed, not retried"
    text = log.read_text()
    assert f"resuming {job_id}, whose start a Redis outage cut short" in text, text[-3000:]
    assert "discarded" not in text
