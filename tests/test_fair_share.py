"""Fair share across batches (a window of shards per batch in the queue) and the per-project enqueued-token
cap, against a real redis-server and a real engine worker."""

from __future__ import annotations

import json

import pytest
import redis
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore
from sluice.contract.jobs import finalize_job_id, shard_job_id
from sluice.contract.queues import queue_for
from sluice.contract.quota import TokenQuota
from sluice.contract.settings import Settings
from sluice.engine import LLM
from sluice.producer import BatchStatus, Client
from sluice.worker.finalize import finalize_batch
from sluice.worker.worker import EngineWorker


def completion(i: int, tag: str = "c", **body) -> dict:
    body = {"prompt": f"the quick brown fox {i}", "max_tokens": 2, "temperature": 0, **body}
    return {"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions", "body": body}


def fetch(client: Client, job_id: str) -> Job:
    return Job.fetch(job_id, connection=client.connection, serializer=JSONSerializer)


def test_only_a_window_of_each_batchs_shards_is_queued(redis_url, tmp_path):
    client = Client(redis_url, settings=Settings(shard_window=2))
    big = client.submit_batch([completion(i) for i in range(10)], output=tmp_path.as_uri(), shard_size=1)
    small = client.submit_batch([completion(0, "s")], output=tmp_path.as_uri())
    queue = queue_for(client.connection, "default")
    assert queue.job_ids == [shard_job_id(big.id, 0), shard_job_id(big.id, 1), shard_job_id(small.id, 0)]
    waiting = [fetch(client, shard_job_id(big.id, n)) for n in range(2, 10)]
    assert {j.get_status() for j in waiting} == {JobStatus.DEFERRED}
    assert [j.dependency_ids for j in waiting] == [[shard_job_id(big.id, n - 2)] for n in range(2, 10)]


def test_cancel_drops_waiting_shards_without_queueing_any(redis_url, tmp_path):
    client = Client(redis_url, settings=Settings(shard_window=2))
    batch = client.submit_batch([completion(i) for i in range(6)], output=tmp_path.as_uri(), shard_size=1)
    client.cancel(batch.id)
    canceled = CanceledJobRegistry("default", connection=client.connection, serializer=JSONSerializer)
    assert set(canceled.get_job_ids()) == {shard_job_id(batch.id, n) for n in range(6)}
    assert queue_for(client.connection, "default").job_ids == [finalize_job_id(batch.id)]
    finalize_batch(batch.id)
    done = client.get(batch.id)
    assert done.status == BatchStatus.cancelled and done.request_counts.failed == 6
    errors = sorted(r.custom_id for r in client.results(batch.id, errors=True))
    assert errors == [f"c{i}" for i in range(6)], "each cancelled shard's requests read back from its slice"


def test_a_small_batch_behind_a_large_one_finishes_first_with_one_worker(redis_url, tmp_path, tiny_llama):
    """One shard in the engine at a time (max_num_seqs = shard size): without the window, the small batch's
    shard would run after all twelve of the large one's."""
    client = Client(redis_url, settings=Settings(shard_window=2))
    large = client.submit_batch([completion(i) for i in range(48)], output=tmp_path.as_uri(), shard_size=4)
    small = client.submit_batch([completion(i, "s") for i in range(4)], output=tmp_path.as_uri())
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=4)
    worker = EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5)
    worker.work(burst=True, logging_level="WARNING")
    large, small = client.get(large.id), client.get(small.id)
    assert large.status == small.status == BatchStatus.completed
    assert large.request_counts.completed == 48 and small.request_counts.completed == 4
    small_ended = fetch(client, shard_job_id(small.id, 0)).ended_at
    large_ended = [fetch(client, shard_job_id(large.id, n)).ended_at for n in range(12)]
    assert sum(t < small_ended for t in large_ended) <= 2, "the small batch waited for the window only"
    assert small.completed_at < large.completed_at


def test_a_project_past_its_enqueued_token_cap_gets_a_clear_error(redis_url, tmp_path):
    lines = [completion(i, prompt="x" * 400) for i in range(4)]
    per_batch = sum(len(json.dumps(line["body"])) for line in lines) // 4  # about what the estimate counts
    client = Client(redis_url, settings=Settings(max_enqueued_tokens=int(per_batch * 1.5), shard_window=1))
    first = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=2, project="team-a")
    quota = TokenQuota(client.connection)
    held = quota.usage("team-a")
    assert first.status == BatchStatus.in_progress and per_batch < held < per_batch * 1.5

    refused = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=2, project="team-a")
    assert refused.status == BatchStatus.failed and refused.request_counts.failed == 4
    [error] = refused.errors
    assert error.code == "token_limit_exceeded"
    assert f"limit {int(per_batch * 1.5)} enqueued tokens" in error.message
    assert f"{held} already enqueued" in error.message and "team-a" in error.message
    assert quota.usage("team-a") == held, "a refused batch holds nothing"
    other = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=2, project="team-b")
    assert other.status == BatchStatus.in_progress, "the cap is per project"

    BatchStore(client.connection).record_shard(first.id, 0, 2, 0)  # shard 0 finished: its tokens are released
    BatchStore(client.connection).record_shard(first.id, 0, 2, 0)  # recorded again (a re-run): nothing more
    assert 0 < quota.usage("team-a") < held / 2 + 10
    client.cancel(first.id)
    finalize_batch(first.id)
    assert client.get(first.id).status == BatchStatus.cancelled and quota.usage("team-a") == 0
    again = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=2, project="team-a")
    assert again.status == BatchStatus.in_progress


@pytest.mark.parametrize("cap", [0])
def test_no_cap_by_default(redis_url, cap):
    assert Settings().max_enqueued_tokens == cap
    client = Client(redis_url)
    batch = client.submit_batch([completion(i, prompt="x" * 1000) for i in range(20)])
    assert batch.status == BatchStatus.in_progress and TokenQuota(client.connection).usage("default") > 5000


def test_the_server_counts_a_batch_against_its_api_keys_project(redis_url, tmp_path):
    import openai

    from sluice.producer.server.keys import KeyStore
    from tests.server_stack import start_server
    from tests.services import stop_worker, worker_env

    env = worker_env(redis_url, SLUICE_OUTPUT_URL=tmp_path.as_uri(), SLUICE_MAX_ENQUEUED_TOKENS="300")
    process, url = start_server(redis_url, tmp_path, env=env)
    try:
        keys = KeyStore(redis.Redis.from_url(redis_url))
        apis = {p: openai.OpenAI(base_url=url + "/v1", api_key=keys.create(p)[1], max_retries=0)
                for p in "ab"}  # fmt: skip
        body = "".join(json.dumps(completion(i, prompt="x" * 300)) + "\n" for i in range(2)).encode()

        def create(project: str):
            upload = apis[project].files.create(file=("in.jsonl", body), purpose="batch")
            return apis[project].batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                completion_window="24h")  # fmt: skip

        assert create("a").status == "in_progress"
        refused = create("a")
        assert refused.status == "failed" and refused.errors.data[0].code == "token_limit_exceeded"
        message = refused.errors.data[0].message
        assert "project 'a'" in message and "limit 300" in message
        assert create("b").status == "in_progress", "another project's cap is its own"
    finally:
        stop_worker(process)
