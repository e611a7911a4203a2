"""Output retention: when a batch's output and error files are due for deletion (OpenAI's
`output_expires_after`).  A sorted set in Redis holds each batch id with its due time; the reaper deletes the
files of the done batches that are due, and with them the batch's stored input (`{batch_id}/input.jsonl`, a
copy of user data kept with the outputs), so a batch submitted from memory cannot be resumed after that."""

from __future__ import annotations

import redis

OUTPUT_EXPIRY = "sluice:output-expiry"


def schedule_output_expiry(connection: redis.Redis, batch_id: str, due: float) -> None:
    """Delete the batch's output files at `due` (unix seconds)."""
    connection.zadd(OUTPUT_EXPIRY, {batch_id: due})


def due_output_expiry(connection: redis.Redis, now: float, limit: int = 500) -> list[str]:
    """Batch ids whose output files are due for deletion, the oldest due first."""
    return [i.decode() for i in connection.zrangebyscore(OUTPUT_EXPIRY, "-inf", now, start=0, num=limit)]


def forget_output_expiry(connection: redis.Redis, batch_id: str) -> None:
    """Drop the batch from the schedule (its files are gone, or the batch is)."""
    connection.zrem(OUTPUT_EXPIRY, batch_id)
