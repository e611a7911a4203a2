"""Cancelling a batch's unclaimed shards against a worker claiming one at the same moment (real
redis-server)."""

from __future__ import annotations

from datetime import datetime

from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from sluice.contract.jobs import finalize_job_id, shard_job_id
from sluice.contract.queues import drop_unclaimed, fetch, queue_for, take_unclaimed
from sluice.producer import Client


def line(i: int) -> dict:
    body = {"prompt": f"hello {i}", "max_tokens": 4}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def test_a_shard_a_worker_has_dequeued_is_not_cancelled_even_while_its_status_still_reads_queued(
    redis_url, tmp_path):
    """A worker's claim moves the job id out of the queue before it marks the job started; a cancel in between
    must leave that shard to the worker (and the finalize job waiting for it), dropping only the others."""
    client = Client(redis_url)
    batch = client.submit_batch([line(i) for i in range(3)], output=tmp_path.as_uri(), shard_size=1)
    shard_ids = [shard_job_id(batch.id, n) for n in range(3)]
    stale = fetch(client.connection, shard_ids)
    claimed, _ = Queue.dequeue_any([queue_for(client.connection, "default")], None,
                                   connection=client.connection, serializer=JSONSerializer)  # fmt: skip
    assert claimed.id == shard_ids[0] and claimed.get_status() == JobStatus.QUEUED, "claimed, not yet started"
    assert not take_unclaimed(client.connection, stale[0]), "the stale status must not decide"
    assert drop_unclaimed(client.connection, batch.id, 3) == 2
    statuses = [job.get_status() for job in fetch(client.connection, shard_ids)]
    assert statuses == [JobStatus.QUEUED, JobStatus.CANCELED, JobStatus.CANCELED]
    [finalize] = fetch(client.connection, [finalize_job_id(batch.id)])
    waits_on = {m.decode() for m in client.connection.smembers(finalize.dependencies_key)}
    assert waits_on == {shard_ids[0]}, "the finalize job still waits for the claimed shard"


def test_a_retry_waiting_out_its_backoff_is_taken_once(redis_url, tmp_path):
    """A scheduled shard is taken from the scheduled registry; a second take (or a worker's) finds it gone."""
    client = Client(redis_url)
    batch = client.submit_batch([line(0)], output=tmp_path.as_uri(), shard_size=1)
    queue = queue_for(client.connection, "default")
    [job] = fetch(client.connection, [shard_job_id(batch.id, 0)])
    queue.remove(job)
    queue.schedule_job(job, datetime(2100, 1, 1))
    [scheduled] = fetch(client.connection, [job.id])
    assert scheduled.get_status() == JobStatus.SCHEDULED
    assert take_unclaimed(client.connection, scheduled)
    assert not take_unclaimed(client.connection, scheduled)
