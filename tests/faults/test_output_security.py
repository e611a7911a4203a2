"""Where workers may write: allow-listed output roots checked at submit and again before every write."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from sluice.contract.batch import BatchStore
from sluice.contract.jobs import shard_job_id
from sluice.contract.schemas import Batch, BatchRequest, BatchStatus
from sluice.contract.settings import Settings
from sluice.contract.storage import FileStorage, OutputNotAllowed, check_output_url, open_storage
from sluice.producer.client import Client
from sluice.worker.finalize import finalize_batch
from sluice.worker.shard_run import ShardRun
from tests.test_webhooks import ROOT

ROOTS = ["file:///srv/out", "s3://results/sluice", "s3://team-*"]


@pytest.mark.parametrize(
    "url",
    ["file:///srv/out", "file:///srv/out/batches", "s3://results/sluice", "s3://results/sluice/a/b",
     "s3://team-nlp", "s3://team-nlp/x"],
)  # fmt: skip
def test_outputs_inside_a_root_pass(url):
    assert check_output_url(url, ROOTS) == url


@pytest.mark.parametrize(
    "url",
    ["file://tmp/out", "file://srv/out", "file:///srv/out/../etc", "file:///srv/outside", "file:///out",
     "/etc", "s3://results/sluice-other", "s3://results", "s3://other/sluice", "s3://team/x", "ftp://host/x"],
)  # fmt: skip
def test_outputs_outside_every_root_are_refused(url):
    with pytest.raises(ValueError):
        check_output_url(url, ROOTS)


def test_a_file_url_with_a_host_part_is_refused_not_rerooted():
    with pytest.raises(ValueError, match="names host 'tmp'"):
        open_storage("file://tmp/out")


def test_submit_refuses_an_output_outside_the_roots(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_OUTPUT_ROOTS", (tmp_path / "allowed").as_uri())
    client = Client(redis_url)
    with pytest.raises(OutputNotAllowed, match="SLUICE_OUTPUT_ROOTS"):
        client.submit_batch([{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                              "body": {"prompt": "x"}}],
                            output=(tmp_path / "elsewhere").as_uri())
    assert client.list() == []
    ok = client.submit_batch([{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x"}}], output=(tmp_path / "allowed" / "b").as_uri())
    assert ok.status == BatchStatus.in_progress


def test_the_worker_refuses_to_write_outside_its_roots(redis_url, tmp_path, monkeypatch):
    """A batch record that names another place (roots changed, record forged in Redis) gets no file
    written."""
    connection = Redis.from_url(redis_url)
    evil = tmp_path / "evil"
    store = BatchStore(connection)
    store.create(Batch(id="batch_forged", status=BatchStatus.in_progress, output_url=evil.as_uri(),
                       num_shards=1, created_at=time.time()))  # fmt: skip
    monkeypatch.setenv("SLUICE_OUTPUT_ROOTS", (tmp_path / "allowed").as_uri())
    forged = BatchRequest(custom_id="a", url="/v1/completions", body={"prompt": "x"})
    run = ShardRun("batch_forged-shard-0", "batch_forged", 0, [forged])
    run.fail_all("batch_cancelled", "x")
    with pytest.raises(OutputNotAllowed):
        run.save(connection, Settings())
    assert finalize_batch("batch_forged") == {}  # a permanent error of the batch: no raise, so no retry loop
    batch = store.get("batch_forged")
    assert batch.status == BatchStatus.failed and [e.code for e in batch.errors] == ["output_not_allowed"]
    assert (evil.as_uri() in batch.errors[0].message
            and (tmp_path / "allowed").as_uri() in batch.errors[0].message)
    assert not evil.exists()


def test_the_storage_root_guard_holds_under_python_O(tmp_path):
    code = (
        "import sys; from sluice.contract.storage import FileStorage; from pathlib import Path\n"
        "try:\n    FileStorage(Path(sys.argv[1])).put('../escaped', b'x')\n"
        "except ValueError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code, str(tmp_path / "root")], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.startswith("refused") and not (tmp_path / "escaped").exists()


def test_failed_writes_leave_no_temp_files(tmp_path):
    storage = FileStorage(tmp_path / "root")
    with pytest.raises(FileNotFoundError):
        storage.put_file("a/out.jsonl", tmp_path / "missing.jsonl")
    with pytest.raises(TypeError):
        storage.put("a/out.jsonl", "not bytes")  # type: ignore[arg-type]
    assert [p.name for p in (tmp_path / "root" / "a").iterdir()] == []


def test_finished_shard_jobs_do_not_keep_prompts_for_days(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_RESULT_TTL", "120")
    client = Client(redis_url)
    batch = client.submit_batch([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                             "body": {"prompt": "secret prompt"}})],
                                output=tmp_path.as_uri())
    job = Job.fetch(shard_job_id(batch.id, 0), connection=client.connection, serializer=JSONSerializer)
    assert job.result_ttl == 120
    assert client.settings.result_ttl == 120 and Client(redis_url).settings.failure_ttl == 7 * 86400
