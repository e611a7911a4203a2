"""The rq side of the contract: queue names, the functions workers run, and the ids of a batch's jobs."""

from __future__ import annotations

QUEUES = ("high", "default", "low")
RUN_SHARD = "sluice.worker.shard_run.run_shard"
# Shard jobs enqueued before worker/shards.py became worker/shard_run.py: `sluice worker` runs them from their
# args like any shard job (it never imports the function), so the shards still queued across an upgrade are
# not refused.
RUN_SHARD_BEFORE_RENAME = "sluice.worker.shards.run_shard"
SHARD_FUNCTIONS = frozenset({RUN_SHARD, RUN_SHARD_BEFORE_RENAME})
FINALIZE = "sluice.worker.finalize.finalize_batch"
MODELS = "sluice:models"  # hash: model name -> unix time a worker last became ready with it


def shard_job_id(batch_id: str, shard: int) -> str:
    """The rq job id of one shard of a batch."""
    return f"{batch_id}-shard-{shard}"


def finalize_job_id(batch_id: str) -> str:
    """The rq job id of a batch's finalize job."""
    return f"{batch_id}-finalize"
