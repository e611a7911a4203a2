"""The reaper: drives every unfinished batch to a terminal status when nothing else would.

Runs in each worker's background (one reaper acts per interval, under a Redis lock) and as
`sluice reaper run`. Each pass first lets rq retry (or fail) jobs whose worker stopped heartbeating, as a
worker's maintenance would, so nothing waits for a worker to come back; then, for every batch not yet done:
- `validating` longer than SLUICE_VALIDATING_TIMEOUT (its producer died): `failed`;
- past its completion window: queued shards are dropped, so it ends `expired` with what ran;
- a shard job dequeued by a worker that died before rq recorded it (in no queue, no registry): re-enqueued;
- all shards ended but the batch is not done (finalize lost, stuck, failed for good): finalized here;
  when that fails too and rq has no retry left for it, the batch ends `failed` (`cancelled` if cancelling).
A condition must hold on two passes an interval apart before the reaper acts, so it never races a live worker.
Each pass also deletes the output and error files of done batches whose `output_expires_after` has come, with
the copy of their input stored beside them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import redis
import typer

from sluice.contract.batch import INDEX, BatchStore, batch_key
from sluice.contract.jobs import QUEUES, finalize_job_id, shard_job_id
from sluice.contract.queues import drop_unclaimed, fetch, job_status
from sluice.contract.redis_conn import connect
from sluice.contract.retention import due_output_expiry, forget_output_expiry
from sluice.contract.schemas import Batch, BatchStatus
from sluice.contract.settings import Settings, get_settings
from sluice.contract.shards import input_key
from sluice.contract.storage import open_output
from sluice.worker import rq_jobs
from sluice.worker.finalize import finalize
from sluice.worker.terminal import fail_batch

log = logging.getLogger(__name__)
LOCK = "sluice:reaper:lock"
SEEN = "sluice:reaper:seen:"
ENDED = {"finished", "failed", "canceled", "stopped", None}
PAGE = 500


class Reaper:
    """One pass at a time over the unfinished batches (see the module docstring)."""

    def __init__(self, connection: redis.Redis, settings: Settings) -> None:
        self.connection = connection
        self.settings = settings
        self.interval = self.settings.reaper_interval
        self.store = BatchStore(connection)
        self.name = uuid.uuid4().hex

    def run_once(self) -> Counter:
        """One pass, unless another reaper made one less than an interval ago; returns what it did."""
        report: Counter = Counter()
        if not self.connection.set(LOCK, self.name, nx=True, px=max(1, int(self.interval * 900))):
            return report
        rq_jobs.clean_abandoned(self.connection, QUEUES)
        for batch in self.unfinished():
            try:
                self.reap(batch, report)
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception:
                log.exception("reaper: batch %s", batch.id)
        deleted = self.delete_due_outputs()
        if deleted:
            report["outputs_deleted"] += deleted
        if report:
            log.info("reaper: %s", dict(report))
        return report

    def delete_due_outputs(self) -> int:
        """Delete the files (output, errors, shard outputs, stored input) of the done batches whose output
        expiry has come; returns how many batches lost theirs."""
        deleted = 0
        for batch_id in due_output_expiry(self.connection, time.time()):
            batch = self.store.get(batch_id)
            if batch is not None and not batch.done:
                continue  # deleted once it is done and its files are written
            if batch is not None:
                self.delete_outputs(batch)
                deleted += 1
            forget_output_expiry(self.connection, batch_id)
        return deleted

    def delete_outputs(self, batch: Batch) -> None:
        """Remove a batch's files from storage and their locations from its record."""
        storage = open_output(batch.output_url, self.settings.output_root_urls(),
                              s3_style=self.settings.s3_addressing_style)  # fmt: skip
        files = [f"{batch.id}/output.jsonl", f"{batch.id}/errors.jsonl", input_key(batch.id),
                 *storage.keys(f"{batch.id}/shards/")]  # fmt: skip
        for key in files:
            storage.delete(key)

        def forget(b: Batch) -> None:
            b.output_file = b.error_file = None

        self.store.update(batch.id, forget)

    def unfinished(self) -> Iterator[Batch]:
        ids = [i for i, _ in self.connection.zscan_iter(INDEX)]
        for start in range(0, len(ids), PAGE):
            chunk = ids[start : start + PAGE]
            for raw in self.connection.mget([batch_key(i.decode()) for i in chunk]):
                if raw is not None:
                    batch = Batch.model_validate_json(raw)
                    if not batch.done:
                        yield batch

    def reap(self, batch: Batch, report: Counter) -> None:
        """Move one batch on, if it is stuck."""
        now = time.time()
        if batch.status == BatchStatus.validating:
            if now - batch.created_at > self.settings.validating_timeout:
                self.fail(batch.id, "validation_interrupted",
                          "the batch was still validating; its producer stopped")
                report["validating_failed"] += 1
            return
        shard_ids = [shard_job_id(batch.id, n) for n in range(batch.num_shards)]
        expired = batch.expires_at is not None and now > batch.expires_at
        if batch.status == BatchStatus.in_progress and expired:
            if self.seen(batch.id, "expired"):
                report["shards_expired"] += drop_unclaimed(self.connection, batch.id, batch.num_shards)
        shards = fetch(self.connection, shard_ids)
        for job in shards:
            if job is not None and rq_jobs.lost(self.connection, job) and self.seen(job.id, "lost"):
                rq_jobs.requeue(self.connection, job)
                report["shards_requeued"] += 1
        final = fetch(self.connection, [finalize_job_id(batch.id)])[0]
        ended = all(job_status(j) in ENDED for j in shards)
        if ended and job_status(final) != "started" and self.seen(batch.id, "unfinalized"):
            self.finalize(batch, final, report)

    def finalize(self, batch: Batch, final: object, report: Counter) -> None:
        try:
            finalize(self.connection, batch.id, self.settings)
            report["finalized"] += 1
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:
            log.warning("reaper: finalizing %s failed: %s", batch.id, exc)
            if job_status(final) in ENDED:
                self.fail(batch.id, "finalize_failed", f"the batch could not be finalized: {exc}")
                report["finalize_failed"] += 1

    def seen(self, subject: str, condition: str) -> bool:
        """True when condition was already seen for subject at least one interval ago (the first call marks
        it)."""
        key = f"{SEEN}{condition}:{subject}"
        if self.connection.set(key, time.time(), nx=True, ex=max(1, int(self.interval * 4))):
            return False
        first = float(self.connection.get(key) or time.time())
        return time.time() - first >= self.interval

    def fail(self, batch_id: str, code: str, message: str) -> None:
        """End the batch as failed (cancelled when it was being cancelled), the reason in its errors."""
        fail_batch(self.connection, batch_id, code, message, self.settings)


reaper_app = typer.Typer(help="The reaper: drives stuck batches to a terminal status.")


@reaper_app.command("run")
def run_command(
    redis_url: str = typer.Option(None, help="Redis URL (default: $SLUICE_REDIS_URL)."),
    interval: float = typer.Option(None,
                                   help="Seconds between passes (default $SLUICE_REAPER_INTERVAL, 30)."),
    once: bool = typer.Option(False, "--once", help="One pass, then exit."),
) -> None:
    """Run the reaper (any number may share one Redis; one acts per interval)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    if interval is not None:
        settings.reaper_interval = interval
    reaper = Reaper(connect(redis_url or settings.redis_url), settings)
    while True:
        report = reaper.run_once()
        if once:
            typer.echo(json.dumps(dict(report)))
            return
        time.sleep(reaper.interval)
