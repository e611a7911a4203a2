"""End to end: JSONL → Redis (rq) → two worker processes → S3 (moto server); and a worker killed mid-batch."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from sluice.contract.jobs import shard_job_id
from sluice.engine import LLM, SamplingParams
from sluice.producer import BatchStatus, Client
from tests.services import start_worker, stop_worker

pytestmark = pytest.mark.slow
WORDS = "the quick brown fox jumps over the lazy dog to be or not that is question all glitters gold".split()


def make_requests(n: int, seed: int = 0, max_tokens: tuple[int, int] = (1, 8)) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 12))), "temperature": 0}
        body["max_tokens"] = rng.randint(*max_tokens)
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return out


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def s3_jsonl(s3_server, url: str) -> list[dict]:
    bucket, key = url.removeprefix("s3://").split("/", 1)
    body = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return [json.loads(x) for x in body.splitlines()]


def wait_for_workers(client: Client, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(Worker.all(connection=client.connection)) < n:
        assert time.monotonic() < deadline, f"{n} workers did not come up"
        time.sleep(0.1)


def check_bad_batch_fails_at_submit(client: Client, path, output: str) -> None:
    """A file that is not a batch file fails at submit, naming each bad line, its error code and the bad field
    (a bad body alone would be its line's own 400)."""
    bad_lines: list = make_requests(20, seed=1)
    bad_lines[4] = "{oops"
    bad_lines[9] = {k: v for k, v in bad_lines[9].items() if k != "body"}
    bad_lines[14] = {**bad_lines[14], "body": {"prompt": "x", "max_tokens": 0}}
    bad = client.submit_batch(write_jsonl(path, bad_lines), output=output)
    assert bad.status == BatchStatus.failed
    assert [(e.line, e.code) for e in bad.errors] == [(5, "invalid_json"), (10, "invalid_request")]
    assert bad.errors[1].param == "body"


def shard_workers(client: Client, batch_id: str, shards: int) -> set[str]:
    """The names of the workers that ran the batch's shards."""
    return {
        Job.fetch(shard_job_id(batch_id, n), connection=client.connection,
                  serializer=JSONSerializer).worker_name
        for n in range(shards)
    }


def check_same_text_as_the_engine(model, requests: list[dict], records: list[dict]) -> None:
    """Each record's text is what LLM.generate gives for its prompt offline (greedy)."""
    llm = LLM(str(model), dtype="float32", device="cpu", max_num_seqs=64)
    params = [SamplingParams(max_tokens=r["body"]["max_tokens"], temperature=0) for r in requests]
    want = llm.generate([r["body"]["prompt"] for r in requests], params, progress=False)
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}
    assert [got[r["custom_id"]] for r in requests] == [o.text for o in want]


def test_thousand_requests_two_workers_into_s3(tiny_llama, redis_url, s3_server, s3_bucket, tmp_path):
    client = Client(redis_url)
    args = ("--max-num-seqs", "64")
    workers = [
        start_worker(tiny_llama, redis_url, tmp_path / f"w{n}.log", *args, "--name", f"w{n}")
        for n in range(2)
    ]
    requests = make_requests(1000)
    output = f"s3://{s3_bucket}/results"
    check_bad_batch_fails_at_submit(client, tmp_path / "bad.jsonl", output)
    try:
        wait_for_workers(client, 2)
        good = client.submit_batch(
            write_jsonl(tmp_path / "good.jsonl", requests), output=output, shard_size=50
        )
        done = client.wait(good.id, timeout=300, progress=False)
    finally:
        codes = [stop_worker(w, timeout=60) for w in workers]
    assert codes == [0, 0]
    assert done.status == BatchStatus.completed and done.request_counts.completed == 1000
    assert done.output_file == f"{output}/{good.id}/output.jsonl"
    records = s3_jsonl(s3_server, done.output_file)
    assert sorted(r["custom_id"] for r in records) == sorted(r["custom_id"] for r in requests)
    assert shard_workers(client, good.id, 20) == {"w0", "w1"}
    check_same_text_as_the_engine(tiny_llama, requests, records)


def started_shards_of(client: Client, worker_name: str) -> list[str]:
    """Ids of the started jobs that `worker_name` runs."""
    started = StartedJobRegistry("default", connection=client.connection)
    return [
        j
        for j in started.get_job_ids()
        if Job.fetch(j, connection=client.connection, serializer=JSONSerializer).worker_name == worker_name
    ]


def wait_until_running_shards(client: Client, batch_id: str, worker_name: str, timeout: float = 120) -> None:
    """Until the batch has completed requests and `worker_name` runs some of its shards."""
    deadline = time.monotonic() + timeout
    while not (client.get(batch_id).request_counts.completed and started_shards_of(client, worker_name)):
        assert time.monotonic() < deadline, f"{worker_name} never got going"
        time.sleep(0.1)


def test_sigkilled_worker_loses_nothing(tiny_llama, redis_url, tmp_path):
    client = Client(redis_url)
    requests = make_requests(240, seed=2, max_tokens=(16, 32))
    batch = client.submit_batch(requests, output=tmp_path.as_uri(), shard_size=20)
    args = ("--max-num-seqs", "40", "--heartbeat-ttl", "3")
    victim = start_worker(tiny_llama, redis_url, tmp_path / "victim.log", *args, "--name", "victim")
    survivor = None
    try:
        wait_until_running_shards(client, batch.id, "victim")
        survivor = start_worker(tiny_llama, redis_url, tmp_path / "survivor.log", *args, "--name", "survivor")
        # frozen first: no shard of its can finish between listing and kill
        os.kill(victim.pid, signal.SIGSTOP)
        killed = started_shards_of(client, "victim")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        done = client.wait(batch.id, timeout=240, progress=False)
    finally:
        stop_worker(victim)
        if survivor is not None:
            stop_worker(survivor)
    assert done.status == BatchStatus.completed
    assert (done.request_counts.completed, done.request_counts.failed) == (240, 0)
    lines = (tmp_path / batch.id / "output.jsonl").read_text().splitlines()
    ids = [json.loads(x)["custom_id"] for x in lines]
    assert len(ids) == 240 and set(ids) == {r["custom_id"] for r in requests}
    for job_id in killed:
        job = Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)
        assert job.worker_name == "survivor" and job.retries_left == 2, (
            "re-run after the kill, by the survivor"
        )
