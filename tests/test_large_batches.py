"""Large batches in bounded memory, against a real redis-server (and moto's S3 server): the input is validated
as a stream and stored once, a shard job carries only its slice, the worker reads the slice from storage,
finalize merges the shard outputs as a stream."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore
from sluice.contract.jobs import shard_job_id
from sluice.contract.schemas import OutputRecord, Response
from sluice.contract.settings import Settings
from sluice.contract.shards import input_key
from sluice.contract.storage import open_storage
from sluice.producer import BatchStatus, Client
from sluice.worker.finalize import finalize
from sluice.worker.shard_run import ShardRun, records_jsonl, shard_key

MiB = 1024 * 1024


def completion(i: int, pad: int = 0) -> dict:
    body = {"prompt": f"the quick brown fox {i}", "max_tokens": 2, "temperature": 0}
    if pad:
        body["metadata"] = {"pad": "x" * pad}  # real bytes no tokenizer reads
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}


def job(client: Client, batch_id: str, n: int) -> Job:
    return Job.fetch(shard_job_id(batch_id, n), connection=client.connection, serializer=JSONSerializer)


def test_a_shard_jobs_redis_footprint_does_not_grow_with_its_lines(redis_url, tmp_path):
    client = Client(redis_url)
    small = client.submit_batch([completion(i) for i in range(10)], output=tmp_path.as_uri(), shard_size=5000)
    large = client.submit_batch([completion(i, 500) for i in range(2000)], output=tmp_path.as_uri(),
                                shard_size=5000)  # fmt: skip
    assert (small.num_shards, large.num_shards) == (1, 1)
    footprint = [client.connection.memory_usage(Job.key_for(shard_job_id(b.id, 0))) for b in (small, large)]
    assert abs(footprint[1] - footprint[0]) < 64, f"job hash bytes {footprint}: a slice, whatever its lines"
    stored = open_storage(tmp_path.as_uri()).get(input_key(large.id))
    assert len(stored.splitlines()) == 2000 and len(stored) > 1 * MiB
    info = client.connection.info("memory")["used_memory"]
    assert info < 8 * MiB, "the megabyte of requests is in storage, not Redis"


def test_a_batch_whose_input_cannot_be_stored_fails_at_submit(redis_url, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    client = Client(redis_url)
    batch = client.submit_batch([completion(i) for i in range(3)], output=(blocker / "out").as_uri())
    assert batch.status == BatchStatus.failed and batch.errors[0].code == "enqueue_failed"
    message = batch.errors[0].message
    assert "cannot write the batch's input" in message and str(blocker) in message
    assert client.connection.keys("rq:job:*") == [], "nothing enqueued"


def test_the_worker_reads_its_slice_from_storage(redis_url, tmp_path):
    client = Client(redis_url)
    lines = [completion(i) for i in range(7)]
    batch = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=3)
    assert batch.num_shards == 3
    runs = [ShardRun.from_args(f"j{n}", job(client, batch.id, n).args) for n in range(3)]
    assert all(run.requests == [] for run in runs), "nothing read before load()"
    for run in runs:
        run.load(BatchStore(client.connection), client.settings)
    read = [[r.custom_id for r in run.requests] for run in runs]
    assert read == [["c0", "c1", "c2"], ["c3", "c4", "c5"], ["c6"]]
    assert runs[1].requests[0].body == lines[3]["body"]
    open_storage(tmp_path.as_uri()).delete(input_key(batch.id))
    again = ShardRun.from_args("j0", job(client, batch.id, 0).args)
    with pytest.raises(FileNotFoundError):
        again.load(BatchStore(client.connection), client.settings)


def test_a_slice_is_read_with_a_ranged_get_from_s3(redis_url, s3_server, s3_bucket):
    client = Client(redis_url)
    batch = client.submit_batch([completion(i, 100) for i in range(5)], output=f"s3://{s3_bucket}/out",
                                shard_size=2)  # fmt: skip
    run = ShardRun.from_args("j", job(client, batch.id, 2).args)
    run.load(BatchStore(client.connection), client.settings)
    assert [r.custom_id for r in run.requests] == ["c4"]
    assert run.requests[0].body["metadata"]["pad"] == "x" * 100


def submit_traced(client: Client, path, lines: int, pad: int) -> tuple[int, int]:
    """Submit a file of `lines` padded requests; returns its size and the peak Python memory of the submit."""
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps(completion(i, pad)) + "\n")
    tracemalloc.start()
    try:
        batch = client.submit_batch(str(path), output=path.parent.as_uri())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch.status == BatchStatus.in_progress and batch.request_counts.total == lines
    return path.stat().st_size, peak


def test_validation_streams_the_input_without_holding_it(redis_url, tmp_path):
    client = Client(redis_url)
    small_size, small_peak = submit_traced(client, tmp_path / "small.jsonl", 1000, 2000)
    large_size, large_peak = submit_traced(client, tmp_path / "large.jsonl", 5000, 2000)
    grown = large_peak - small_peak
    assert large_size - small_size > 8 * MiB and grown < (large_size - small_size) / 10, (
        f"peak {small_peak} -> {large_peak} bytes for inputs of {small_size} -> {large_size}"
    )


def test_finalize_merges_shard_outputs_as_a_stream(redis_url, tmp_path):
    client = Client(redis_url)
    shards, per_shard = 30, 100
    batch = client.submit_batch([completion(i) for i in range(shards * per_shard)], output=tmp_path.as_uri(),
                                shard_size=per_shard)  # fmt: skip
    storage = open_storage(tmp_path.as_uri())
    for n in range(shards):
        records = [
            OutputRecord(id=f"batch_req_{i}", custom_id=f"c{i}",
                         response=Response(status_code=200, request_id=f"r{i}", body={"text": "y" * 3000}))
            for i in range(n * per_shard, (n + 1) * per_shard)
        ]  # fmt: skip
        storage.put(shard_key(batch.id, n), records_jsonl(records))
        BatchStore(client.connection).record_shard(batch.id, n, per_shard, 0)
    total = sum(storage.size(shard_key(batch.id, n)) for n in range(shards))
    tracemalloc.start()
    try:
        counts = finalize(client.connection, batch.id, Settings())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counts["completed"] == shards * per_shard and client.get(batch.id).status == BatchStatus.completed
    output = [json.loads(line)["custom_id"] for line in storage.get(f"{batch.id}/output.jsonl").splitlines()]
    assert output == [f"c{i}" for i in range(shards * per_shard)]
    assert total > 8 * MiB and peak < total / 4, f"peak {peak} bytes merging {total}"
