"""The fleet as Redis shows it: queue depths, started/failed registries, live rq workers, batches by
status."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis
from rq import Queue, Worker
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.batch import INDEX, batch_key
from sluice.contract.jobs import MODELS, QUEUES, shard_job_id
from sluice.contract.rq_adapter import read_origin_and_status
from sluice.contract.schemas import Batch, BatchStatus


@dataclass
class QueueState:
    """One rq queue: jobs waiting, running (claimed) and failed."""

    name: str
    queued: int
    started: int
    failed: int


@dataclass
class WorkerState:
    """One live rq worker."""

    name: str
    state: str
    queues: str
    busy_for: float | None
    successful: int
    failed: int


def queues(connection: redis.Redis) -> list[QueueState]:
    """Depth and registries of every batch queue."""
    out = []
    for name in QUEUES:
        queue = Queue(name, connection=connection, serializer=JSONSerializer)
        started = StartedJobRegistry(name, connection=connection)
        failed = FailedJobRegistry(name, connection=connection)
        out.append(QueueState(name, queue.count, started.count, failed.count))
    return out


def project_queues(connection: redis.Redis, batches: list[Batch], chunk: int = 500) -> list[QueueState]:
    """Per queue, the shards of these (one project's) batches that wait, run or failed: no other tenant's.
    Reads only each job's status and queue fields, never its arguments (the prompts)."""
    counts = {name: QueueState(name, 0, 0, 0) for name in QUEUES}
    ids = [shard_job_id(b.id, n) for b in batches if not b.done for n in range(b.num_shards)]
    column = {"queued": "queued", "scheduled": "queued", "deferred": "queued", "started": "started",
              "failed": "failed"}
    for start in range(0, len(ids), chunk):
        with connection.pipeline(transaction=False) as pipe:
            for job_id in ids[start : start + chunk]:
                read_origin_and_status(pipe, job_id)
            for origin, status in pipe.execute():
                state = counts.get((origin or b"").decode())
                field = column.get((status or b"").decode())
                if state is not None and field is not None:
                    setattr(state, field, getattr(state, field) + 1)
    return list(counts.values())


def capacity(connection: redis.Redis) -> tuple[int, list[str]]:
    """How many workers are live and the models they announced (nothing about what they run)."""
    models = sorted(m.decode() for m in connection.hkeys(MODELS))
    return Worker.count(connection=connection), models


def workers(connection: redis.Redis) -> list[WorkerState]:
    """The workers that heartbeat into Redis."""
    out = []
    for w in Worker.all(connection=connection, serializer=JSONSerializer):
        since = w.last_heartbeat.timestamp() if w.get_state() == "busy" and w.last_heartbeat else None
        out.append(
            WorkerState(
                w.name,
                w.get_state(),
                ",".join(w.queue_names()),
                None if since is None else max(0.0, time.time() - since),
                w.successful_job_count,
                w.failed_job_count,
            )
        )
    return sorted(out, key=lambda w: w.name)


def batches_by_status(connection: redis.Redis, chunk: int = 500) -> dict[str, int]:
    """How many batches are in each status (every status listed, zeros included)."""
    counts = dict.fromkeys((s.value for s in BatchStatus), 0)
    ids = connection.zrange(INDEX, 0, -1)
    for start in range(0, len(ids), chunk):
        for raw in connection.mget([batch_key(i.decode()) for i in ids[start : start + chunk]]):
            if raw is not None:
                counts[json.loads(raw)["status"]] += 1
    return counts
