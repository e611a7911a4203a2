"""Worker faults with one worker: slow iterations vs heartbeats, a request that breaks the engine, foreign
jobs."""

from __future__ import annotations

import os

import pytest
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from sluice.contract.queues import queue_for
from sluice.contract.redis_conn import connect
from sluice.contract.settings import Settings
from sluice.engine import LLM, RequestRejected, SamplingParams
from sluice.producer import BatchStatus, Client
from sluice.worker.worker import EngineWorker
from tests.faults.conftest import assert_exactly_once, request, spawn, wait_until
from tests.services import stop_worker


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=16)


def test_engine_rejects_sampling_fields_the_model_cannot_take(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestRejected, match="top_k"):
        llm.engine.add_request("k", "hi", SamplingParams(top_k=2**63))
    with pytest.raises(RequestRejected, match="top_k"):
        llm.engine.add_request("k2", "hi", SamplingParams(top_k=vocab + 1))
    with pytest.raises(RequestRejected, match="seed"):
        llm.engine.add_request("s", "hi", SamplingParams(seed=2**70))
    assert not llm.engine.has_unfinished()


def test_worker_runs_only_sluice_job_functions(llm, redis_url, tmp_path):
    target = tmp_path / "made-by-a-foreign-job"
    job = queue_for(connect(redis_url), "default").enqueue_call("os.makedirs", args=(str(target),))
    worker = EngineWorker(["default"], llm, connect(redis_url), heartbeat_ttl=5, reaper=False)
    worker.work(burst=True, logging_level="WARNING")
    assert not os.path.exists(target)
    job = Job.fetch(job.id, connection=connect(redis_url), serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED
    assert "not a Sluice job function" in job.latest_result().exc_string


def test_a_request_that_breaks_the_engine_fails_alone(llm, redis_url, tmp_path):
    client = Client(redis_url)
    lines = [request(i) for i in range(11)] + [request(11, prompt="POISON pill")]
    batch = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=4)
    settings = Settings(faults="step_error=POISON")  # the worker's faults come from the Settings it is handed
    worker = EngineWorker(["default"], llm, connect(redis_url), heartbeat_ttl=5, reaper=False,
                          settings=settings)  # fmt: skip
    worker.work(burst=True, logging_level="WARNING")
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert assert_exactly_once(client, done, [f"r{i}" for i in range(12)]) == (11, 1)
    [bad] = client.results(batch.id, errors=True)
    assert bad.custom_id == "r11" and bad.error.code == "engine_error"


def test_crash_hand_back_uses_a_retry_with_backoff(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch([request(i, 200) for i in range(2)], output=tmp_path.as_uri(), shard_size=2)
    worker = EngineWorker(["default"], llm, connect(redis_url), heartbeat_ttl=5, reaper=False)
    worker.bootstrap("WARNING")
    worker._claim()
    [job_id] = list(worker.runs)
    try:
        raise RuntimeError("simulated crash")
    except RuntimeError:
        import sys

        worker._release_all(sys.exc_info())
    worker.teardown()
    job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.SCHEDULED, "a crashed shard waits out its backoff"
    assert job.retries_left == client.settings.shard_retries - 1
    assert not llm.engine.has_unfinished() and batch.id


def test_slow_iteration_keeps_its_shards(tiny_llama, redis_url, tmp_path):
    """Each shard save takes 2x the heartbeat TTL: no shard is re-queued, re-claimed or saved as errors."""
    client = Client(redis_url)
    ids = [f"r{i}" for i in range(8)]
    batch = client.submit_batch([request(i) for i in range(8)], output=tmp_path.as_uri(), shard_size=2)
    log = tmp_path / "worker.log"
    worker = spawn(tiny_llama, redis_url, log, SLUICE_FAULTS="slow_save=6")
    try:
        wait_until(lambda: client.get(batch.id).done, 240, "the batch")
        assert worker.poll() is None, "the worker is still alive"
    finally:
        stop_worker(worker)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed, log.read_text()[-3000:]
    assert assert_exactly_once(client, done, ids) == (8, 0)
    assert "came back while held" not in log.read_text()
    for n in range(done.num_shards):
        job = Job.fetch(f"{batch.id}-shard-{n}", connection=client.connection, serializer=JSONSerializer)
        assert job.retries_left == client.settings.shard_retries, "no retry was used"
