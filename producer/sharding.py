"""The batch's validated input streamed once into storage and cut into shard slices; the shard jobs (rq, JSON
serializer) that carry only those slices, chained so that batches share the queue; the finalize job."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from rq import Queue, Retry
from rq.job import Dependency

from sluice.contract.jobs import FINALIZE, RUN_SHARD, finalize_job_id, shard_job_id
from sluice.contract.queues import queue_for
from sluice.contract.schemas import Batch, BatchRequest
from sluice.contract.settings import Settings
from sluice.contract.shards import InputSlice, estimate_tokens, input_key
from sluice.contract.storage import ObjectWriter, Storage

ENQUEUE_GROUP = 500  # shard jobs written to Redis per round trip


class InputSpool:
    """Validated requests streamed into `{batch_id}/input.jsonl` (compact JSON, one a line), cut into slices
    of at most shard_size requests and max_bytes bytes as they pass; nothing is kept but the slices' bounds.

    A context manager: nothing is published under the key unless commit() is called.
    """

    def __init__(self, storage: Storage, batch_id: str, shard_size: int, max_bytes: int) -> None:
        assert shard_size > 0, "shard_size must be positive"
        self.key = input_key(batch_id)
        self.writer: ObjectWriter = storage.writer(self.key)
        self.shard_size, self.max_bytes = shard_size, max_bytes
        self.slices: list[InputSlice] = []
        self.count = 0
        self._start = self._end = self._in_slice = 0

    def append(self, request: BatchRequest) -> None:
        """Write one validated request, starting a new slice when this one is full."""
        data = request.model_dump_json().encode() + b"\n"
        full = self._in_slice == self.shard_size or self._end - self._start + len(data) > self.max_bytes
        if self._in_slice and full:
            self._close_slice()
        self.writer.write(data)
        self._end += len(data)
        self._in_slice += 1
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def _close_slice(self) -> None:
        size = self._end - self._start
        tokens = estimate_tokens(size)
        self.slices.append(InputSlice(self.key, self._start, self._end, self._in_slice, tokens))
        self._start, self._in_slice = self._end, 0

    def cut(self) -> list[InputSlice]:
        """Close the last slice; returns every slice."""
        if self._in_slice:
            self._close_slice()
        return self.slices

    def commit(self) -> list[InputSlice]:
        """Publish the input under its key; returns the slices."""
        slices = self.cut()
        self.writer.commit()
        return slices

    def __enter__(self) -> InputSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.discard()


def retry_policy(retries: int, settings: Settings) -> Retry | None:
    """rq retries with backoff (SLUICE_RETRY_BACKOFF seconds, the last one repeated)."""
    return Retry(max=retries, interval=list(settings.retry_backoff)) if retries else None


def enqueue(connection: redis.Redis, batch: Batch, slices: Sequence[InputSlice], settings: Settings) -> int:
    """Enqueue one job per slice and a finalize job depending on all of them; return the shard count.

    Fair share: only the first SLUICE_SHARD_WINDOW shards go to the queue now; shard n waits on shard
    n - window (an rq dependency that a failure or cancellation also ends), so each shard that ends puts its
    batch's next one at the back of the queue, behind the shards of batches submitted since. A batch thus has
    at most `window` shards queued or running at once, and batches of one priority take turns, a shard each.
    """
    queue = queue_for(connection, batch.priority)
    retry = retry_policy(settings.shard_retries, settings)
    window = settings.shard_window
    jobs = [
        Queue.prepare_data(
            RUN_SHARD,
            args=(batch.id, n, piece.arg()),
            job_id=shard_job_id(batch.id, n),
            description=f"{batch.id} shard {n} ({piece.count} requests)",
            depends_on=None if n < window else Dependency(jobs=[shard_job_id(batch.id, n - window)],
                                                          allow_failure=True),
            timeout=settings.shard_timeout,
            result_ttl=settings.result_ttl,
            failure_ttl=settings.failure_ttl,
            retry=retry,
        )
        for n, piece in enumerate(slices)
    ]
    for start in range(0, len(jobs), ENQUEUE_GROUP):
        queue.enqueue_many(jobs[start : start + ENQUEUE_GROUP])
    enqueue_finalize(queue, batch, len(slices), settings)
    return len(slices)


def enqueue_finalize(queue: Queue, batch: Batch, num_shards: int, settings: Settings) -> None:
    """The batch's finalize job, run once every shard job has ended (failed ones included)."""
    queue.enqueue_call(
        FINALIZE,
        args=(batch.id,),
        job_id=finalize_job_id(batch.id),
        description=f"finalize {batch.id}",
        depends_on=Dependency(jobs=[shard_job_id(batch.id, n) for n in range(num_shards)],
                              allow_failure=True),
        timeout=settings.shard_timeout,
        result_ttl=settings.result_ttl,
        failure_ttl=settings.failure_ttl,
        retry=retry_policy(settings.finalize_retries, settings),
    )
