"""The GPU worker: one engine kept full with requests from as many rq shard jobs as it has room for."""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rq.exceptions import StopRequested
from rq.job import Job
from rq.queue import Queue

from sluice.contract.batch import BatchStore
from sluice.contract.images import ImageSettings
from sluice.contract.jobs import SHARD_FUNCTIONS
from sluice.contract.rq_adapter import request_worker_stop
from sluice.contract.schemas import BatchRequest
from sluice.contract.settings import Settings, get_settings
from sluice.contract.storage import OutputNotAllowed
from sluice.worker.adapters import Adapters
from sluice.worker.background import every, supervised
from sluice.worker.faults import faults
from sluice.worker.lease import leases_lost
from sluice.worker.metrics import shard_finished
from sluice.worker.outage import OUTAGE, RqOutageFilter
from sluice.worker.responses import ABORT_CODES
from sluice.worker.rq_jobs import REDIS_ERRORS, JobsWorker
from sluice.worker.shard_run import (
    LeaseLost,
    ShardRun,
    model_name,
    output_refusal,
    served_models,
    stop_reason,
)
from sluice.worker.terminal import OUTPUT_NOT_ALLOWED, fail_batch

if TYPE_CHECKING:
    from sluice.engine import LLM

CANCEL_POLL_S = 0.5
CLAIM_POLL_S = 0.05
PROGRESS_S = 1.0
MAX_REDIS_WAIT_S = 30.0


class EngineBroken(RuntimeError):
    """The engine cannot even drop its requests: the worker hands its shards back (a retry each) and exits."""


class EngineWorker(JobsWorker):
    """Shard jobs share one continuous batch; the other allowed jobs (finalize) run inline."""

    def __init__(
        self,
        queues: list[str],
        llm: LLM,
        connection: Any,
        heartbeat_ttl: int = 30,
        grace: float = 60.0,
        reaper: bool = True,
        settings: Settings | None = None,
        adapters: Adapters | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(queues, connection, heartbeat_ttl, **kwargs)
        self.settings = settings or get_settings()  # `sluice worker` passes the Settings it read at start
        self.llm = llm
        self.model = model_name(llm)
        self.served = served_models(llm, self.settings, adapters)
        self.images = ImageSettings.of(self.settings)  # what image parts may be read (shard_run.prepare)
        self.grace = grace
        self.reaper = reaper
        self.store = BatchStore(connection)
        self.runs: dict[str, ShardRun] = {}
        self.owner: dict[str, str] = {}
        self.stop_deadline: float | None = None
        self.faults = faults(self.settings)
        self._fresh_ids = itertools.count(1)
        self._last_cancel_check = self._last_claim = self._last_progress = 0.0

    def work(self, burst: bool = False, logging_level: str = "INFO", **_: Any) -> bool:  # type: ignore[override]
        """Claim, step, complete; until stopped (or, with burst, until the queues are empty)."""
        self.bootstrap(logging_level)
        self.log.addFilter(RqOutageFilter())
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        stop = threading.Event()
        self._start_background(stop)
        try:
            return self._loop(burst)
        except StopRequested:
            return True
        except BaseException:
            self._release_all(sys.exc_info())
            raise
        finally:
            stop.set()
            self._release_all(None)
            self._quietly(self.release)
            self._quietly(self.teardown)

    def _start_background(self, stop: threading.Event) -> None:
        supervised("heartbeat", every(self.job_heartbeat_ttl / 3, self.beat), stop)
        if self.reaper:
            from sluice.worker.reaper import Reaper

            reaper = Reaper(self.connection, self.settings)
            supervised("reaper", every(reaper.interval, reaper.run_once), stop)

    def request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT: stop claiming, finish in-flight shards within the grace period; twice: hand back
        now."""
        self.log.info("Worker %s: stop requested (signal %s), %d shard(s) in flight", self.name, signum,
                      len(self.runs))
        request_worker_stop(self)
        self.stop_deadline = time.monotonic() + self.grace if self.stop_deadline is None else time.monotonic()
        if self.idle and not self.runs:
            raise StopRequested()

    def _loop(self, burst: bool) -> bool:
        worked, wait = False, 1.0
        while True:
            try:
                state = self._iterate(burst)
                wait = 1.0
                OUTAGE.recovered()
            except REDIS_ERRORS as exc:
                if self.stop_deadline is not None and (not self.runs
                                                       or time.monotonic() > self.stop_deadline):
                    return worked
                OUTAGE.failed(f"worker {self.name}", exc)
                time.sleep(wait)
                wait = min(wait * 2, MAX_REDIS_WAIT_S)
                continue
            if state is None:
                return worked
            worked |= state

    def _iterate(self, burst: bool) -> bool | None:
        """One pass of the loop: True if it claimed work, None when the loop should end."""
        self.maintain()
        self._police()
        self._save_done()
        claimed = self.stop_deadline is None and self._claim()
        if self.owner:
            self._step()
            return claimed
        if self.runs:
            return claimed
        if self.stop_deadline is not None or (burst and self.queues_empty()):
            return None
        self.check_for_suspension(burst)
        result = self.wait_for_job()
        if result is not None:
            self._start(*result)
        return claimed or result is not None

    def _police(self) -> None:
        """Stop deadline, shard timeouts, cancelled or expired batches."""
        clock = time.monotonic()
        if self.stop_deadline is not None and clock > self.stop_deadline:
            self._release_all(None)
        for job_id in self.overdue():
            if job_id in self.runs:
                self._drop_run(job_id)
                self.time_out(job_id)
        if self.runs and clock - self._last_cancel_check >= CANCEL_POLL_S:
            self._last_cancel_check = clock
            self._abort_stopped_batches()
            self._drop_lost_leases()

    def _has_room(self) -> bool:
        return self.llm.num_unfinished() < self.llm.max_num_seqs

    def _claim(self) -> bool:
        """Take jobs from the queues (in priority order) while the engine has room; polls at most every 50
        ms."""
        clock = time.monotonic()
        if self.runs and clock - self._last_claim < CLAIM_POLL_S:
            return False
        self._last_claim, claimed = clock, False
        while self._has_room():
            result = self.poll()
            if result is None:
                break
            self._start(*result)
            claimed = True
        return claimed

    def _start(self, job: Job, queue: Queue) -> None:
        """Mark the job started through rq; a shard joins the engine, finalize runs inline, others are
        refused."""
        if not self.allowed(job):
            self.refuse(job, queue)
            return
        if job.func_name not in SHARD_FUNCTIONS:
            self.run_inline(job, queue)
            return
        execution = self.claim(job, queue)
        if execution is None:
            return
        run: ShardRun | None = None
        try:
            run = ShardRun.from_args(job.id, job.args)
            if not run.lease(self.connection):
                self.log.info("Worker %s: %s was committed by an earlier attempt", self.name, job.id)
                self.finish(job.id, {"completed": 0, "failed": 0})
                return
            reason = stop_reason(self.store, run.batch_id)
            refusal = None if reason else output_refusal(self.store, run.batch_id, self.settings)
            if refusal:
                self._refuse_output(job.id, run.batch_id, OutputNotAllowed(refusal))
                return
            run.load(self.store, self.settings)
            if reason:
                run.fail_all(reason, ABORT_CODES[reason])
            else:
                run.start(self.llm, self.served, key=execution.id, images=self.images)
        except REDIS_ERRORS:
            self._abort_pending(run)
            self.forget(job.id)
            raise
        except Exception:
            self._abort_pending(run)
            self.fail(job.id, sys.exc_info())
            return
        self.runs[job.id] = run
        self.owner.update((rid, job.id) for rid in run.pending)

    def _step(self) -> None:
        try:
            self._injected_step_fault()
            self._collect(self.llm.step())
        except Exception as exc:
            self._isolate(exc)
        self._report_progress()
        self._save_done()

    def _report_progress(self) -> None:
        """Every PROGRESS_S, the requests finished since: the batches' counts move while their shards run."""
        clock = time.monotonic()
        if clock - self._last_progress >= PROGRESS_S:
            self._last_progress = clock
            for run in self.runs.values():
                if run.unreported:
                    run.report_progress(self.store)

    def _collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            job_id = self.owner.pop(out.request_id, None)
            if job_id is not None:
                self.runs[job_id].finish(out, self.model)

    def _save_done(self) -> None:
        for job_id, run in list(self.runs.items()):
            if run.done:
                self._complete(job_id, run)

    def _complete(self, job_id: str, run: ShardRun) -> None:
        """Save the shard's output and mark its job finished (or failed, for rq to retry with backoff)."""
        try:
            if run.unreported:  # the live counts hold every request of a saved shard
                run.report_progress(self.store)
            summary = run.save(self.connection, self.settings)
        except REDIS_ERRORS:
            raise
        except LeaseLost as exc:
            self._discard(job_id, exc)
            return
        except (OutputNotAllowed, PermissionError) as exc:
            del self.runs[job_id]
            self._refuse_output(job_id, run.batch_id, exc)
            shard_finished("failed")
            return
        except Exception:
            self.log.exception("Worker %s: saving %s failed", self.name, job_id)
            self.fail(job_id, sys.exc_info())
            del self.runs[job_id]
            shard_finished("failed")
            return
        self.finish(job_id, summary)
        del self.runs[job_id]
        shard_finished("completed")

    def _drop_lost_leases(self) -> None:
        """Drop the runs whose shard another attempt took (this worker was cut off or paused meanwhile)."""
        attempts = {j: (r.batch_id, r.shard, r.token) for j, r in self.runs.items() if r.token is not None}
        for job_id in leases_lost(self.connection, attempts):
            run = self.runs[job_id]
            self._drop_run(job_id)
            lost = f"shard {run.shard} of {run.batch_id}: attempt {run.token} lost its lease"
            self._discard(job_id, LeaseLost(lost))

    def _discard(self, job_id: str, exc: LeaseLost) -> None:
        """Forget a shard whose lease is lost (its job belongs to another attempt now) and log one line."""
        self.log.warning("Worker %s: %s; %s discarded, taking new work", self.name, exc, job_id)
        self.runs.pop(job_id, None)
        self.forget(job_id)
        shard_finished("discarded")

    def _refuse_output(self, job_id: str, batch_id: str, exc: Exception) -> None:
        """The batch's output cannot be written here: the batch fails at once and the job is not retried."""
        self.log.warning("Worker %s: batch %s failed, %s refused: %s", self.name, batch_id, job_id, exc)
        fail_batch(self.connection, batch_id, OUTPUT_NOT_ALLOWED, str(exc), self.settings)
        self.fail_for_good(job_id, exc)

    def _abort_stopped_batches(self) -> None:
        batch_ids = sorted({r.batch_id for r in self.runs.values() if r.abort_code is None})
        for batch_id in batch_ids:
            reason = stop_reason(self.store, batch_id)
            if reason:
                for run in self.runs.values():
                    if run.batch_id == batch_id:
                        run.abort(self.llm, reason)

    def _abort_pending(self, run: ShardRun | None) -> None:
        for rid in list(run.pending if run is not None else ()):
            self.llm.abort(rid)
            self.owner.pop(rid, None)

    def _drop_run(self, job_id: str) -> None:
        self._abort_pending(self.runs.pop(job_id))

    def _release_all(self, exc_info: Any) -> None:
        """Drop every run from the engine; hand its job back (a stop) or fail it for a retry (a crash)."""
        for job_id in list(self.runs):
            self.log.info("Worker %s: %s %s", self.name, "failing" if exc_info else "handing back", job_id)
            self._drop_run(job_id)
            try:
                self.fail(job_id, exc_info) if exc_info else self.hand_back(job_id)
            except REDIS_ERRORS as exc:
                self.log.warning("Worker %s: Redis down, %s left to rq's abandoned-job check: %s", self.name,
                                 job_id, exc)
                self.forget(job_id)
        self._quietly(self._flush_engine)

    def _flush_engine(self) -> None:
        for _ in range(3):
            if not self.llm.has_unfinished():
                return
            self.llm.step()
        raise EngineBroken("the engine still has requests after aborting them all")

    def _injected_step_fault(self) -> None:
        if self.faults.step_error:
            requests = (self.runs[job_id].pending[rid] for rid, job_id in self.owner.items())
            self.faults.check_step([r.model_dump_json() for r in requests])

    def _isolate(self, exc: Exception) -> None:
        """A step raised: re-run its requests in halving groups and fail only those that fail alone."""
        self.log.error("Worker %s: engine step failed (%s: %s); isolating the culprit", self.name,
                       type(exc).__name__, exc)
        suspects = [(job_id, self.runs[job_id].pending[rid]) for rid, job_id in self.owner.items()]
        self._reset_engine()
        groups = [suspects]
        while groups:
            group = groups.pop()
            try:
                self._run_group(group)
            except Exception as err:
                self._reset_engine()
                if len(group) > 1:
                    groups += [group[len(group) // 2 :], group[: len(group) // 2]]
                else:
                    self._fail_request(*group[0], err)

    def _run_group(self, group: list[tuple[str, BatchRequest]]) -> None:
        """Re-add the group's requests under fresh ids and step until they are done."""
        for job_id, request in group:
            run = self.runs[job_id]
            old = self._rid_of(run, request)
            base = old.split("~")[0]
            new = f"{base}~{next(self._fresh_ids)}"
            run.pending.pop(old)
            self.owner.pop(old, None)
            run.add(self.llm, new, request, self.served, self.images)
            if new in run.pending:
                self.owner[new] = job_id
        while self.llm.has_unfinished():
            self._injected_step_fault()
            self._collect(self.llm.step())

    def _fail_request(self, job_id: str, request: BatchRequest, err: Exception) -> None:
        run = self.runs[job_id]
        rid = self._rid_of(run, request)
        del run.pending[rid]
        self.owner.pop(rid, None)
        self.log.error("Worker %s: request %s fails the engine: %s", self.name, request.custom_id, err)
        run.fail(request, "engine_error", f"the engine failed on this request ({type(err).__name__}: {err})")

    @staticmethod
    def _rid_of(run: ShardRun, request: BatchRequest) -> str:
        return next(rid for rid, r in run.pending.items() if r is request)

    def _reset_engine(self) -> None:
        """Abort everything in flight and drain the engine; the runs keep those requests pending."""
        for rid in list(self.owner):
            self.llm.abort(rid)
            del self.owner[rid]
        try:
            self._flush_engine()
        except Exception as exc:
            raise EngineBroken(f"the engine failed while dropping its requests: {exc}") from exc

    def _quietly(self, action: Any) -> None:
        try:
            action()
        except Exception as exc:
            self.log.warning("Worker %s: %s failed on the way out: %s", self.name,
                             getattr(action, "__name__", action), exc)
