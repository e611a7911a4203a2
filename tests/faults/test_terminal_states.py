"""Every failure the fault suite knows ends the batch in a terminal status within a bounded time, with
`errors` saying why. No worker here: each failure is made in a real Redis as a dead process or a broken store
leaves it, and only the reaper (interval 0.2 s) drives the batch on. Failures needing live processes (SIGKILL,
Redis and S3 outages, a full disk, output roots) have their own tests in this folder and
test_server_output_roots.py."""

from __future__ import annotations

import time

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore, new_batch_id
from sluice.contract.jobs import finalize_job_id, shard_job_id
from sluice.contract.schemas import Batch, BatchStatus
from sluice.contract.settings import Settings
from sluice.producer import Client
from sluice.worker.reaper import Reaper
from tests.faults.conftest import request

BOUND_S = 20


def reap(client: Client, batch_id: str, **settings) -> tuple[Batch, float]:
    """Reaper passes until the batch is done; the batch and how long it took."""
    reaper = Reaper(client.connection, Settings(reaper_interval=0.2, **settings))
    start = time.monotonic()
    while not (batch := client.get(batch_id)).done:
        assert time.monotonic() - start < BOUND_S, f"{batch_id} still {batch.status.value} after {BOUND_S} s"
        reaper.run_once()
        time.sleep(0.25)
    return batch, time.monotonic() - start


def shards_died(client: Client, batch: Batch, status: JobStatus = JobStatus.FAILED) -> None:
    """Each shard job ended with status (as rq leaves it when retries run out) and the finalize job is
    gone."""
    for n in range(batch.num_shards):
        job = Job.fetch(shard_job_id(batch.id, n), connection=client.connection, serializer=JSONSerializer)
        Queue(job.origin, connection=client.connection, serializer=JSONSerializer).remove(job)
        job.set_status(status)
    Job.fetch(finalize_job_id(batch.id), connection=client.connection, serializer=JSONSerializer).delete()


def submit(client: Client, output: str, **kwargs) -> Batch:
    return client.submit_batch([request(i) for i in range(4)], output=output, shard_size=2, **kwargs)


def stuck_validating(client: Client, tmp_path) -> Batch:
    batch = Batch(id=new_batch_id(), status=BatchStatus.validating, created_at=time.time() - 10,
                  output_url=tmp_path.as_uri())  # fmt: skip
    BatchStore(client.connection).create(batch)
    return batch


def past_its_window(client: Client, tmp_path) -> Batch:
    batch = submit(client, tmp_path.as_uri(), completion_window="1s")
    time.sleep(1.2)
    return batch


def shards_failed_for_good(client: Client, tmp_path) -> Batch:
    batch = submit(client, tmp_path.as_uri())
    shards_died(client, batch)
    return batch


def shard_never_enqueued(client: Client, tmp_path) -> Batch:
    batch = submit(client, tmp_path.as_uri())
    for job_id in (shard_job_id(batch.id, 1), finalize_job_id(batch.id)):
        Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer).delete()
    Job.fetch(shard_job_id(batch.id, 0), connection=client.connection, serializer=JSONSerializer).set_status(
        JobStatus.CANCELED
    )
    return batch


def output_unwritable(client: Client, tmp_path) -> Batch:
    batch = submit(client, (tmp_path / "out").as_uri())
    (tmp_path / "out" / batch.id / "output.jsonl").mkdir()  # finalize cannot publish its file, on every try
    shards_died(client, batch, JobStatus.CANCELED)
    return batch


def output_outside_roots(client: Client, tmp_path, monkeypatch) -> Batch:
    batch = submit(client, (tmp_path / "was-allowed").as_uri())
    shards_died(client, batch, JobStatus.CANCELED)
    monkeypatch.setenv("SLUICE_OUTPUT_ROOTS", (tmp_path / "elsewhere").as_uri())  # the fleet's roots changed
    return batch


CASES = {
    "producer killed while validating": (stuck_validating, BatchStatus.failed, "validation_interrupted"),
    "completion window passed with no worker": (past_its_window, BatchStatus.expired, "batch_expired"),
    "every shard failed on every retry": (shards_failed_for_good, BatchStatus.failed, "shard_failed"),
    "submit died between pipelines": (shard_never_enqueued, BatchStatus.failed, "shards_lost"),
    "finalize fails for good": (output_unwritable, BatchStatus.failed, "finalize_failed"),
    "output outside the fleet's roots": (output_outside_roots, BatchStatus.failed, "output_not_allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_failure_ends_terminal_with_a_reason(case, redis_url, tmp_path, monkeypatch):
    make, status, code = CASES[case]
    client = Client(redis_url)
    args = (client, tmp_path, monkeypatch) if make is output_outside_roots else (client, tmp_path)
    batch = make(*args)
    done, seconds = reap(client, batch.id, validating_timeout=1)
    assert done.status == status, (case, done.status, done.errors)
    assert code in [e.code for e in done.errors] and all(e.message for e in done.errors), done.errors
    assert done.request_counts.completed + done.request_counts.failed == done.request_counts.total
    assert seconds < BOUND_S
