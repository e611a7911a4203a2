"""Every use of rq's internals, in one place, for the rq versions in SUPPORTED (pinned in pyproject).

The worker holds many jobs at once and the cron scheduler runs its ticks in-process, so both need a few of
rq's own steps that rq keeps private (underscore names) or undocumented (the worker's per-job steps in STEPS,
the layout of its Redis keys). tests/test_rq_adapter.py checks the names and their behaviour against the
installed rq; an rq upgrade that moves them fails there, not in production. tests/test_structure.py checks
that no other module reaches them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import redis
import rq
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.scheduler import RQScheduler
from rq.worker import BaseWorker

# rq's undocumented worker steps: only this module calls them (tests/test_structure.py)
STEPS = ("prepare_execution", "prepare_job_execution", "cleanup_execution", "handle_job_failure",
         "perform_job",
         "execute_job", "maintain_heartbeats", "dequeue_job_and_maintain_ttl", "run_maintenance_tasks",
         "should_run_maintenance_tasks", "dequeue_any", "intermediate_queue_key",
         "redis_job_namespace_prefix")
SUPPORTED = ((3, 0), (4, 0))  # [lowest, first unsupported) major.minor, as pyproject's `rq>=3.0,<4`
if TYPE_CHECKING:  # rq.cron imports croniter: the producer's scheduler needs it, a worker's start does not
    from rq.cron import CronJob, CronScheduler

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def rq_version() -> tuple[int, int]:
    """The installed rq's (major, minor)."""
    major, minor = rq.__version__.split(".")[:2]
    return int(major), int(minor)


def supported() -> bool:
    """Whether the installed rq is one this adapter was written and tested against."""
    return SUPPORTED[0] <= rq_version() < SUPPORTED[1]


def finish_job(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, result: Any) -> None:
    """rq's end of a job that returned: result saved, finished registry, dependents enqueued."""
    worker._finalize_success(job, queue, execution, result)


def fail_job(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, exc_info: ExcInfo) -> None:
    """rq's end of a job that raised: retried after its backoff while it has retries left, else failed."""
    worker._finalize_failure(job, queue, execution, exc_info)


def pubsub_error_handler(worker: BaseWorker) -> Callable[..., None]:
    """rq's handler for the command channel's thread: waits out Redis connection errors, re-raises the
    rest."""
    return worker._pubsub_exception_handler


def request_worker_stop(worker: BaseWorker) -> None:
    """The flag rq's own waits (suspension) check to stop early."""
    worker._stop_requested = True


def set_cron_jobs(scheduler: CronScheduler, jobs: list[CronJob]) -> None:
    """Replace the scheduler's cron jobs (rq registers them one by one, with no way to remove one)."""
    scheduler._cron_jobs = jobs


def share_connection(scheduler: RQScheduler, connection: redis.Redis) -> None:
    """Make rq's scheduler use this client rather than build one from its pool's arguments (a Sentinel pool's
    connections cannot be rebuilt that way: they need the pool that asks the sentinels)."""
    scheduler._connection = connection


def start_execution(worker: BaseWorker, job: Job) -> Execution:
    """rq's start of a job run: an execution record, the job marked started and moved to the started
    registry."""
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return execution


def end_execution(worker: BaseWorker, job: Job, execution: Execution,
                  pipeline: redis.client.Pipeline) -> None:
    """Drop a run's execution record and started-registry entry (queued on pipeline), leaving the job as it
    is."""
    worker.cleanup_execution(job, pipeline=pipeline, execution=execution)


def fail_unrun(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, message: str) -> None:
    """rq's failure of a started job with this message as its exception text (retries as the job has left)."""
    worker.handle_job_failure(job, queue, exc_string=message, execution=execution)


def new_execution(worker: BaseWorker, job: Job) -> Execution:
    """An execution record for a run of job that run_job starts (it marks the job started itself)."""
    return worker.prepare_execution(job)


def run_job(worker: BaseWorker, job: Job, queue: Queue, execution: Execution) -> None:
    """Run a job's function in this process under execution (from new_execution), as rq's own worker does."""
    worker.perform_job(job, queue, execution)


def keep_alive(worker: BaseWorker, job: Job, execution: Execution) -> None:
    """One heartbeat for a running job: its execution and started-registry entry outlive the heartbeat TTL."""
    worker.maintain_heartbeats(job, execution)


def dequeue_now(worker: BaseWorker) -> tuple[Job, Queue] | None:
    """The next job from the worker's queues in priority order, without blocking; None when they are empty."""
    return Queue.dequeue_any(worker.queues, None, connection=worker.connection, serializer=worker.serializer)


def dequeue_waiting(worker: BaseWorker, timeout: int) -> tuple[Job, Queue] | None:
    """The next job, waiting up to timeout seconds (then rq's DequeueTimeout), through rq's worker dequeue,
    which waits out Redis outages and keeps the worker's own TTL."""
    return worker.dequeue_job_and_maintain_ttl(timeout, max_idle_time=timeout)


def maintain_registries(worker: BaseWorker) -> None:
    """rq's registry maintenance (abandoned jobs, expired entries) when the worker's interval has passed."""
    if worker.should_run_maintenance_tasks:
        worker.run_maintenance_tasks()


def in_queue(connection: redis.Redis, queue: Queue, job_id: str) -> bool:
    """Whether job_id waits in the queue's list or in its intermediate list (dequeued, not yet started)."""
    return any(connection.lpos(key, job_id) is not None for key in (queue.key, queue.intermediate_queue_key))


def read_origin_and_status(pipe: redis.client.Pipeline, job_id: str) -> None:
    """Queue on pipe a read of a job's queue name and status, as two bytes fields (None for a missing job),
    without reading its arguments."""
    pipe.hmget(Job.redis_job_namespace_prefix + job_id, "origin", "status")
