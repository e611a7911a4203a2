"""No wasted work (real redis-server, the engine worker driven through rq, the reaper): an expired batch keeps
its finished lines; `resume` runs only the others and its files hold every custom_id of the original once;
output files are deleted when `output_expires_after` says."""

from __future__ import annotations

import json
import time

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer
from typer.testing import CliRunner

from sluice.cli.main import app
from sluice.contract.batch import BatchStore
from sluice.contract.jobs import shard_job_id
from sluice.contract.settings import Settings
from sluice.contract.storage import read_url
from sluice.engine import LLM
from sluice.producer import BatchStatus, Client
from sluice.producer.client import output_expiry_seconds
from sluice.worker.reaper import Reaper
from sluice.worker.shard_run import ShardRun, model_name, served_models
from sluice.worker.worker import EngineWorker

BAD = "c6"  # a bad body, on a shard that never runs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_num_seqs=16)


def lines() -> list[dict]:
    body = {"max_tokens": 3, "temperature": 0}
    out = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"to be or not {i}", **body}} for i in range(12)]  # fmt: skip
    out[6]["body"]["temperature"] = 9
    return out


def run_first_shard(llm, client: Client, batch_id: str) -> None:
    """Shard 0 runs (as a worker that died before telling rq would leave it: output written, job still
    queued)."""
    shard = Job.fetch(shard_job_id(batch_id, 0), connection=client.connection, serializer=JSONSerializer)
    run = ShardRun.from_args(shard.id, shard.args)
    run.load(BatchStore(client.connection), Settings())
    run.start(llm, served_models(llm, Settings()))
    while not run.done:
        for out in llm.engine.step():
            run.finish(out, model_name(llm))
    run.save(client.connection, Settings())


def reap_until_done(client: Client, batch_id: str) -> None:
    reaper = Reaper(client.connection, Settings(reaper_interval=0.2))
    deadline = time.monotonic() + 20
    while not client.get(batch_id).done:
        assert time.monotonic() < deadline, "the reaper did not end the batch"
        reaper.run_once()
        time.sleep(0.25)


def records(url: str | None) -> list[dict]:
    return [json.loads(line) for line in read_url(url).splitlines()] if url else []


def test_an_expired_batch_keeps_its_finished_lines_and_resume_runs_only_the_rest(llm, redis_url, tmp_path):
    client = Client(redis_url)
    original = client.submit_batch(lines(), output=tmp_path.as_uri(), shard_size=4, completion_window="3s")
    run_first_shard(llm, client, original.id)
    time.sleep(max(0.0, original.expires_at - time.time()) + 0.1)
    reap_until_done(client, original.id)
    expired = client.get(original.id)
    assert expired.status == BatchStatus.expired
    assert expired.request_counts.model_dump() == {"total": 12, "completed": 4, "failed": 8}
    assert [r["custom_id"] for r in records(expired.output_file)] == ["c0", "c1", "c2", "c3"]
    errors = {r["custom_id"]: r for r in records(expired.error_file)}
    assert sorted(errors) == sorted(f"c{i}" for i in range(4, 12))
    assert errors[BAD]["response"]["status_code"] == 400
    expired_lines = [r for c, r in errors.items() if c != BAD]
    assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in expired_lines)

    resume = ["resume", original.id, "--completion-window", "1h", "--json", "--redis-url", redis_url]
    out = CliRunner().invoke(app, resume)
    assert out.exit_code == 0, out.output
    resumed = json.loads(out.output)
    assert resumed["resumed_from"] == original.id and resumed["request_counts"]["total"] == 12
    EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5).work(
        burst=True, logging_level="WARNING")
    done = client.get(resumed["id"])
    assert done.status == BatchStatus.completed
    assert done.request_counts.model_dump() == {"total": 12, "completed": 11, "failed": 1}
    output, failed = records(done.output_file), records(done.error_file)
    assert sorted(r["custom_id"] for r in output + failed) == sorted(f"c{i}" for i in range(12))
    kept = {r["custom_id"]: r["id"] for r in records(expired.output_file)}
    carried = {r["custom_id"]: r["id"] for r in output if r["custom_id"] in kept}
    assert carried == kept, "the finished lines are carried over as they were"
    assert [r["custom_id"] for r in failed] == [BAD] and failed[0]["response"]["status_code"] == 400


def test_resume_refuses_a_batch_still_running(redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(lines()[:2], output=tmp_path.as_uri())
    with pytest.raises(ValueError, match="only a done batch"):
        client.resume(batch.id)


def test_output_files_are_deleted_when_output_expires_after_comes(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(lines()[4:7], output=tmp_path.as_uri(), output_expires_after=1)
    reaper = Reaper(client.connection, Settings(reaper_interval=0.2))
    time.sleep(max(0.0, batch.output_expires_at - time.time()) + 0.3)
    assert reaper.run_once()["outputs_deleted"] == 0, "due, but still running: its files are not written yet"
    EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5).work(
        burst=True, logging_level="WARNING")
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed and read_url(done.output_file) and read_url(done.error_file)
    time.sleep(0.2)  # the reaper's lock lets one pass per interval
    assert reaper.run_once()["outputs_deleted"] == 1
    assert not list((tmp_path / batch.id).rglob("*.jsonl"))
    gone = client.get(batch.id)
    assert gone.output_file is None and gone.error_file is None
    with pytest.raises(ValueError, match=f"{batch.id}/input.jsonl is gone"):
        client.resume(batch.id)


@pytest.mark.parametrize("spec", [
    {"anchor": "completed_at", "seconds": 3600}, {"anchor": "created_at", "seconds": 60},
    {"anchor": "created_at", "seconds": 31 * 86400}, {"anchor": "created_at"},
])  # fmt: skip
def test_output_expires_after_takes_openais_shape_and_bounds(spec):
    assert output_expiry_seconds({"anchor": "created_at", "seconds": 7200}) == 7200
    with pytest.raises(ValueError, match="output_expires_after"):
        output_expiry_seconds(spec)
