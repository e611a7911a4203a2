"""contract/rq_adapter.py against the installed rq: the supported versions, the private names it reaches and
what they do for the worker and the cron scheduler (real redis-server)."""

from __future__ import annotations

import inspect
import json
import re
import threading
import tomllib
from pathlib import Path

import pytest
import redis
from rq import Retry, SimpleWorker
from rq.cron import CronJob, CronScheduler
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.suspension import suspend
from rq.worker import BaseWorker

from sluice.contract import rq_adapter
from sluice.contract.jobs import FINALIZE
from sluice.contract.queues import fetch, queue_for
from sluice.worker.rq_jobs import JobsWorker

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_rq_is_the_range_pyproject_pins():
    """SUPPORTED is pyproject's rq bound, and the installed rq is inside it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"rq\b", d)]
    major, minor, below = re.fullmatch(r"rq>=(\d+)\.(\d+),<(\d+)", spec.replace(" ", "")).groups()
    assert rq_adapter.SUPPORTED == ((int(major), int(minor)), (int(below), 0))
    assert rq_adapter.supported()
    assert rq_adapter.rq_version() >= rq_adapter.SUPPORTED[0]


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_private_names_exist_with_the_signatures_the_adapter_calls():
    assert parameters(BaseWorker._finalize_success) == ["self", "job", "queue", "execution", "return_value"]
    assert parameters(BaseWorker._finalize_failure) == ["self", "job", "queue", "execution", "exc_info"]
    assert parameters(BaseWorker._pubsub_exception_handler) == ["self", "exc", "pubsub", "pubsub_thread"]
    assert "_stop_requested" in inspect.getsource(BaseWorker.check_for_suspension)
    assert "self._cron_jobs" in inspect.getsource(CronScheduler.get_jobs)


def claimed(connection: redis.Redis, retries: int) -> tuple[JobsWorker, str]:
    """A JobsWorker holding a freshly enqueued finalize job (never run: the adapter ends it)."""
    retry = Retry(max=retries, interval=[60]) if retries else None
    job = queue_for(connection, "default").enqueue_call(FINALIZE, args=("batch_x",), retry=retry)
    worker = JobsWorker(["default"], connection)
    worker.register_birth()
    dequeued, queue = worker.poll()
    assert dequeued.id == job.id and worker.claim(dequeued, queue) is not None
    return worker, job.id


def test_finish_job_records_the_result_and_the_finished_registry(redis_url):
    connection = redis.Redis.from_url(redis_url)
    worker, job_id = claimed(connection, retries=0)
    worker.finish(job_id, {"saved": 3})
    [job] = fetch(connection, [job_id])
    assert job.get_status() == JobStatus.FINISHED and job.return_value() == {"saved": 3}
    assert job_id in FinishedJobRegistry("default", connection=connection) and not worker.held


def test_fail_job_schedules_a_retry_then_fails_for_good(redis_url):
    connection = redis.Redis.from_url(redis_url)
    worker, job_id = claimed(connection, retries=1)
    try:
        raise RuntimeError("shard broke")
    except RuntimeError:
        worker.fail(job_id)
    [job] = fetch(connection, [job_id])
    assert job.get_status() == JobStatus.SCHEDULED and job.retries_left == 0
    worker, job_id = claimed(connection, retries=0)
    worker.fail_for_good(job_id, ValueError("no such model"))
    [job] = fetch(connection, [job_id])
    assert job.get_status() == JobStatus.FAILED and "no such model" in job.latest_result().exc_string
    assert job_id in FailedJobRegistry("default", connection=connection)


def test_request_worker_stop_ends_rq_s_suspension_wait(redis_url):
    connection = redis.Redis.from_url(redis_url)
    worker = SimpleWorker(["default"], connection=connection)
    assert worker._stop_requested is False
    suspend(connection)
    waiting = threading.Thread(target=worker.check_for_suspension, args=(False,), daemon=True)
    waiting.start()
    waiting.join(1.5)
    assert waiting.is_alive(), "a suspended worker waits"
    rq_adapter.request_worker_stop(worker)
    waiting.join(5)
    assert not waiting.is_alive()
    connection.delete("rq:suspended")


def test_pubsub_error_handler_waits_out_connection_errors_and_raises_the_rest(redis_url):
    worker = SimpleWorker(["default"], connection=redis.Redis.from_url(redis_url))
    handler = rq_adapter.pubsub_error_handler(worker)
    handler(redis.ConnectionError("down"), None, None)  # returns: the thread retries
    try:
        raise KeyError("bad payload")
    except KeyError as exc:
        with pytest.raises(KeyError):
            handler(exc, None, None)


def test_set_cron_jobs_replaces_what_the_scheduler_runs_and_saves(redis_url):
    scheduler = CronScheduler(redis.Redis.from_url(redis_url))
    scheduler.register(print, "default", args=("old",), interval=60)
    job = CronJob("default", func=print, args=("new",), interval=30)
    rq_adapter.set_cron_jobs(scheduler, [job])
    assert scheduler.get_jobs() == [job]
    assert [j.args for j in scheduler.get_jobs()] == [("new",)]
    saved = json.loads(scheduler.to_dict()["cron_jobs"])
    assert [json.loads(j["args"]) for j in saved] == [["new"]]


def test_the_undocumented_steps_exist_with_the_signatures_the_adapter_calls():
    """Every name in STEPS is still on rq's worker, queue or job, called as the adapter calls it."""
    from rq.job import Job
    from rq.queue import Queue

    assert parameters(BaseWorker.prepare_execution) == ["self", "job"]
    assert parameters(BaseWorker.prepare_job_execution) == ["self", "job", "remove_from_intermediate_queue"]
    assert parameters(BaseWorker.cleanup_execution) == ["self", "job", "pipeline", "execution"]
    assert {"exc_string", "execution"} <= set(parameters(BaseWorker.handle_job_failure))
    assert parameters(BaseWorker.perform_job) == ["self", "job", "queue", "execution"]
    assert parameters(BaseWorker.maintain_heartbeats) == ["self", "job", "execution"]
    assert parameters(BaseWorker.dequeue_job_and_maintain_ttl) == ["self", "timeout", "max_idle_time"]
    assert parameters(Queue.dequeue_any)[:3] == ["queues", "timeout", "connection"]
    owners = (BaseWorker, Queue, Job)
    assert all(any(hasattr(owner, name) for owner in owners) for name in rq_adapter.STEPS)
    assert Job.redis_job_namespace_prefix == "rq:job:"


def test_a_job_s_way_through_the_adapter_s_steps(redis_url):
    """Queued: in its queue, read as (queue, queued); dequeued: still there (intermediate list) until started;
    started: out of both lists, in the started registry until its execution ends; failed unrun with a
    message."""
    connection = redis.Redis.from_url(redis_url)
    job = queue_for(connection, "default").enqueue_call(FINALIZE, args=("batch_y",))
    queue = queue_for(connection, "default")
    worker = JobsWorker(["default"], connection)

    def origin_and_status() -> list:
        with connection.pipeline() as pipe:
            rq_adapter.read_origin_and_status(pipe, job.id)
            [fields] = pipe.execute()
        return fields

    assert rq_adapter.in_queue(connection, queue, job.id) and origin_and_status() == [b"default", b"queued"]
    dequeued, _ = rq_adapter.dequeue_now(worker)
    assert dequeued.id == job.id and rq_adapter.in_queue(connection, queue, job.id)
    assert rq_adapter.dequeue_now(worker) is None
    execution = rq_adapter.start_execution(worker, dequeued)
    assert not rq_adapter.in_queue(connection, queue,
                                   job.id) and origin_and_status() == [b"default", b"started"]
    assert job.id in queue.started_job_registry
    with connection.pipeline() as pipe:
        rq_adapter.end_execution(worker, dequeued, execution, pipe)
        pipe.execute()
    assert job.id not in queue.started_job_registry
    execution = rq_adapter.start_execution(worker, dequeued)
    rq_adapter.fail_unrun(worker, dequeued, queue, execution, "refused by the test")
    assert origin_and_status() == [b"default", b"failed"]
    assert "refused by the test" in dequeued.latest_result().exc_string
    with connection.pipeline() as pipe:
        rq_adapter.read_origin_and_status(pipe, "no-such-job")
        assert pipe.execute() == [[None, None]]
