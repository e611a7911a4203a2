"""The worker's whole coupling to rq (3.x): claim jobs, keep their heartbeats, finish, fail, hand back, wait.

An rq `SimpleWorker` that holds many jobs at once (the engine loop in `worker.py` drives it). Only this
module drives rq's worker; the private steps it needs go through `contract/rq_adapter.py`, and the rest of
the worker sees jobs, queues and a few verbs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from rq import SimpleWorker
from rq.exceptions import DequeueTimeout, StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.utils import now

from sluice.contract.jobs import FINALIZE, SHARD_FUNCTIONS
from sluice.contract.queues import job_status, queue_for
from sluice.contract.redis_conn import follows_sentinel
from sluice.contract.rq_adapter import (
    dequeue_now,
    dequeue_waiting,
    end_execution,
    fail_job,
    fail_unrun,
    finish_job,
    in_queue,
    keep_alive,
    maintain_registries,
    new_execution,
    pubsub_error_handler,
    run_job,
    share_connection,
    start_execution,
)

ALLOWED_FUNCTIONS = SHARD_FUNCTIONS | {FINALIZE}
RETRY_POLL_S = 1.0
PUBSUB_POLL_S = 0.25  # how long the command-channel thread blocks per read; its stop waits this long
MIN_SOCKET_TIMEOUT_S = 5.0  # above the longest blocking pop this worker makes (its 1 s idle wait)
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@dataclass
class Held:
    """A job this worker has claimed: rq's record of the run (execution) and when it began."""

    job: Job
    queue: Queue
    execution: Execution
    since: float


class JobsWorker(SimpleWorker):
    """An rq worker holding any number of jobs; heartbeats come from a thread, so a slow step never loses
    one."""

    def __init__(self, queues: list[str], connection: redis.Redis, heartbeat_ttl: int = 30, **kwargs: Any):
        kwargs.setdefault("maintenance_interval", heartbeat_ttl)
        socket_timeout = connection.connection_pool.connection_kwargs.get("socket_timeout")
        super().__init__(queues, connection=connection, serializer=JSONSerializer, **kwargs)
        if follows_sentinel(connection) and socket_timeout:  # rq raised it; our pops wait 1 s
            timeout = max(socket_timeout, MIN_SOCKET_TIMEOUT_S)
            connection.connection_pool.connection_kwargs["socket_timeout"] = timeout
        self.job_heartbeat_ttl = heartbeat_ttl
        self.held: dict[str, Held] = {}
        self.inline: Held | None = None
        self._lock = threading.RLock()
        self._retries = RQScheduler(self.queues, connection, serializer=JSONSerializer,
                                    name=f"{self.name}:retries")
        share_connection(self._retries, connection)
        self._last_retry_poll = 0.0
        self.idle = False

    def subscribe(self) -> None:
        """rq's command channel (`rq.command`: stop/kill), read by a thread that notices a stop within 1 s.

        rq reads it in 60 s waits and redis-py >= 8 joins that thread on stop without a timeout, so a SIGTERM
        could keep an idle worker alive for a minute.
        """
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_POLL_S, daemon=True, exception_handler=pubsub_error_handler(self)
        )

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Held jobs count as abandoned this long after the last heartbeat."""
        return self.job_heartbeat_ttl

    def poll(self) -> tuple[Job, Queue] | None:
        """The next job from the queues in priority order, without blocking."""
        try:
            return dequeue_now(self)
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # an unreadable job (not JSON, no such function) is dropped, not fatal
            self.log.error("Worker %s: dropped unreadable job %s: %s", self.name, getattr(exc, "job_id", "?"),
                           exc)
            return None

    def wait_for_job(self, timeout: int = 1) -> tuple[Job, Queue] | None:
        """Block up to timeout seconds for a job, through rq's own dequeue (which waits out Redis outages)."""
        self.idle = True
        try:
            return dequeue_waiting(self, timeout)
        except DequeueTimeout:
            return None
        except (StopRequested, *REDIS_ERRORS):  # a stop signal while idle ends the loop (worker.request_stop)
            raise
        except Exception as exc:
            self.log.error("Worker %s: dropped unreadable job %s: %s", self.name, getattr(exc, "job_id", "?"),
                           exc)
            return None
        finally:
            self.idle = False

    def allowed(self, job: Job) -> bool:
        """Whether job runs one of Sluice's functions; anything else is failed unrun."""
        return job.func_name in ALLOWED_FUNCTIONS

    def refuse(self, job: Job, queue: Queue) -> None:
        """Fail a job that calls a function we do not run, without retries and without importing it."""
        self.log.warning("Worker %s: refused job %s calling %r", self.name, job.id, job.func_name)
        execution = start_execution(self, job)
        job.retries_left = None
        job.ended_at = now()
        allowed = ", ".join(sorted(ALLOWED_FUNCTIONS))
        message = f"refused: {job.func_name!r} is not a Sluice job function ({allowed})"
        fail_unrun(self, job, queue, message=message, execution=execution)

    def claim(self, job: Job, queue: Queue) -> Execution | None:
        """Mark job started through rq; None when this worker already holds it (re-queued while held)."""
        with self._lock:
            execution = start_execution(self, job)
            job.started_at = now()
            held = self.held.get(job.id)
            if held is None:
                self.held[job.id] = Held(job, queue, execution, time.monotonic())
                return execution
            self.log.warning("Worker %s: %s came back while held; keeping the run in flight", self.name,
                             job.id)
            with self.connection.pipeline() as pipe:
                end_execution(self, held.job, held.execution, pipe)
                pipe.execute()
            self.held[job.id] = Held(job, queue, execution, held.since)
            return None

    def run_inline(self, job: Job, queue: Queue) -> None:
        """Run a non-shard job (finalize) in this process, its heartbeat kept by the heartbeat thread."""
        execution = new_execution(self, job)
        self.inline = Held(job, queue, execution, time.monotonic())
        try:
            run_job(self, job, queue, execution)
        finally:
            self.inline = None
        self.set_state("idle")

    def finish(self, job_id: str, result: Any) -> None:
        """Record the held job as finished (dependents enqueued); on a Redis error it stays held."""
        with self._lock:
            held = self.held[job_id]
            finish_job(self, held.job, held.queue, held.execution, result)
            del self.held[job_id]

    def fail(self, job_id: str, exc_info: Any = None) -> None:
        """Record the held job as failed: rq retries it after its backoff while it has retries left."""
        with self._lock:
            held = self.held[job_id]
            fail_job(self, held.job, held.queue, held.execution, exc_info or sys.exc_info())
            del self.held[job_id]

    def fail_for_good(self, job_id: str, exc: Exception) -> None:
        """Record the held job as failed with no retry (a permanent, per-batch error)."""
        with self._lock:
            self.held[job_id].job.retries_left = None
            try:
                raise exc
            except type(exc):
                self.fail(job_id, sys.exc_info())

    def hand_back(self, job_id: str) -> None:
        """Put the held job back at the front of its queue, unrun (a graceful stop; no retry used)."""
        with self._lock:
            held = self.held[job_id]
            with self.connection.pipeline() as pipe:
                pipe.multi()
                end_execution(self, held.job, held.execution, pipe)
                held.queue.enqueue_job(held.job, pipeline=pipe, at_front=True)
                pipe.execute()
            del self.held[job_id]

    def forget(self, job_id: str) -> None:
        """Stop holding a job without telling rq (Redis is down): it comes back as abandoned, with a retry
        used."""
        with self._lock:
            self.held.pop(job_id, None)

    def time_out(self, job_id: str) -> None:
        """Fail a held job that ran past its rq timeout, as rq's own timeout would."""
        timeout = self.held[job_id].job.timeout
        try:
            raise JobTimeoutException(f"Task exceeded maximum timeout value ({timeout} seconds)")
        except JobTimeoutException:
            self.fail(job_id, sys.exc_info())

    def overdue(self) -> list[str]:
        """Held jobs running longer than their rq timeout."""
        clock = time.monotonic()
        with self._lock:
            return [i for i, h in self.held.items() if h.job.timeout and clock - h.since > h.job.timeout]

    def beat(self) -> None:
        """Heartbeats for the worker and every job it holds (called from the heartbeat thread)."""
        with self._lock:
            held = list(self.held.values()) + ([self.inline] if self.inline else [])
        if not held:
            self.heartbeat()
        for h in held:
            keep_alive(self, h.job, h.execution)

    def maintain(self) -> None:
        """rq's registry maintenance, and re-enqueueing retries whose backoff has passed."""
        maintain_registries(self)
        clock = time.monotonic()
        if clock - self._last_retry_poll >= RETRY_POLL_S:
            self._last_retry_poll = clock
            if self._retries.acquire_locks():
                self._lapse_with_heartbeat(self._retries.acquired_locks)
                self._retries.enqueue_scheduled_jobs()

    def _lapse_with_heartbeat(self, queue_names: Iterable[str]) -> None:
        """Give the retry-scheduling locks held the heartbeat's TTL (rq's is a minute): a worker paused or cut
        off holding them stops moving retries onto the queues, and another takes over within a heartbeat."""
        with self.connection.pipeline(transaction=False) as pipe:
            for name in queue_names:
                pipe.expire(RQScheduler.get_locking_key(name), self.job_heartbeat_ttl)
            pipe.execute()

    def queues_empty(self) -> bool:
        return all(q.count == 0 for q in self.queues)

    def release(self) -> None:
        """Give up the retry-scheduling locks (on the way out)."""
        try:
            self._retries.release_locks()
        except REDIS_ERRORS:
            pass


def lost(connection: redis.Redis, job: Job) -> bool:
    """A job marked queued that sits in no queue, or started that no worker's execution holds (dequeued by
    a worker that then died): nothing would ever run it again."""
    queue = queue_for(connection, job.origin)
    state = job_status(job)
    if state == "queued":
        return not in_queue(connection, queue, job.id)
    if state == "started":
        return job.id not in queue.started_job_registry
    return False


def clean_abandoned(connection: redis.Redis, queue_names: Iterable[str]) -> None:
    """rq's own handling of started jobs whose worker stopped heartbeating (SIGKILL, lost machine): retried
    while they have retries left, else failed. Workers do this in their maintenance; the reaper does it too,
    so a job abandoned while no worker runs (a finalize killed mid-write) does not stay `started` for ever."""
    for name in queue_names:
        StartedJobRegistry(name, connection=connection, serializer=JSONSerializer).cleanup()


def requeue(connection: redis.Redis, job: Job) -> None:
    """Put a lost job back at the front of its queue."""
    queue_for(connection, job.origin).enqueue_job(job, at_front=True)
