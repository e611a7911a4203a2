"""Ending a batch for good from the worker side: `failed` (or `cancelled` while cancelling), the reason in its
errors."""

from __future__ import annotations

import logging

import redis

from sluice.contract.batch import BatchStore, TransitionError, progress_key
from sluice.contract.events import notify
from sluice.contract.queues import drop_unclaimed
from sluice.contract.schemas import Batch, BatchStatus, LineError, RequestCounts
from sluice.contract.settings import Settings, WebhookSettings
from sluice.contract.storage import OutputNotAllowed, check_output_url, open_storage

log = logging.getLogger(__name__)
OUTPUT_NOT_ALLOWED = "output_not_allowed"


def fail_batch(connection: redis.Redis, batch_id: str, code: str, message: str,
               settings: Settings) -> Batch | None:
    """End the batch as failed (cancelled when it was being cancelled) with the reason in `errors`; its
    queued shards are dropped and running ones aborted; its webhook told (settings' webhook fields). None when
    it was already done."""

    def record(b: Batch) -> None:
        b.errors = [*b.errors, LineError(code=code, message=message)]
        b.request_counts = RequestCounts(total=b.request_counts.total, failed=b.request_counts.total)

    store = BatchStore(connection)
    batch = store.get(batch_id)
    if batch is None or batch.done:
        return None
    status = BatchStatus.cancelled if batch.status == BatchStatus.cancelling else BatchStatus.failed
    try:
        batch = store.transition(batch_id, status, record)
    except TransitionError:
        return None
    store.request_cancel(batch_id)  # workers abort whatever of it still runs
    connection.delete(progress_key(batch_id, "completed"), progress_key(batch_id, "failed"))
    drop_unclaimed(connection, batch_id, batch.num_shards)
    log.warning("batch %s %s: %s: %s", batch_id, batch.status.value, code, message)
    if batch.webhook:
        notify(connection, batch, settings=WebhookSettings.of(settings))
    return batch


def output_problem(url: str, roots: list[str], s3_style: str) -> str | None:
    """Why this process may not write a batch's output at url (outside roots, not writable), or None."""
    try:
        storage = open_storage(check_output_url(url, roots), s3_style=s3_style)
    except (OutputNotAllowed, ValueError) as exc:
        return f"this worker may not write the batch's output: {exc}"
    try:
        storage.check_writable()
    except PermissionError as exc:
        return f"this worker may not write the batch's output {url!r}: {exc}"
    except Exception:  # transient (network, throttling): the shard's own writes retry as usual
        log.warning("could not check the batch's output %s; running the shard", url, exc_info=True)
    return None
