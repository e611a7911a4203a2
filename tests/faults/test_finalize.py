"""Finalize streams: memory bounded by a shard's chunk, not by the batch's outputs; a lost shard (a submit cut
short) fails the batch, through finalize or the reaper, never leaving it stuck or its requests silently
missing."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from sluice.contract.jobs import finalize_job_id, shard_job_id
from sluice.contract.settings import Settings
from sluice.contract.storage import open_storage
from sluice.producer import BatchStatus, Client
from sluice.worker.finalize import finalize
from sluice.worker.reaper import Reaper
from sluice.worker.shard_run import shard_key
from tests.faults.conftest import assert_exactly_once, request

SETTINGS = Settings()


def shard_file(ids: list[str], text_bytes: int, fail: set[str] = frozenset()) -> bytes:
    """A shard's output as a worker writes it: one record per id, responses carrying text_bytes of text."""
    lines = []
    for cid in ids:
        if cid in fail:
            record = {
                "id": f"out_{cid}",
                "custom_id": cid,
                "error": {"code": "engine_error", "message": "boom"},
            }
        else:
            body = {
                "id": f"cmpl_{cid}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x" * text_bytes}],
            }
            record = {
                "id": f"out_{cid}",
                "custom_id": cid,
                "response": {"status_code": 200, "request_id": body["id"], "body": body},
            }
        lines.append(json.dumps(record).encode() + b"\n")
    return b"".join(lines)


def write_shards(batch_id: str, output_url: str, shards: list[list[str]], **kwargs) -> int:
    """Write each shard's output file as a worker would; return the bytes written."""
    storage = open_storage(output_url)
    written = 0
    for n, ids in enumerate(shards):
        data = shard_file(ids, **kwargs)
        storage.put(shard_key(batch_id, n), data)
        written += len(data)
    return written


def test_finalize_memory_stays_bounded_by_a_chunk_not_the_batch(redis_url, tmp_path):
    """2,000 records of 8 KiB (about 16 MiB of output): finalize's traced peak stays under a quarter of it."""
    client = Client(redis_url)
    n, per_shard = 2000, 200
    ids = [f"r{i}" for i in range(n)]
    batch = client.submit_batch(
        [request(i) for i in range(n)], output=tmp_path.as_uri(), shard_size=per_shard
    )
    failing = {"r7", "r1999"}
    shards = [ids[i : i + per_shard] for i in range(0, n, per_shard)]
    total = write_shards(batch.id, tmp_path.as_uri(), shards, text_bytes=8192, fail=failing)
    assert total > 15 * 2**20

    tracemalloc.start()
    try:
        counts = finalize(client.connection, batch.id, SETTINGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert counts == {"total": n, "completed": n - 2, "failed": 2}
    assert peak < total / 4, (
        f"finalize peaked at {peak / 2**20:.1f} MiB for {total / 2**20:.1f} MiB of records"
    )
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed
    assert [r.custom_id for r in client.results(batch.id)] == [i for i in ids if i not in failing], (
        "input order"
    )
    assert assert_exactly_once(client, done, ids) == (n - 2, 2)
    assert not list(tmp_path.glob(f"{batch.id}/.*")), "no temp files left behind"


def test_a_shard_that_was_never_enqueued_fails_the_batch_naming_it(redis_url, tmp_path):
    """A submit SIGKILLed between its shard pipelines leaves shards with no job and no output: finalize must
    not report the batch completed with those requests silently missing."""
    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(4)], output=tmp_path.as_uri(), shard_size=2)
    write_shards(batch.id, tmp_path.as_uri(), [["r0", "r1"]], text_bytes=4)
    for job_id in (shard_job_id(batch.id, 1), finalize_job_id(batch.id)):
        Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer).delete()

    assert finalize(client.connection, batch.id, SETTINGS) == {"total": 4, "completed": 2, "failed": 2}
    done = client.get(batch.id)
    assert done.status == BatchStatus.failed
    assert done.errors[-1].code == "shards_lost" and "[1]" in done.errors[-1].message
    assert [r.custom_id for r in client.results(batch.id)] == ["r0", "r1"]
    assert done.error_file is None


def test_a_failed_output_write_leaves_no_file_and_the_retry_completes(redis_url, tmp_path, monkeypatch):
    client = Client(redis_url)
    batch = client.submit_batch([request(i) for i in range(2)], output=tmp_path.as_uri(), shard_size=2)
    write_shards(batch.id, tmp_path.as_uri(), [["r0", "r1"]], text_bytes=4)

    def broken(self, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched, pytest.raises(OSError, match="No space"):
        patched.setattr("sluice.contract.storage.ObjectWriter.write", broken)
        finalize(client.connection, batch.id, SETTINGS)
    assert client.get(batch.id).status == BatchStatus.finalizing
    assert sorted(p.name for p in (tmp_path / batch.id).iterdir()) == ["input.jsonl", "shards"], (
        "no output, no temp file"
    )
    assert finalize(client.connection, batch.id, SETTINGS)["completed"] == 2
    assert client.get(batch.id).status == BatchStatus.completed


def test_reaper_ends_an_expired_batch_whose_submit_was_cut_short(redis_url, tmp_path):
    """No finalize job and a shard job missing (the submit died between pipelines), then the window passes:
    the reaper still drops the queued shard and ends the batch, `failed` naming the lost shard."""
    client = Client(redis_url)
    batch = client.submit_batch(
        [request(i) for i in range(4)], output=tmp_path.as_uri(), shard_size=2, completion_window="1s"
    )
    for job_id in (shard_job_id(batch.id, 1), finalize_job_id(batch.id)):
        Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer).delete()
    reaper = Reaper(client.connection, Settings(reaper_interval=0.2))
    deadline = time.monotonic() + 20
    while not client.get(batch.id).done and time.monotonic() < deadline:
        reaper.run_once()
        time.sleep(0.25)
    done = client.get(batch.id)
    assert done.status == BatchStatus.failed and [e.code
                                                  for e in done.errors] == ["shards_lost", "batch_expired"]
    assert {r.custom_id: r.error.code for r in client.results(batch.id, errors=True)} == {
        "r0": "batch_expired",
        "r1": "batch_expired",
    }
    assert done.request_counts.failed == 4
