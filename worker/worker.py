"""The GPU worker: one engine kept full with requests from as many rq shard jobs as it has room for."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from rq import Queue, SimpleWorker
from rq.exceptions import DequeueTimeout, StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now

from contract.batch import BatchStore
from contract.jobs import RUN_SHARD
from worker.metrics import shard_finished
from worker.responses import ABORT_CODES
from worker.shards import ShardRun, model_name, stop_reason

CANCEL_POLL_S = 0.5
CLAIM_POLL_S = 0.05


@dataclass
class Claim:
    """A shard job this worker has claimed through rq, and its run in the engine."""

    job: Job
    queue: Queue
    execution: Execution
    run: ShardRun


class EngineWorker(SimpleWorker):
    """An rq worker whose shard jobs share one continuous batch; other jobs (finalize) run inline."""

    def __init__(
        self,
        queues: list[str],
        llm: Any,
        connection: Any,
        heartbeat_ttl: int = 30,
        grace: float = 60.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("maintenance_interval", heartbeat_ttl)
        super().__init__(queues, connection=connection, serializer=JSONSerializer, **kwargs)
        self.llm = llm
        self.model = model_name(llm)
        self.job_heartbeat_ttl = heartbeat_ttl
        self.grace = grace
        self.store = BatchStore(connection)
        self.claims: dict[str, Claim] = {}
        self.owner: dict[str, Claim] = {}
        self.stop_deadline: float | None = None
        self._last_heartbeat = self._last_cancel_check = self._last_claim = 0.0

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Claimed jobs expire from rq's started registry this long after the last heartbeat."""
        return self.job_heartbeat_ttl

    def work(self, burst: bool = False, logging_level: str = "INFO", **_: Any) -> bool:  # type: ignore[override]
        """Claim, step, complete; until stopped (or, with burst, until the queues are empty)."""
        self.bootstrap(logging_level)
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        worked = False
        try:
            while True:
                self._maintain()
                if self.stop_deadline is None and self._claim():
                    worked = True
                if self.claims:
                    self._step()
                elif self.stop_deadline is not None or (burst and self._queues_empty()):
                    break
                else:
                    self.check_for_suspension(burst)
                    self._wait_for_job()
        except StopRequested:
            pass
        finally:
            self._hand_back_all()
            self.teardown()
        return worked

    def request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT: stop claiming, finish in-flight shards within the grace period; twice: hand back now."""
        self.log.info(
            "Worker %s: stop requested (signal %s), %d shard(s) in flight",
            self.name,
            signum,
            len(self.claims),
        )
        self._stop_requested = True
        self.stop_deadline = time.monotonic() + self.grace if self.stop_deadline is None else time.monotonic()

    def _maintain(self) -> None:
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        clock = time.monotonic()
        if clock - self._last_heartbeat >= self.job_heartbeat_ttl / 3:
            self._last_heartbeat = clock
            self.heartbeat()
            for claim in self.claims.values():
                self.maintain_heartbeats(claim.job, claim.execution)
        if clock - self._last_cancel_check >= CANCEL_POLL_S and self.claims:
            self._last_cancel_check = clock
            self._abort_stopped_batches()
        if self.stop_deadline is not None and clock > self.stop_deadline:
            self._hand_back_all()

    def _has_room(self) -> bool:
        return self.llm.engine.num_unfinished() < self.llm.config.max_num_seqs

    def _claim(self) -> bool:
        """Take jobs from the queues (in priority order) while the engine has room; polls at most every 50 ms."""
        clock = time.monotonic()
        if self.claims and clock - self._last_claim < CLAIM_POLL_S:
            return False
        self._last_claim, claimed = clock, False
        while self._has_room():
            result = Queue.dequeue_any(
                self._ordered_queues, None, connection=self.connection, serializer=self.serializer
            )
            if result is None:
                break
            self._start(*result)
            claimed = True
        return claimed

    def _wait_for_job(self) -> None:
        self.set_state("idle")
        try:
            result = Queue.dequeue_any(
                self._ordered_queues, 1, connection=self.connection, serializer=self.serializer
            )
        except DequeueTimeout:
            return
        if result is not None:
            self._start(*result)

    def _queues_empty(self) -> bool:
        return all(q.count == 0 for q in self.queues)

    def _start(self, job: Job, queue: Queue) -> None:
        """Mark the job started through rq; a shard joins the engine, anything else runs inline."""
        if job.func_name != RUN_SHARD:
            self.execute_job(job, queue)
            return
        execution = self.prepare_execution(job)
        try:
            self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
            job.started_at = now()
            claim = Claim(job, queue, execution, ShardRun.from_args(job.id, job.args))
            reason = stop_reason(self.store, claim.run.batch_id)
            if reason:
                claim.run.fail_all(reason, ABORT_CODES[reason])
            else:
                claim.run.start(self.llm)
        except Exception:
            self._finalize_failure(job, queue, execution, sys.exc_info())
            return
        self.claims[job.id] = claim
        self.owner.update((rid, claim) for rid in claim.run.pending)
        if claim.run.done:
            self._complete(claim)

    def _step(self) -> None:
        for out in self.llm.engine.step():
            claim = self.owner.pop(out.request_id, None)
            if claim is None:
                continue
            claim.run.finish(out, self.model)
            if claim.run.done:
                self._complete(claim)

    def _complete(self, claim: Claim) -> None:
        """Save the shard's output and mark its job finished (or failed, for rq to retry) through rq."""
        del self.claims[claim.job.id]
        try:
            summary = claim.run.save(self.connection)
        except Exception:
            shard_finished("failed")
            self._finalize_failure(claim.job, claim.queue, claim.execution, sys.exc_info())
            return
        shard_finished("completed")
        self._finalize_success(claim.job, claim.queue, claim.execution, summary)

    def _abort_stopped_batches(self) -> None:
        batch_ids = sorted({c.run.batch_id for c in self.claims.values() if c.run.abort_code is None})
        for batch_id in batch_ids:
            reason = stop_reason(self.store, batch_id)
            if reason:
                for claim in self.claims.values():
                    if claim.run.batch_id == batch_id:
                        claim.run.abort(self.llm, reason)

    def _hand_back_all(self) -> None:
        """Abort every in-flight shard in the engine and put its job back at the front of its queue."""
        for claim in list(self.claims.values()):
            self.log.info("Worker %s: handing back %s", self.name, claim.job.id)
            for rid in claim.run.pending:
                self.llm.engine.abort(rid)
                self.owner.pop(rid, None)
            with self.connection.pipeline() as pipe:
                pipe.multi()
                self.cleanup_execution(claim.job, pipeline=pipe, execution=claim.execution)
                claim.queue.enqueue_job(claim.job, pipeline=pipe, at_front=True)
                pipe.execute()
            del self.claims[claim.job.id]
        while self.llm.engine.has_unfinished() and not self.owner:
            self.llm.engine.step()
