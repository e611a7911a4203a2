"""The finalize job: merge shard outputs into output.jsonl / errors.jsonl, one line per custom_id; final
status."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis
from rq import get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore, TransitionError, progress_key
from sluice.contract.events import notify
from sluice.contract.jobs import shard_job_id
from sluice.contract.redis_conn import connect, wait_for_replica
from sluice.contract.schemas import Batch, BatchStatus, LineError, OutputRecord, RequestCounts
from sluice.contract.settings import Settings, WebhookSettings, get_settings
from sluice.contract.shards import shard_requests
from sluice.contract.storage import OutputNotAllowed, Storage, object_lines, open_output
from sluice.worker.faults import faults
from sluice.worker.lease import attempt_key, committed_token
from sluice.worker.responses import ABORT_CODES, error_record
from sluice.worker.shard_run import shard_key
from sluice.worker.terminal import OUTPUT_NOT_ALLOWED, fail_batch

MISSING = {JobStatus.CANCELED: "batch_cancelled", JobStatus.FAILED: "shard_failed"}


class ShardLost(LookupError):
    """A shard that wrote no output and has no rq job either: its requests are unknown (submit was cut
    short)."""


def shard_records(
    storage: Storage,
    connection: redis.Redis,
    batch_id: str,
    shard: int,
    expired: bool = False,
    failed_shards: list[int] | None = None,
) -> Iterator[OutputRecord]:
    """The records the shard's committed attempt wrote, read a line at a time, or, when none committed
    (dropped, failed), an error per request; ShardLost when neither its output nor its job exists."""
    token = committed_token(connection, batch_id, shard)
    key = shard_key(batch_id, shard) if token is None else attempt_key(batch_id, shard, token)
    if storage.exists(key):
        for line in object_lines(storage, key):
            yield OutputRecord.model_validate_json(line)
        return
    try:
        job = Job.fetch(shard_job_id(batch_id, shard), connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        raise ShardLost(shard) from None
    code = MISSING.get(job.get_status(), "shard_missing")
    if code == "batch_cancelled" and expired:
        code = "batch_expired"
    if code == "shard_failed" and failed_shards is not None:
        failed_shards.append(shard)
    message = ABORT_CODES.get(code) or f"shard {shard} produced no output ({job.get_status()})"
    for request in shard_requests(storage, job.args[2]):
        yield request.answer() or error_record(request.custom_id, code, message)


@dataclass
class Merged:
    """What streaming a batch's records taught: counts, lost shards, expiry, and the record of a batch of
    one."""

    completed: int = 0
    failed: int = 0
    expired: int = 0
    lost: list[int] = field(default_factory=list)
    failed_shards: list[int] = field(default_factory=list)
    first: OutputRecord | None = None

    def add(self, record: OutputRecord) -> None:
        """Count one record (each custom_id is added once)."""
        if record.error is None:
            self.completed += 1
        else:
            self.failed += 1
            self.expired += record.error.code == "batch_expired"
        if self.first is None:
            self.first = record


def merge(storage: Storage, connection: redis.Redis, batch: Batch, merged: Merged) -> Iterator[OutputRecord]:
    """Every shard's records in shard (input) order, each custom_id once, counted into merged as they pass.

    Only the ids seen so far are kept, never the records, so memory does not grow with the outputs."""
    seen: set[str] = set()
    expired = is_expired(batch)
    for shard in range(batch.num_shards):
        try:
            for record in shard_records(storage, connection, batch.id, shard, expired, merged.failed_shards):
                if record.custom_id not in seen:
                    seen.add(record.custom_id)
                    merged.add(record)
                    yield record
        except ShardLost:
            merged.lost.append(shard)


def is_expired(batch: Batch) -> bool:
    """Past its completion window and not being cancelled: its unrun requests count as expired."""
    return (
        batch.status != BatchStatus.cancelling
        and batch.expires_at is not None
        and time.time() > batch.expires_at
    )


def closed(connection: redis.Redis, batch_id: str) -> bool:
    """Whether the batch has ended (or is gone): its files are written once and never again."""
    batch = BatchStore(connection).get(batch_id)
    return batch is None or batch.done


Written = tuple[str, str | None, Merged]


def write_outputs(storage: Storage, connection: redis.Redis, batch: Batch) -> Written | None:
    """Stream the merged records into output.jsonl and errors.jsonl (the latter only when there are errors);
    neither file changes unless every record was written, nor once the batch has ended (None)."""
    merged = Merged()
    with (
        storage.writer(f"{batch.id}/output.jsonl") as good,
        storage.writer(f"{batch.id}/errors.jsonl") as bad,
    ):
        for record in merge(storage, connection, batch, merged):
            (good if record.error is None else bad).write(record.model_dump_json().encode() + b"\n")
        if closed(connection, batch.id):
            return None  # another finalizer ended the batch meanwhile: its files are not written again
        output_file = good.commit()
        error_file = bad.commit() if merged.failed else None
    return output_file, error_file, merged


def write_or_fail(connection: redis.Redis, batch: Batch,
                  settings: Settings) -> tuple[str, str | None, Merged] | None:
    """write_outputs, or None when this worker may not write the output (outside the settings' output roots,
    not writable): the batch is then failed for good (no retry, no reaper loop)."""
    try:
        storage = open_output(batch.output_url, settings.output_root_urls(),
                              s3_style=settings.s3_addressing_style)
        return write_outputs(storage, connection, batch)
    except (OutputNotAllowed, PermissionError) as exc:
        fail_batch(connection, batch.id, OUTPUT_NOT_ALLOWED,
                   f"the batch's output could not be written: {exc}", settings)
        return None


def final_status(batch: Batch, merged: Merged) -> BatchStatus:
    """cancelled when cancelling; failed when a shard was lost, or when shards failed for good and no request
    completed; expired when a request expired; else completed."""
    if batch.status == BatchStatus.cancelling:
        return BatchStatus.cancelled
    if merged.lost or (merged.failed_shards and not merged.completed):
        return BatchStatus.failed
    if merged.expired:
        return BatchStatus.expired
    return BatchStatus.completed


def batch_errors(batch: Batch, merged: Merged) -> list[LineError]:
    """Why a batch did not run all its requests, as batch-level errors (the error file has the per-request
    ones)."""
    errors = []
    if merged.lost:
        message = (f"shards {merged.lost} were never enqueued (the submit stopped part way); their requests "
                   "are in neither file")
        errors.append(LineError(code="shards_lost", message=message))
    if merged.failed_shards:
        message = (
            f"shards {merged.failed_shards} failed on every attempt (see the workers' logs); their requests "
            "are in the error file with code shard_failed"
        )
        errors.append(LineError(code="shard_failed", message=message))
    if merged.expired:
        message = (
            f"the completion window ({batch.completion_window}) ended before {merged.expired} requests ran; "
            "they are in the error file with code batch_expired"
        )
        errors.append(LineError(code="batch_expired", message=message))
    return errors


def finalize_batch(batch_id: str) -> dict[str, int]:
    """The rq job run once all shards ended (retried with backoff when it raises); the job's entry point, it
    reads Settings once."""
    settings, job = get_settings(), get_current_job()
    connection = job.connection if job else connect(settings.redis_url)
    return finalize(connection, batch_id, settings)


def finalize(connection: redis.Redis, batch_id: str, settings: Settings) -> dict[str, int]:
    """Merged files, counts, final status, then the webhook; a no-op for a batch already done (or ended by
    someone else meanwhile: a second finalize, the reaper). The output must lie inside the settings' roots."""
    store = BatchStore(connection)
    batch = store.get(batch_id)
    if batch is None or batch.done:
        return {}
    if batch.status == BatchStatus.in_progress:
        try:
            batch = store.transition(batch_id, BatchStatus.finalizing)
        except TransitionError:
            batch = store.get(batch_id)
            if batch is None or batch.done:
                return {}
    faults(settings).before_finalize()
    written = write_or_fail(connection, batch, settings)
    if written is None:
        return {}
    output_file, error_file, merged = written

    def close(b: Batch) -> None:
        b.output_file, b.error_file = output_file, error_file
        total = b.request_counts.total
        failed = total - merged.completed if merged.lost else merged.failed
        b.request_counts = RequestCounts(total=total, completed=merged.completed, failed=failed)
        b.errors = [*b.errors, *batch_errors(b, merged)]

    try:
        batch = store.transition(batch_id, final_status(store.get(batch_id) or batch, merged), close)
    except TransitionError:
        batch = store.get(batch_id)
        if batch is None or batch.done:
            return {}
        raise
    wait_for_replica(connection)  # the final status survives a failover before the webhook announces it
    # counts are final
    connection.delete(progress_key(batch_id, "completed"), progress_key(batch_id, "failed"))
    announce_batch(connection, batch, merged, WebhookSettings.of(settings))
    return batch.request_counts.model_dump()


def announce_batch(connection: redis.Redis, batch: Batch, merged: Merged, hooks: WebhookSettings) -> None:
    """The batch's webhook event, if it asked for one, with the record of a batch of one request."""
    if batch.webhook:
        one = merged.first is not None and merged.completed + merged.failed == 1
        single = merged.first.model_dump(mode="json") if one else None
        notify(connection, batch, result=single, settings=hooks)
