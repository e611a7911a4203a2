"""The engine worker driven through rq: shards share one continuous batch, rq's registries stay true."""

from __future__ import annotations

import json
import time

import pytest
import redis
from rq import SimpleWorker
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.jobs import RUN_SHARD_BEFORE_RENAME, finalize_job_id, shard_job_id
from sluice.contract.queues import queue_for
from sluice.engine import LLM, SamplingParams
from sluice.producer import BatchStatus, Client
from sluice.worker.worker import EngineWorker


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=64)


def completion(i: int, **body) -> dict:
    body = {"prompt": f"the quick brown fox {i}", "max_tokens": 6, "temperature": 0, **body}
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}


def chat(i: int) -> dict:
    messages = [{"role": "user", "content": f"to be or not {i}"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0}
    return {"custom_id": f"chat{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def run_worker(llm, redis_url: str, **kwargs) -> EngineWorker:
    worker = EngineWorker(
        ["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5, **kwargs
    )
    worker.work(burst=True, logging_level="WARNING")
    return worker


def texts(client: Client, batch_id: str) -> dict[str, str]:
    out = {}
    for r in client.results(batch_id):
        choice = r.response.body["choices"][0]
        out[r.custom_id] = choice["message"]["content"] if "message" in choice else choice["text"]
    return out


def fetch(client: Client, job_id: str) -> Job:
    return Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)


def generated_alone(llm) -> dict[str, str]:
    """What LLM.generate / LLM.chat give for the 24 completions and 4 chats of the test below, by
    custom_id."""
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [f"the quick brown fox {i}" for i in range(24)]
    want = {f"c{i}": o.text for i, o in enumerate(llm.generate(prompts, params, progress=False))}
    chats = llm.chat(
        [[{"role": "user", "content": f"to be or not {i}"}] for i in range(4)],
        SamplingParams(max_tokens=5, temperature=0),
        progress=False,
    )
    want.update({f"chat{i}": o.text for i, o in enumerate(chats)})
    return want


def test_shards_share_the_engine_finish_through_rq_and_match_generate(llm, redis_url, tmp_path):
    client = Client(redis_url)
    completions = [completion(i) for i in range(24)] + [completion(99, max_tokens=5000)]
    chats = [chat(i) for i in range(4)]  # a batch of their own: a batch's lines all name one url
    output = tmp_path.as_uri()
    batches = [client.submit_batch(lines, output=output, shard_size=6) for lines in (completions, chats)]
    run_worker(llm, redis_url)

    done = [client.get(b.id) for b in batches]
    assert [d.status for d in done] == [BatchStatus.completed] * 2
    counts = [(d.request_counts.total, d.request_counts.completed, d.request_counts.failed) for d in done]
    assert counts == [(25, 24, 1), (4, 4, 0)]
    shard_ids = [shard_job_id(d.id, n) for d in done for n in range(d.num_shards)]
    jobs = [fetch(client, j) for j in shard_ids]
    assert all(j.get_status() == JobStatus.FINISHED for j in jobs)
    assert sum(j.return_value()["completed"] for j in jobs) == 28
    finished = set(FinishedJobRegistry("default", connection=client.connection).get_job_ids())
    assert finished == {*shard_ids, *(finalize_job_id(d.id) for d in done)}
    assert StartedJobRegistry("default", connection=client.connection).get_job_ids() == []
    assert max(j.started_at for j in jobs) < min(j.ended_at for j in jobs), (
        "all shards, of both batches, ran in one continuous batch"
    )

    assert texts(client, done[0].id) | texts(client, done[1].id) == generated_alone(llm)
    assert list(client.results(done[1].id, errors=True)) == []
    errors = list(client.results(done[0].id, errors=True))
    assert [(e.custom_id, e.error.code) for e in errors] == [("c99", "request_rejected")]
    assert "max_model_len" in errors[0].error.message
    record = next(r for r in client.results(done[1].id) if r.custom_id == "chat0")
    assert record.response.body["object"] == "chat.completion"
    usage = record.response.body["usage"]
    assert (
        usage["completion_tokens"] <= 5
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )


def test_a_shard_job_queued_under_the_function_name_before_the_rename_still_runs(llm, redis_url, tmp_path):
    """A shard enqueued by a producer before worker/shards.py became worker/shard_run.py (its job still names
    sluice.worker.shards.run_shard) runs and the batch completes, instead of being refused as a foreign
    job."""
    client = Client(redis_url)
    batch = client.submit_batch([completion(1), completion(2)], output=tmp_path.as_uri(), shard_size=1)
    queue = queue_for(client.connection, "default")
    old = fetch(client, shard_job_id(batch.id, 1))
    queue.remove(old)
    queue.enqueue_call(RUN_SHARD_BEFORE_RENAME, args=old.args, job_id=old.id, timeout=old.timeout)
    assert fetch(client, old.id).func_name == RUN_SHARD_BEFORE_RENAME
    run_worker(llm, redis_url)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed and done.request_counts.completed == 2
    assert fetch(client, old.id).get_status() == JobStatus.FINISHED


def test_high_priority_shards_are_claimed_first(tiny_llama, redis_url, tmp_path):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=2)
    client = Client(redis_url)
    low = client.submit_batch(
        [completion(i) for i in range(4)], output=tmp_path.as_uri(), priority="low", shard_size=2
    )
    high = client.submit_batch(
        [completion(i) for i in range(4)], output=tmp_path.as_uri(), priority="high", shard_size=2
    )
    run_worker(llm, redis_url)
    assert client.get(low.id).status == client.get(high.id).status == BatchStatus.completed
    high_started = max(fetch(client, shard_job_id(high.id, n)).started_at for n in range(2))
    low_started = min(fetch(client, shard_job_id(low.id, n)).started_at for n in range(2))
    assert high_started < low_started


def test_expired_batch_ends_expired_without_running(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(
        [completion(i) for i in range(3)], output=tmp_path.as_uri(), completion_window="1s"
    )
    time.sleep(1.2)
    run_worker(llm, redis_url)
    done = client.get(batch.id)
    assert done.status == BatchStatus.expired and done.expired_at
    assert {e.error.code for e in client.results(batch.id, errors=True)} == {"batch_expired"}
    assert done.request_counts.failed == 3


def test_a_stock_rq_worker_can_run_the_same_jobs(tiny_llama, redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_MODEL", str(tiny_llama))
    monkeypatch.setenv("SLUICE_DTYPE", "float32")
    monkeypatch.setenv("SLUICE_DEVICE", "cpu")
    client = Client(redis_url)
    batch = client.submit_batch([completion(i) for i in range(5)], output=tmp_path.as_uri(), shard_size=2)
    queue = queue_for(client.connection, "default")
    SimpleWorker([queue], connection=client.connection, serializer=JSONSerializer).work(burst=True)
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed and done.request_counts.completed == 5
    lines = (tmp_path / batch.id / "output.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == [f"c{i}" for i in range(5)]
