"""Worker faults with one worker: slow iterations vs heartbeats, a request that breaks the engine, foreign
jobs."""

from __future__ import annotations

import logging
import os
import time

import pytest
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.queues import queue_for
from sluice.contract.redis_conn import connect
from sluice.contract.settings import Settings
from sluice.engine import LLM, RequestRejected, SamplingParams
from sluice.producer import BatchStatus, Client
from sluice.worker.shard_run import ShardRun
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


def test_a_shard_cut_off_before_its_lease_resumes_only_while_rq_still_has_it_here(llm, redis_url, tmp_path,
                                                                                   caplog):
    """The state a Redis error between a claim and its lease leaves (held, in no engine, no token): once Redis
    answers the shard is resumed if rq still has the job started by this worker, and discarded in one line if
    rq gave it to another attempt meanwhile (its heartbeat lapsed: rq's own abandoned-job cleanup)."""
    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(4)], output=tmp_path.as_uri(), shard_size=2)
    worker = EngineWorker(["default"], llm, connect(redis_url), heartbeat_ttl=5, reaper=False)
    worker.bootstrap("INFO")

    def cut_short() -> str:
        job, queue = worker.poll()
        assert worker.claim(job, queue) is not None
        worker.runs[job.id] = ShardRun.from_args(job.id, job.args)
        worker.unprepared.add(job.id)
        return job.id

    try:
        given_away = cut_short()
        StartedJobRegistry("default", connection=client.connection, serializer=JSONSerializer).cleanup(
            timestamp=time.time() + 3600)  # fmt: skip
        kept = cut_short()
        with caplog.at_level(logging.INFO, logger="rq.worker"):
            worker._resume_unprepared()
        assert given_away not in worker.runs and given_away not in worker.held
        assert kept in worker.runs and kept not in worker.unprepared and worker.runs[kept].token == 1
        assert sorted(worker.owner.values()) == [kept, kept], "the resumed shard's requests are in the engine"
        lines = [r.getMessage() for r in caplog.records if r.name == "rq.worker"]
        assert [line for line in lines if "discarded, taking new work" in line] == [
            f"Worker {worker.name}: shard 0 of {batch.id}: its job went elsewhere before it took a lease; "
            f"{given_away} discarded, taking new work"
        ]
        assert any(f"resuming {kept}, whose start a Redis outage cut short" in line for line in lines)
    finally:
        worker._release_all(None)
        worker.teardown()
    assert Job.fetch(given_away, connection=client.connection, serializer=JSONSerializer).retries_left == (
        client.settings.shard_retries - 1
    ), "rq retried the shard it gave away"
