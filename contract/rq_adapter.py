"""Every use of rq's private internals, in one place, for the rq versions in SUPPORTED (pinned in pyproject).

The worker holds many jobs at once and the cron scheduler runs its ticks in-process, so both need a few of rq's
own steps that rq keeps private. tests/test_rq_adapter.py checks the names and their behaviour against the
installed rq; an rq upgrade that moves them fails there, not in production.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import rq
from rq.cron import CronJob, CronScheduler
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

SUPPORTED = ((3, 0), (4, 0))  # [lowest, first unsupported) major.minor, as pyproject's `rq>=3.0,<4`
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
    """rq's handler for the command channel's thread: waits out Redis connection errors, re-raises the rest."""
    return worker._pubsub_exception_handler


def request_worker_stop(worker: BaseWorker) -> None:
    """The flag rq's own waits (suspension) check to stop early."""
    worker._stop_requested = True


def set_cron_jobs(scheduler: CronScheduler, jobs: list[CronJob]) -> None:
    """Replace the scheduler's cron jobs (rq registers them one by one, with no way to remove one)."""
    scheduler._cron_jobs = jobs
