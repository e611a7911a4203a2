"""Cron pipelines against real components: redis-server, moto's S3 server, scheduler processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from redis import Redis
from typer.testing import CliRunner

from sluice.producer.client import Client
from sluice.producer.cron import cron_app, get_pipeline, glob_regex, processed, tick
from tests.test_webhooks import ROOT, wait_for


@pytest.fixture
def redis(redis_url):
    return Redis.from_url(redis_url)


@pytest.fixture
def s3(s3_server, s3_bucket):
    """A boto3 client of the moto server; the test's fresh bucket is s3.bucket."""
    client = s3_server.client()
    client.bucket = s3_bucket
    return client


def put_input(s3, key: str, n: int = 2) -> None:
    lines = [{"custom_id": f"{key}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"hello {i}", "max_tokens": 4}} for i in range(n)]  # fmt: skip
    s3.put_object(Bucket=s3.bucket, Key=key, Body="".join(json.dumps(x) + "\n" for x in lines).encode())


def cli(redis_url: str, *args: str) -> str:
    result = CliRunner().invoke(cron_app, [*args, "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    return result.output


def inputs(redis_url: str) -> list[str]:
    return sorted(b.input_file for b in Client(redis_url).list(limit=100))


def test_glob_matches_within_segments():
    assert glob_regex("incoming/*.jsonl").match("incoming/a.jsonl")
    assert not glob_regex("incoming/*.jsonl").match("incoming/sub/a.jsonl")
    assert glob_regex("incoming/**.jsonl").match("incoming/sub/a.jsonl")
    assert glob_regex("in/day-[0-9]?.jsonl").match("in/day-1x.jsonl")
    assert not glob_regex("in/a.jsonl").match("in/a.jsonl.bak")


def test_cli_add_list_remove(redis_url, redis):
    cli(redis_url, "add", "nightly", "--schedule", "0 2 * * *", "--input", "s3://landing/incoming/*.jsonl",
        "--output", "s3://out/nightly", "--priority", "low")  # fmt: skip
    cli(
        redis_url,
        "add",
        "often",
        "--every",
        "15m",
        "--input",
        "file:///data/*.jsonl",
        "--output",
        "file:///out",
    )
    assert get_pipeline(redis, "often").every == 900
    rows = json.loads(cli(redis_url, "list", "--json"))
    assert [(r["name"], r["schedule"], r["priority"]) for r in rows] == [
        ("nightly", "0 2 * * *", "low"), ("often", None, "default")]  # fmt: skip
    assert "nightly" in cli(redis_url, "list")
    cli(redis_url, "remove", "often")
    assert [r["name"] for r in json.loads(cli(redis_url, "list", "--json"))] == ["nightly"]
    bad = CliRunner().invoke(cron_app,
                             ["add", "x", "--schedule", "99 * * *", "--input", "s3://b/*", "--redis-url",
                              redis_url])  # fmt: skip
    assert bad.exit_code != 0
    refused = CliRunner().invoke(cron_app, ["add", "y", "--every", "1m", "--input", "s3://b/*",
                                            "--webhook", "http://10.0.0.1/", "--redis-url", redis_url])
    assert refused.exit_code != 0


def test_ticks_submit_each_new_object_once(redis_url, redis, s3):
    cli(redis_url, "add", "landing", "--every", "1h", "--input", f"s3://{s3.bucket}/incoming/*.jsonl",
        "--output", "s3://out/landing", "--priority", "low")  # fmt: skip
    put_input(s3, "incoming/a.jsonl")
    put_input(s3, "incoming/b.jsonl")
    put_input(s3, "incoming/sub/c.jsonl")
    put_input(s3, "elsewhere/d.jsonl")
    first = cli(redis_url, "tick", "landing").split()
    assert len(first) == 2
    assert cli(redis_url, "tick", "landing").split() == []
    put_input(s3, "incoming/e.jsonl")
    assert len(cli(redis_url, "tick", "landing").split()) == 1
    assert inputs(redis_url) == [f"s3://{s3.bucket}/incoming/{k}.jsonl" for k in "abe"]
    assert {b.priority for b in Client(redis_url).list()} == {"low"}
    assert sorted(processed(redis, "landing").values()) == sorted(
        b.id for b in Client(redis_url).list(limit=100)
    )


def test_tick_skips_while_another_process_holds_the_lock(redis_url, redis, s3):
    cli(redis_url, "add", "landing", "--every", "1h", "--input", f"s3://{s3.bucket}/incoming/*.jsonl")
    put_input(s3, "incoming/a.jsonl")
    redis.set("sluice:cron:landing:lock", "someone-else")
    assert tick(redis, get_pipeline(redis, "landing"), Client(redis_url)) is None
    redis.delete("sluice:cron:landing:lock")
    assert len(tick(redis, get_pipeline(redis, "landing"), Client(redis_url))) == 1


def test_file_inputs(redis_url, redis, tmp_path):
    (tmp_path / "in").mkdir()
    line = json.dumps(
        {"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
    )
    (tmp_path / "in" / "a.jsonl").write_text(line + "\n")
    (tmp_path / "in" / "skip.txt").write_text(line + "\n")
    cli(redis_url, "add", "local", "--every", "1h", "--settle", "0s", "--input",
        f"file://{tmp_path}/in/*.jsonl", "--output", (tmp_path / "out").as_uri())  # fmt: skip
    assert len(cli(redis_url, "tick", "local").split()) == 1
    assert cli(redis_url, "tick", "local").split() == []
    assert [os.path.basename(i) for i in inputs(redis_url)] == ["a.jsonl"]


def start_scheduler(redis_url: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sluice.producer.cron", "run", "--poll", "0.1", "--redis-url", redis_url]
    return subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)


def test_schedulers_process_each_object_once_across_restart_and_concurrency(redis_url, redis, s3):
    cli(redis_url, "add", "landing", "--every", "300ms", "--input", f"s3://{s3.bucket}/incoming/*.jsonl")
    schedulers = [start_scheduler(redis_url), start_scheduler(redis_url)]
    expected = []
    try:
        for round_ in range(3):
            for i in range(3):
                put_input(s3, f"incoming/r{round_}-{i}.jsonl", n=1)
                expected.append(f"s3://{s3.bucket}/incoming/r{round_}-{i}.jsonl")
            wait_for(lambda: len(processed(redis, "landing")) == len(expected), timeout=30)
            schedulers[0].send_signal(signal.SIGKILL if round_ == 0 else signal.SIGTERM)
            schedulers[0].wait(2)  # SIGTERM: out after the tick in flight (the test fails on a timeout)
            schedulers[0] = start_scheduler(redis_url)
        time.sleep(1.0)
    finally:
        for proc in schedulers:
            proc.terminate()
            proc.wait(10)
    assert inputs(redis_url) == sorted(expected)
    assert len(processed(redis, "landing")) == len(expected)
    assert all(p.returncode in (0, -signal.SIGTERM) for p in schedulers[1:])


def test_an_idle_scheduler_leaves_within_2_s_of_sigterm(redis_url, redis, tmp_path):
    """SIGTERM while the scheduler sleeps between ticks (a pipeline due in an hour): out in 2 s, exit code 0,
    and unregistered from rq's scheduler registry."""
    (tmp_path / "in").mkdir()
    cli(redis_url, "add", "idle", "--every", "1h", "--input", f"file://{tmp_path}/in/*.jsonl")
    proc = subprocess.Popen([sys.executable, "-m", "sluice.producer.cron", "run", "--poll", "30",
                             "--redis-url", redis_url], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: redis.zcard("rq:cron_schedulers") == 1, timeout=60)
        time.sleep(0.5)  # in its sleep between ticks
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert code == 0 and took < 2.0, (code, took, proc.stderr.read().decode()[-2000:])
    assert redis.zcard("rq:cron_schedulers") == 0
