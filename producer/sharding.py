"""Splitting a batch into shards and enqueueing them as rq jobs (JSON serializer), plus the finalize job."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from rq import Queue, Retry
from rq.job import Dependency

from sluice.contract.jobs import FINALIZE, RUN_SHARD, finalize_job_id, shard_job_id
from sluice.contract.queues import RawJSON, queue_for
from sluice.contract.schemas import Batch, Request
from sluice.contract.settings import Settings
from sluice.producer.validation import Requests

PIPELINE_BYTES = 2 * 1024 * 1024


def split(
    requests: Sequence[Request],
    shard_size: int,
    sizes: Sequence[int] | None = None,
    max_bytes: int | None = None,
) -> list[Sequence[Request]]:
    """Consecutive slices of at most shard_size requests and (given their sizes) at most max_bytes each."""
    assert shard_size > 0, "shard_size must be positive"
    if sizes is None or max_bytes is None:
        return [requests[i : i + shard_size] for i in range(0, len(requests), shard_size)]
    chunks, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start == shard_size or used + size > max_bytes):
            chunks.append(requests[start:i])
            start, used = i, 0
        used += size
    if start < len(requests):
        chunks.append(requests[start:])
    return chunks


def retry_policy(retries: int, settings: Settings) -> Retry | None:
    """rq retries with backoff (SLUICE_RETRY_BACKOFF seconds, the last one repeated)."""
    return Retry(max=retries, interval=list(settings.retry_backoff)) if retries else None


def _payload(chunk: Sequence[Request]) -> RawJSON | list[dict]:
    """What a shard job carries: the validated requests' own JSON, as it is (a list of dicts for other input)."""
    return RawJSON(chunk.items) if isinstance(chunk, Requests) else [r.model_dump() for r in chunk]


def enqueue(
    connection: redis.Redis, batch: Batch, chunks: Sequence[Sequence[Request]], settings: Settings
) -> int:
    """Enqueue one job per shard and a finalize job depending on all of them; return the shard count.

    Shards go to Redis in pipelines of about PIPELINE_BYTES, so a large batch is never all in memory as jobs.
    """
    queue = queue_for(connection, batch.priority)
    retry = retry_policy(settings.shard_retries, settings)
    pending, pending_bytes = [], 0
    for n, chunk in enumerate(chunks):
        pending.append(
            Queue.prepare_data(
                RUN_SHARD,
                args=(batch.id, n, _payload(chunk)),
                job_id=shard_job_id(batch.id, n),
                description=f"{batch.id} shard {n} ({len(chunk)} requests)",
                timeout=settings.shard_timeout,
                result_ttl=settings.result_ttl,
                failure_ttl=settings.failure_ttl,
                retry=retry,
            )
        )
        pending_bytes += chunk.nbytes if isinstance(chunk, Requests) else PIPELINE_BYTES
        if pending_bytes >= PIPELINE_BYTES or n == len(chunks) - 1:
            with connection.pipeline() as pipe:
                queue.enqueue_many(pending, pipeline=pipe)
                pipe.execute()
            pending, pending_bytes = [], 0
    enqueue_finalize(queue, batch, len(chunks), settings)
    return len(chunks)


def enqueue_finalize(queue: Queue, batch: Batch, num_shards: int, settings: Settings) -> None:
    """The batch's finalize job, run once every shard job has ended (failed ones included)."""
    queue.enqueue_call(
        FINALIZE,
        args=(batch.id,),
        job_id=finalize_job_id(batch.id),
        description=f"finalize {batch.id}",
        depends_on=Dependency(jobs=[shard_job_id(batch.id, n) for n in range(num_shards)], allow_failure=True),
        timeout=settings.shard_timeout,
        result_ttl=settings.result_ttl,
        failure_ttl=settings.failure_ttl,
        retry=retry_policy(settings.finalize_retries, settings),
    )
