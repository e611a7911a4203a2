"""Faults around finalize and the reaper, with real processes: a worker SIGKILLed mid-finalize, a cancel
racing finalize, S3 stopped mid-finalize, and batches the reaper alone must end (expired, stuck validating).

`SLUICE_FAULTS=slow_finalize=S` only widens the window before finalize writes; every fault itself is real.
Each test ends with every custom_id exactly once in the output or error file and every batch terminal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from sluice.contract.batch import TransitionError
from sluice.contract.jobs import finalize_job_id
from sluice.contract.storage import open_storage
from sluice.producer import BatchStatus, Client
from tests.faults.conftest import FAST, assert_exactly_once, request, spawn, wait_until
from tests.services import stop_worker, worker_env

pytestmark = pytest.mark.slow
IDS = [f"r{i}" for i in range(4)]


def start_reaper(redis_url: str, log: Path, **env: str) -> subprocess.Popen:
    """`sluice reaper run` as its own process, one pass a second."""
    cmd = [sys.executable, "-c", "from sluice.cli.main import app; app()", "reaper", "run", "--interval", "1"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, env=worker_env(redis_url, **{**FAST, **env}), stdout=out, stderr=subprocess.STDOUT
        )


def reap_until_done(client: Client, redis_url: str, batch_id: str, log: Path, **env: str):
    """Run a reaper process (and nothing else) until the batch is done; return the batch."""
    reaper = start_reaper(redis_url, log, **env)
    try:
        wait_until(lambda: client.get(batch_id).done, 60, "the reaper to end the batch")
    finally:
        stop_worker(reaper)
    return client.get(batch_id)


def submit(client: Client, output: str, **kwargs) -> object:
    return client.submit_batch([request(i, 4) for i in range(4)], output=output, shard_size=2, **kwargs)


def finalize_status(client: Client, batch_id: str) -> JobStatus:
    return Job.fetch(
        finalize_job_id(batch_id), connection=client.connection, serializer=JSONSerializer
    ).get_status()


def test_finalize_faults_on_one_worker(tiny_llama, redis_url, moto, tmp_path):
    """One worker, whose finalize sleeps 3 s before writing, meets three faults in turn (a worker's start
    costs far more than these batches, so they share it): a cancel racing finalize, S3 stopped mid-finalize,
    and at last a SIGKILL mid-finalize that leaves no worker at all."""
    client = Client(redis_url)
    log = tmp_path / "worker.log"
    # torch's own CPU ops: no C++ kernel build (or wait on another checkout's build) in this worker's start
    worker = spawn(tiny_llama, redis_url, log, SLUICE_FAULTS="slow_finalize=3", SLUICE_CPU_KERNEL="0")
    try:
        cancel_racing_finalize(client, tmp_path)
        s3_stopped_mid_finalize(client, moto)
        sigkilled_mid_finalize(client, redis_url, worker, tmp_path)
    finally:
        stop_worker(worker)
    assert "TransitionError" not in log.read_text()


def wait_finalizing(client: Client, batches: list, timeout: float = 60) -> object:
    """The first of batches seen `finalizing` (inside the slow_finalize window)."""
    found: list = []

    def finalizing() -> bool:
        found[:] = [b for b in batches if client.get(b.id).status == BatchStatus.finalizing]
        return bool(found)

    wait_until(finalizing, timeout, "a finalize to start")
    return found[0]


def cancel_racing_finalize(client: Client, tmp_path: Path) -> None:
    """Two batches finish together; while one is finalizing, the other (its finalize waiting) is cancelled,
    then the finalizing one too: the first cancel wins (cancelled), the second is refused (completed); no
    finalize job fails."""
    batches = [submit(client, tmp_path.as_uri()) for _ in range(2)]
    busy = wait_finalizing(client, batches, timeout=300)  # the worker's start included
    [waiting] = [b for b in batches if b is not busy]
    assert client.cancel(waiting.id).status == BatchStatus.cancelling
    with pytest.raises(TransitionError, match="finalizing"):
        client.cancel(busy.id)
    wait_until(lambda: all(client.get(b.id).done for b in batches), 60, "both batches")
    assert client.get(busy.id).status == BatchStatus.completed
    assert client.get(waiting.id).status == BatchStatus.cancelled
    for batch in batches:
        assert sum(assert_exactly_once(client, client.get(batch.id), IDS)) == 4
    finished = lambda: {finalize_status(client, b.id) for b in batches} == {JobStatus.FINISHED}  # noqa: E731
    wait_until(finished, 30, "both finalize jobs to be recorded finished (none failed)")


def s3_stopped_mid_finalize(client: Client, moto) -> None:
    """moto goes away while finalize is about to read the shards and write the files, back 8 s later."""
    import boto3

    boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="finalize-faults")
    batch = submit(client, "s3://finalize-faults/out")
    wait_finalizing(client, [batch])
    moto.stop()
    time.sleep(8)
    assert client.get(batch.id).status == BatchStatus.finalizing, "nothing can finish while S3 is down"
    moto.start()
    wait_until(lambda: client.get(batch.id).done, 90, "the batch after S3 came back")
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, IDS) == (4, 0)


def sigkilled_mid_finalize(client: Client, redis_url: str, worker: subprocess.Popen, tmp_path: Path) -> None:
    """The only worker dies inside finalize; the reaper alone (no worker restarted) retries and ends the
    batch."""
    batch = submit(client, tmp_path.as_uri())
    wait_finalizing(client, [batch])
    worker.kill()
    worker.wait()
    assert not open_storage(tmp_path.as_uri()).exists(f"{batch.id}/output.jsonl"), "killed before writing"
    assert finalize_status(client, batch.id) == JobStatus.STARTED, "abandoned, as a SIGKILL leaves it"
    done = reap_until_done(client, redis_url, batch.id, tmp_path / "reaper.log")
    assert done.status == BatchStatus.completed, (tmp_path / "reaper.log").read_text()[-2000:]
    assert assert_exactly_once(client, done, IDS) == (4, 0)


def test_reaper_alone_expires_a_batch_past_its_window(redis_url, tmp_path):
    """No worker runs at all: past its completion window the reaper drops the shards and ends it `expired`."""
    client = Client(redis_url)
    batch = submit(client, tmp_path.as_uri(), completion_window="2s")
    done = reap_until_done(client, redis_url, batch.id, tmp_path / "reaper.log")
    assert done.status == BatchStatus.expired and done.expired_at
    assert assert_exactly_once(client, done, IDS) == (0, 4)
    assert {r.error.code for r in client.results(batch.id, errors=True)} == {"batch_expired"}


def test_submit_killed_while_validating_is_failed_by_the_reaper(redis_url, tmp_path):
    """A submit SIGKILLed mid-validation (reading a slow stream) leaves its batch `validating`; once that
    outlasts SLUICE_VALIDATING_TIMEOUT the reaper ends it `failed`, naming why, with nothing enqueued."""
    client = Client(redis_url)
    code = (
        "import sys; from sluice.producer import Client; "
        f"Client({redis_url!r}).submit_batch((line for line in sys.stdin.buffer), "
        f"output={tmp_path.as_uri()!r})"
    )
    producer = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, env=worker_env(redis_url)
    )
    try:
        producer.stdin.write(b"".join(json.dumps(request(i)).encode() + b"\n" for i in range(3)))
        producer.stdin.flush()
        wait_until(
            lambda: [b.status for b in client.list()] == [BatchStatus.validating], 60, "the batch record"
        )
    finally:
        producer.kill()
        producer.wait()
    [batch] = client.list()
    done = reap_until_done(
        client, redis_url, batch.id, tmp_path / "reaper.log", SLUICE_VALIDATING_TIMEOUT="2"
    )
    assert done.status == BatchStatus.failed
    assert done.errors[-1].code == "validation_interrupted"
    assert done.output_file is None and done.num_shards == 0
    assert client.connection.keys("rq:job:*") == [], "nothing was enqueued"
