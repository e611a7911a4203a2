"""The batch record in Redis: creation, status transitions with timestamps, live counters, listing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import redis

from sluice.contract.quota import TokenQuota
from sluice.contract.schemas import Batch, BatchStatus, RequestCounts

PREFIX = "sluice:batch:"
INDEX = "sluice:batches"
IDEMPOTENCY = "sluice:idempotency:"
S = BatchStatus
TRANSITIONS: dict[BatchStatus, set[BatchStatus]] = {
    S.validating: {S.in_progress, S.failed},
    S.in_progress: {S.finalizing, S.cancelling, S.failed},
    S.cancelling: {S.cancelled},
    S.finalizing: {S.completed, S.failed, S.expired, S.cancelled},
}


class TransitionError(ValueError):
    """A status change the batch lifecycle does not allow."""


def new_batch_id() -> str:
    """A fresh batch id in OpenAI's style (letters, digits, underscore; safe in rq job ids)."""
    return f"batch_{uuid.uuid4().hex}"


def batch_key(batch_id: str) -> str:
    return PREFIX + batch_id


def shards_key(batch_id: str) -> str:
    return PREFIX + batch_id + ":shards"


def progress_key(batch_id: str, outcome: str) -> str:
    return PREFIX + batch_id + ":" + outcome


def cancel_flag_key(batch_id: str) -> str:
    return PREFIX + batch_id + ":cancel"


class BatchStore:
    """Batch records (one JSON value per batch) plus per-shard counts, all in Redis."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection

    def create(self, batch: Batch) -> None:
        """Store a new batch and index it by creation time."""
        with self.connection.pipeline() as pipe:
            pipe.set(batch_key(batch.id), batch.model_dump_json(), nx=True)
            pipe.zadd(INDEX, {batch.id: batch.created_at})
            created, _ = pipe.execute()
        assert created, f"batch {batch.id} already exists"

    def get(self, batch_id: str) -> Batch | None:
        """The batch with live request counts while it runs, None if unknown."""
        raw = self.connection.get(batch_key(batch_id))
        if raw is None:
            return None
        batch = Batch.model_validate_json(raw)
        if not batch.done and batch.status != S.validating:
            completed, failed = self.shard_counts(batch_id)
            live_completed, live_failed = self.live_counts(batch_id)
            completed, failed = max(completed, live_completed), max(failed, live_failed)
            batch.request_counts = RequestCounts(
                total=batch.request_counts.total, completed=completed, failed=failed
            )
        return batch

    def update(self, batch_id: str, change: Callable[[Batch], None]) -> Batch:
        """Apply change to the stored batch atomically (optimistic locking on its key)."""
        key = batch_key(batch_id)
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        raise KeyError(f"no such batch: {batch_id}")
                    batch = Batch.model_validate_json(raw)
                    change(batch)
                    pipe.multi()
                    pipe.set(key, batch.model_dump_json())
                    pipe.execute()
                    return batch
                except redis.WatchError:
                    continue

    def transition(
        self, batch_id: str, status: BatchStatus, change: Callable[[Batch], None] | None = None
    ) -> Batch:
        """Move the batch to status (stamping `{status}_at`), refusing moves the lifecycle forbids."""

        def apply(batch: Batch) -> None:
            if status not in TRANSITIONS.get(batch.status, set()):
                raise TransitionError(
                    f"batch {batch_id} cannot go from {batch.status.value} to {status.value}"
                )
            batch.status = status
            setattr(batch, f"{status.value}_at", time.time())
            if change is not None:
                change(batch)

        batch = self.update(batch_id, apply)
        if batch.done:
            TokenQuota(self.connection).release_batch(batch_id)
        return batch

    def record_shard(
        self, batch_id: str, shard: int, completed: int, failed: int, input_tokens: int = 0,
        output_tokens: int = 0
    ) -> None:
        """Record a finished shard's counts and token usage (idempotent: a re-run shard overwrites its entry)
        and release its enqueued tokens."""
        entry = [completed, failed, input_tokens, output_tokens]
        self.connection.hset(shards_key(batch_id), str(shard), json.dumps(entry))
        TokenQuota(self.connection).release_shard(batch_id, shard)

    def record_progress(self, batch_id: str, completed: list[str], failed: list[str],
                        ttl: int = 7 * 86400) -> None:
        """Count finished requests by custom_id as they finish (a re-run request moves, never counts
        twice)."""
        ok, bad = progress_key(batch_id, "completed"), progress_key(batch_id, "failed")
        with self.connection.pipeline(transaction=True) as pipe:
            for ids, into, out in ((completed, ok, bad), (failed, bad, ok)):
                if ids:
                    pipe.sadd(into, *ids)
                    pipe.srem(out, *ids)
                    pipe.expire(into, ttl)
            pipe.execute()

    def live_counts(self, batch_id: str) -> tuple[int, int]:
        """Completed and failed requests counted as they finished (see record_progress)."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.scard(progress_key(batch_id, "completed"))
            pipe.scard(progress_key(batch_id, "failed"))
            completed, failed = pipe.execute()
        return completed, failed

    def _shard_totals(self, batch_id: str) -> list[int]:
        """[completed, failed, input tokens, output tokens] summed over the shards finished so far (entries
        recorded before usage was, hold only the counts)."""
        totals = [0, 0, 0, 0]
        for raw in self.connection.hvals(shards_key(batch_id)):
            for i, value in enumerate(json.loads(raw)):
                totals[i] += value
        return totals

    def shard_counts(self, batch_id: str) -> tuple[int, int]:
        """Completed and failed requests summed over the shards finished so far."""
        completed, failed, _, _ = self._shard_totals(batch_id)
        return completed, failed

    def shard_usage(self, batch_id: str) -> tuple[int, int]:
        """Input (prompt) and output (completion) tokens summed over the shards finished so far."""
        _, _, input_tokens, output_tokens = self._shard_totals(batch_id)
        return input_tokens, output_tokens

    def list(self, limit: int = 20) -> list[Batch]:
        """The most recent batches, newest first."""
        ids = [i.decode() for i in self.connection.zrevrange(INDEX, 0, limit - 1)]
        return [b for b in (self.get(i) for i in ids) if b is not None]

    def claim_idempotency_key(self, key: str, batch_id: str, ttl: int) -> str | None:
        """Bind key to batch_id unless already bound; return the batch id bound before, if any."""
        full = IDEMPOTENCY + key
        if self.connection.set(full, batch_id, nx=True, ex=ttl):
            return None
        existing = self.connection.get(full)
        return existing.decode() if existing is not None else self.claim_idempotency_key(key, batch_id, ttl)

    def request_cancel(self, batch_id: str) -> None:
        """Flag the batch so that workers abort its running requests."""
        self.connection.set(cancel_flag_key(batch_id), b"1", ex=7 * 86400)

    def cancel_requested(self, batch_ids: list[str]) -> set[str]:
        """Those of batch_ids that have been cancelled."""
        if not batch_ids:
            return set()
        flags = self.connection.mget([cancel_flag_key(b) for b in batch_ids])
        return {b for b, f in zip(batch_ids, flags, strict=True) if f is not None}
