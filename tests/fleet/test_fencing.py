"""Fenced shard commits against a real redis-server: a stale attempt never reaches a batch's files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sluice.contract.batch import BatchStore
from sluice.contract.redis_conn import connect
from sluice.contract.schemas import Batch, BatchRequest, BatchStatus, RequestCounts
from sluice.contract.settings import Settings
from sluice.worker.finalize import finalize
from sluice.worker.lease import Commit, attempt_key, commit, committed_token, lease_key
from sluice.worker.shard_run import LeaseLost, ShardRun


def new_batch(connection, output: Path, batch_id: str = "batch_fence") -> Batch:
    batch = Batch(id=batch_id, status=BatchStatus.in_progress, output_url=output.as_uri(), num_shards=1,
                  created_at=time.time(), request_counts=RequestCounts(total=2))  # fmt: skip
    BatchStore(connection).create(batch)
    return batch


def attempt(batch: Batch, message: str) -> ShardRun:
    """A finished attempt at shard 0 whose two records carry message (no engine needed)."""
    requests = [BatchRequest(custom_id=f"r{i}", url="/v1/completions", body={"prompt": "x"})
                for i in range(2)]
    run = ShardRun(f"{batch.id}-shard-0", batch.id, 0, requests)
    run.fail_all("batch_cancelled", message)
    return run


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_stale_attempt_is_refused_and_finalize_reads_only_the_committed_one(redis_url, tmp_path):
    connection, settings = connect(redis_url), Settings()
    batch = new_batch(connection, tmp_path)
    zombie, rerun = attempt(batch, "from the zombie"), attempt(batch, "from the re-run")
    assert zombie.lease(connection) and rerun.lease(connection)
    assert (zombie.token, rerun.token) == (1, 2), "each attempt takes the next token"
    with pytest.raises(LeaseLost, match="lease_lost"):
        zombie.save(connection, settings)
    assert rerun.save(connection, settings) == {"completed": 0, "failed": 2}
    assert committed_token(connection, batch.id, 0) == 2
    assert sorted(files(tmp_path)) == [attempt_key(batch.id, 0, 2)], "only the committed attempt wrote a file"
    assert not attempt(batch, "a third").lease(connection), "a committed shard is not run again"
    assert finalize(connection, batch.id, settings)["failed"] == 2
    before = files(tmp_path)
    assert b"from the re-run" in before[f"{batch.id}/errors.jsonl"]
    assert b"from the zombie" not in b"".join(before.values())
    # the zombie comes back once more, with a fresh lease even: the batch is closed, nothing changes
    late = attempt(batch, "too late")
    connection.delete(f"sluice:batch:{batch.id}:committed")
    assert late.lease(connection)
    with pytest.raises(LeaseLost, match="batch_closed"):
        late.save(connection, settings)
    assert finalize(connection, batch.id, settings) == {}, "a second finalize is a no-op"
    assert files(tmp_path) == before, "a completed batch's files never change"


def test_commit_is_a_compare_and_set_on_the_current_token(redis_url, tmp_path):
    connection = connect(redis_url)
    batch = new_batch(connection, tmp_path, "batch_cas")
    connection.set(lease_key(batch.id, 0), 5)
    assert commit(connection, batch.id, 0, 4, "[1, 0, 0, 0]") is Commit.lease_lost
    assert commit(connection, batch.id, 0, 5, "[1, 0, 0, 0]") is Commit.ok
    assert commit(connection, batch.id, 0, 5, "[1, 0, 0, 0]") is Commit.ok, "a retried commit is idempotent"
    connection.set(lease_key(batch.id, 0), 6)
    assert commit(connection, batch.id, 0, 6, "[1, 0, 0, 0]") is Commit.committed, "the first commit wins"
    assert BatchStore(connection).shard_counts(batch.id) == (1, 0)
