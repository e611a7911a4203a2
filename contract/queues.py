"""The batch's rq queues and jobs as both sides see them: JSON-serialized queues, fetching jobs, cancelling
the shards no worker has claimed (a producer's cancel, a worker's fail or expiry)."""

from __future__ import annotations

import json
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.jobs import finalize_job_id, shard_job_id

UNCLAIMED = ("queued", "deferred", "scheduled")


class RawJSON:
    """A list whose items are already JSON (the producer's validated requests): a job's data takes them as
    they are, so a request is serialized once on its way into Redis, not parsed and dumped again."""

    def __init__(self, items: list[bytes]) -> None:
        self.items = items

    def __repr__(self) -> str:
        return f"RawJSON({len(self.items)} items)"


class RawJSONSerializer(JSONSerializer):
    """rq's JSON serializer that writes RawJSON lists verbatim; what it writes is plain JSON, read back by
    JSONSerializer."""

    @staticmethod
    def dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        raws: list[RawJSON] = []

        def placeholder(value: Any) -> str:
            if not isinstance(value, RawJSON):
                raise TypeError(f"{type(value).__name__} is not JSON serializable")
            raws.append(value)
            return f"\0raw{len(raws) - 1}\0"

        text = json.dumps(obj, *args, default=placeholder, **kwargs).encode()
        for i, raw in enumerate(raws):
            text = text.replace(b'"\\u0000raw%d\\u0000"' % i, b"[" + b",".join(raw.items) + b"]", 1)
        return text


def queue_for(connection: redis.Redis, name: str) -> Queue:
    """An rq queue that (de)serializes jobs as JSON, never pickle (RawJSON arguments written as they are)."""
    return Queue(name, connection=connection, serializer=RawJSONSerializer)


def fetch(connection: redis.Redis, job_ids: list[str]) -> list[Job | None]:
    """The jobs with these ids (None for those gone), read with the JSON serializer."""
    return Job.fetch_many(job_ids, connection=connection, serializer=JSONSerializer)


def job_status(job: Job | None) -> str | None:
    """rq's status of a fetched job as a plain string ('queued', 'started', 'finished', ...)."""
    return None if job is None else str(job.get_status(refresh=False).value)


def drop_unclaimed(connection: redis.Redis, batch_id: str, num_shards: int) -> int:
    """Cancel the batch's shards no worker has claimed yet and return how many; the finalize job (if the
    submit got to enqueue it) stops waiting for them.

    Last shard first: a shard waiting on an earlier one (sharding.enqueue's window) is cancelled before that
    one, so cancelling the earlier shard never puts it in the queue."""
    [finalize] = fetch(connection, [finalize_job_id(batch_id)])
    dropped = 0
    for job in reversed(fetch(connection, [shard_job_id(batch_id, n) for n in range(num_shards)])):
        if job is not None and take_unclaimed(connection, job):
            if finalize is not None:
                connection.srem(finalize.dependencies_key, job.id)
            job.cancel(enqueue_dependents=True)
            dropped += 1
    return dropped


def take_unclaimed(connection: redis.Redis, job: Job) -> bool:
    """Take a shard job no worker has claimed out of reach of every worker; False when a worker got it first.

    The status read a moment ago may be stale: a worker claims a queued job by moving its id out of the
    queue's list in one Redis command, so removing the id from that list (or from the scheduled registry, for
    a retry waiting out its backoff) is what decides who has it. A job cancelled after a worker took it would
    run with no shard output and no dependency left for the finalize job to wait on. A deferred shard (waiting
    on an earlier one of its batch) is first taken off that one's dependents, so its ending can no longer
    enqueue it; its status read again then says whether it was enqueued before that."""
    state = job_status(job)
    if state not in UNCLAIMED:
        return False
    if state == "deferred":
        for dependency_id in job.dependency_ids:
            connection.srem(Job.dependents_key_for(dependency_id), job.id)
        state = job.get_status(refresh=True).value
        if state == "deferred":
            return True  # in no queue, and nothing left to put it in one
        if state not in UNCLAIMED:
            return False
    queue = Queue(job.origin, connection=connection, serializer=JSONSerializer)
    if state == "scheduled":
        registry = ScheduledJobRegistry(job.origin, connection=connection, serializer=JSONSerializer)
        if connection.zrem(registry.key, job.id):
            return True
    return bool(connection.lrem(queue.key, 0, job.id))
