"""The finalize job: merge shard outputs into output.jsonl / errors.jsonl, one line per custom_id; final status."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from rq import get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from contract.batch import BatchStore, TransitionError
from contract.events import notify
from contract.jobs import shard_job_id
from contract.schemas import Batch, BatchStatus, OutputRecord, Request, RequestCounts
from contract.settings import get_settings
from contract.storage import Storage, open_output
from worker.faults import faults
from worker.responses import ABORT_CODES, error_record
from worker.shards import shard_key

MISSING = {JobStatus.CANCELED: "batch_cancelled", JobStatus.FAILED: "shard_failed"}


def shard_records(
    storage: Storage, connection: redis.Redis, batch_id: str, shard: int, expired: bool = False
) -> Iterator[OutputRecord]:
    """The records a shard wrote or, when it wrote none (dropped, failed), an error per request."""
    key = shard_key(batch_id, shard)
    if storage.exists(key):
        for line in storage.get(key).splitlines():
            yield OutputRecord.model_validate(json.loads(line))
        return
    try:
        job = Job.fetch(shard_job_id(batch_id, shard), connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return
    code = MISSING.get(job.get_status(), "shard_missing")
    if code == "batch_cancelled" and expired:
        code = "batch_expired"
    message = ABORT_CODES.get(code) or f"shard {shard} produced no output ({job.get_status()})"
    for request in job.args[2]:
        yield error_record(Request.model_validate(request).custom_id, code, message)


def merge(storage: Storage, connection: redis.Redis, batch: Batch) -> dict[str, OutputRecord]:
    """Every shard's records keyed by custom_id, so a re-run shard still counts each request once."""
    records: dict[str, OutputRecord] = {}
    for shard in range(batch.num_shards):
        for record in shard_records(storage, connection, batch.id, shard, is_expired(batch)):
            records[record.custom_id] = record
    return records


def is_expired(batch: Batch) -> bool:
    """Past its completion window and not being cancelled: its unrun requests count as expired."""
    return batch.status != BatchStatus.cancelling and batch.expires_at is not None and time.time() > batch.expires_at


def write_jsonl(storage: Storage, key: str, records: list[OutputRecord]) -> str:
    """Write records as JSONL under key through a temp file (multipart upload when large)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        path = Path(f.name)
    try:
        with path.open("wb") as out:
            for record in records:
                out.write(record.model_dump_json().encode() + b"\n")
        return storage.put_file(key, path)
    finally:
        path.unlink(missing_ok=True)


def final_status(batch: Batch, records: dict[str, OutputRecord]) -> BatchStatus:
    if batch.status == BatchStatus.cancelling:
        return BatchStatus.cancelled
    if any(r.error is not None and r.error.code == "batch_expired" for r in records.values()):
        return BatchStatus.expired
    return BatchStatus.completed


def finalize_batch(batch_id: str) -> dict[str, int]:
    """The rq job run once all shards ended (retried with backoff when it raises)."""
    job = get_current_job()
    return finalize(job.connection if job else redis.Redis.from_url(get_settings().redis_url), batch_id)


def finalize(connection: redis.Redis, batch_id: str) -> dict[str, int]:
    """Merged files, counts, final status, then the webhook; a no-op for a batch already done."""
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
    faults().before_finalize()
    storage = open_output(batch.output_url, get_settings().output_root_urls())
    records = merge(storage, connection, batch)
    good = [r for r in records.values() if r.error is None]
    bad = [r for r in records.values() if r.error is not None]
    output_file = write_jsonl(storage, f"{batch_id}/output.jsonl", good)
    error_file = write_jsonl(storage, f"{batch_id}/errors.jsonl", bad) if bad else None

    def close(b: Batch) -> None:
        b.output_file, b.error_file = output_file, error_file
        b.request_counts = RequestCounts(total=b.request_counts.total, completed=len(good), failed=len(bad))

    batch = store.transition(batch_id, final_status(store.get(batch_id) or batch, records), close)
    if batch.webhook:
        single = next(iter(records.values())).model_dump(mode="json") if len(records) == 1 else None
        notify(connection, batch, result=single)
    return batch.request_counts.model_dump()
