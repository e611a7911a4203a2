"""Cron pipelines: on a schedule, submit one batch per new object matching an input glob."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import signal
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import typer
from croniter import croniter
from pydantic import BaseModel, Field, ValidationError, model_validator
from redis import Redis
from rq.cron import CronJob, CronScheduler
from rq.exceptions import StopRequested
from rq.utils import now

from sluice.contract.redis_conn import connect
from sluice.contract.rq_adapter import set_cron_jobs
from sluice.contract.schemas import Priority
from sluice.contract.settings import default_redis_url, get_settings, output_url_if_set
from sluice.contract.signing import check_url, parse_duration
from sluice.contract.storage import s3_client
from sluice.producer.client import Client

log = logging.getLogger(__name__)

PIPELINES_KEY = "sluice:cron:pipelines"
CRON_QUEUE = "sluice-cron"
LOCK_TTL_MS = 10_000
DEFAULT_SETTLE_S = 10.0
STOP_POLL_S = 0.1  # how often a sleeping scheduler looks for a stop request

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class CronPipeline(BaseModel):
    """A named schedule that turns each new input object into a batch."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    input: str = Field(pattern=r"^(s3|file)://.+")
    output: str | None = None
    schedule: str | None = None
    every: float | None = Field(None, gt=0)
    settle: float = Field(DEFAULT_SETTLE_S, ge=0)
    webhook: str | None = None
    priority: Priority = "default"
    created_at: int = Field(default_factory=lambda: int(time.time()))

    @model_validator(mode="after")
    def _one_timing(self) -> CronPipeline:
        if (self.schedule is None) == (self.every is None):
            raise ValueError("give exactly one of schedule (a cron expression) or every (an interval)")
        if self.schedule is not None and not croniter.is_valid(self.schedule):
            raise ValueError(f"schedule {self.schedule!r} is not a valid cron expression")
        return self


def seen_key(name: str) -> str:
    return f"sluice:cron:{name}:seen"


def lock_key(name: str) -> str:
    return f"sluice:cron:{name}:lock"


def state_key(name: str) -> str:
    return f"sluice:cron:{name}:state"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def add_pipeline(connection: Redis, pipeline: CronPipeline) -> None:
    """Store (or replace) a pipeline definition."""
    connection.hset(PIPELINES_KEY, pipeline.name, pipeline.model_dump_json())


def remove_pipeline(connection: Redis, name: str) -> bool:
    """Delete a pipeline definition; what it processed stays recorded, so re-adding it reprocesses nothing."""
    return bool(connection.hdel(PIPELINES_KEY, name))


def list_pipelines(connection: Redis) -> list[CronPipeline]:
    """All pipeline definitions, by name."""
    raw = connection.hgetall(PIPELINES_KEY)
    return sorted((CronPipeline.model_validate_json(v) for v in raw.values()), key=lambda p: p.name)


def get_pipeline(connection: Redis, name: str) -> CronPipeline:
    raw = connection.hget(PIPELINES_KEY, name)
    if raw is None:
        raise KeyError(f"no cron pipeline named {name!r}")
    return CronPipeline.model_validate_json(raw)


def processed(connection: Redis, name: str) -> dict[str, str]:
    """Objects a pipeline has turned into batches: '{url}#{etag}' -> batch id."""
    return {_text(k): _text(v) for k, v in connection.hgetall(seen_key(name)).items()}


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regex for a key glob: '*' and '?' stay within one path segment, '**' crosses them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] in "*?":
            out.append("[^/]*" if pattern[i] == "*" else "[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1 : end].replace("!", "^", 1) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _literal_prefix(pattern: str) -> str:
    return re.split(r"[*?\[]", pattern, maxsplit=1)[0]


def _list_s3(bucket: str, pattern: str, s3_style: str) -> list[tuple[str, str]]:
    matcher = glob_regex(pattern)
    pages = (
        s3_client(s3_style).get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                      Prefix=_literal_prefix(pattern))
    )
    found = [obj for page in pages for obj in page.get("Contents", []) if matcher.match(obj["Key"])]
    return [(f"s3://{bucket}/{obj['Key']}", obj["ETag"].strip('"')) for obj in found]


def _list_files(pattern: str, settle: float) -> list[tuple[str, str]]:
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    stats = [(p, os.stat(p)) for p in paths]
    settled = [(p, st) for p, st in stats if time.time() - max(st.st_mtime, st.st_ctime) >= settle]
    return [(f"file://{p}", f"{st.st_size}-{st.st_mtime_ns}") for p, st in settled]


def list_objects(input_glob: str, settle: float, s3_style: str) -> list[tuple[str, str]]:
    """(url, etag) of every object matching an s3:// or file:// glob, sorted by url.

    Local files show up only once unchanged (data and metadata) for `settle` seconds, so a file still
    being written is not submitted half-done; S3 objects appear whole when their upload completes.
    """
    parts = urlsplit(input_glob)
    if parts.scheme == "s3":
        return sorted(_list_s3(parts.netloc, parts.path.lstrip("/"), s3_style))
    if parts.scheme == "file":
        return _list_files(input_glob.removeprefix("file://"), settle)
    raise ValueError(f"input must be s3:// or file://, not {input_glob!r}")


def source_of(url: str) -> str | Path:
    """What to submit for a listed object: its path, or its S3 key quoted, so '#' and '?' stay in the name."""
    if url.startswith("file://"):
        return Path(url.removeprefix("file://"))
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return f"s3://{bucket}/{quote(key, safe='/')}"


def idempotency_key(name: str, object_id: str) -> str:
    """The submit idempotency key of one object for one pipeline, stable across ticks and processes."""
    return f"cron:{name}:{hashlib.sha256(object_id.encode()).hexdigest()[:40]}"


def _submit(client: Any, pipeline: CronPipeline, url: str, object_id: str) -> Any:
    options = {"output": pipeline.output, "webhook": pipeline.webhook}
    return client.submit_batch(
        input=source_of(url),
        priority=pipeline.priority,
        idempotency_key=idempotency_key(pipeline.name, object_id),
        **{k: v for k, v in options.items() if v is not None},
    )


def tick(connection: Redis, pipeline: CronPipeline, client: Any) -> list[str] | None:
    """Submit a batch per new object; return their ids, or None if another process is ticking it.

    An object counts as processed only once its batch left `validating` (failed counts: it is recorded).
    """
    token = uuid.uuid4().hex
    if not connection.set(lock_key(pipeline.name), token, nx=True, px=LOCK_TTL_MS):
        return None
    submitted = []
    try:
        for url, etag in list_objects(pipeline.input, pipeline.settle, client.settings.s3_addressing_style):
            object_id = f"{url}#{etag}"
            if connection.hexists(seen_key(pipeline.name), object_id):
                continue
            if not connection.eval(_REFRESH, 1, lock_key(pipeline.name), token, LOCK_TTL_MS):
                log.warning("cron %s: tick lock expired; stopping this tick", pipeline.name)
                break
            batch = _submit(client, pipeline, url, object_id)
            if _text(getattr(batch.status, "value", batch.status)) == "validating":
                log.warning("cron %s: batch %s for %s still validating; checked again next tick",
                            pipeline.name, batch.id, url)  # fmt: skip
                continue
            connection.hset(seen_key(pipeline.name), object_id, _text(batch.id))
            submitted.append(_text(batch.id))
            log.info("cron %s: %s -> batch %s (%s)", pipeline.name, url, batch.id, batch.status)
        connection.hset(
            state_key(pipeline.name), mapping={"last_tick": time.time(), "last_submitted": len(submitted)}
        )
    finally:
        connection.eval(_RELEASE, 1, lock_key(pipeline.name), token)
    return submitted


def make_client(redis_url: str) -> Any:
    """The pipeline's producer client for redis_url."""
    return Client(redis_url)


def tick_job(name: str) -> list[str] | None:
    """Tick a pipeline by name (usable as an rq job on a stock rq worker)."""
    redis_url = get_settings().redis_url
    connection = connect(redis_url)
    return tick(connection, get_pipeline(connection, name), make_client(redis_url))


class PipelineScheduler(CronScheduler):
    """rq's cron scheduler, fed from the pipeline definitions in Redis, running each tick in-process."""

    def __init__(self, connection: Redis, client: Any, poll_s: float = 5.0, **kwargs: Any):
        super().__init__(connection, **kwargs)
        self.client, self.poll_s = client, poll_s
        self._definitions: dict[str, CronPipeline] = {}
        self._stopping = False

    def _cron_job(self, pipeline: CronPipeline) -> CronJob:
        job = CronJob(CRON_QUEUE, func=tick_job, args=(pipeline.name,), name=f"sluice-cron:{pipeline.name}",
                      cron=pipeline.schedule, interval=pipeline.every)  # fmt: skip
        last = self.connection.hget(state_key(pipeline.name), "last_tick")
        if last is not None and pipeline.every is not None:
            job.set_enqueue_time(datetime.fromtimestamp(float(last), UTC))
        return job

    def sync(self) -> None:
        """Pick up added, changed and removed pipelines."""
        definitions = {p.name: p for p in list_pipelines(self.connection)}
        jobs = {job.args[0]: job for job in self.get_jobs()}
        known = self._definitions
        fresh = [jobs[name] if known.get(name) == p else self._cron_job(p) for name, p in definitions.items()]
        set_cron_jobs(self, fresh)
        self._definitions = definitions

    def enqueue_jobs(self) -> list[CronJob]:
        """Run the ticks that are due (instead of enqueueing them) and return their cron jobs."""
        self.sync()
        due = [job for job in self.get_jobs() if job.should_run()]
        for job in due:
            if self._stopping:  # the rest wait for the next scheduler
                break
            job.set_enqueue_time(now())
            try:
                tick(self.connection, self._definitions[job.args[0]], self.client)
            except StopRequested:
                raise
            except Exception:
                log.exception("cron %s: tick failed; its new objects are retried next tick", job.args[0])
        return due

    def calculate_sleep_interval(self) -> float:
        return min(super().calculate_sleep_interval(), self.poll_s)

    def request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT: stop after the tick in flight (a flag, not an exception raised inside boto3 or
        redis code that may swallow it); a second signal interrupts the tick."""
        if self._stopping:
            raise StopRequested()
        log.info("cron scheduler %s: stop requested (signal %s)", self.name, signum)
        self._stopping = True

    def _sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking within STOP_POLL_S of a stop request."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, STOP_POLL_S))

    def start(self) -> None:
        """Tick due pipelines until SIGTERM/SIGINT, then leave rq's scheduler registry (idle: within
        STOP_POLL_S of the signal)."""
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        self.register_birth()
        try:
            while not self._stopping:
                if self.enqueue_jobs():
                    self.save()
                self.heartbeat()
                self._sleep(self.calculate_sleep_interval())
        except (KeyboardInterrupt, StopRequested):
            log.info("cron scheduler %s: interrupted", self.name)
        finally:
            self.register_death()


cron_app = typer.Typer(help="Cron pipelines: batches from new objects in a bucket or folder, on a schedule.")
RedisURL = typer.Option(
    default_factory=default_redis_url, show_default=False, help="Redis URL (default: $SLUICE_REDIS_URL)"
)


@cron_app.command("add")
def add_command(
    name: str,
    input: str = typer.Option(..., help='glob of input objects, e.g. "s3://bucket/incoming/*.jsonl"'),
    output: str | None = typer.Option(
        default_factory=output_url_if_set,
        show_default=False,
        help="output location of each batch (default: $SLUICE_OUTPUT_URL)",
    ),
    schedule: str | None = typer.Option(None, help='cron expression, e.g. "0 2 * * *"'),
    every: str | None = typer.Option(None, help="interval, e.g. 15m"),
    settle: str = typer.Option(
        f"{DEFAULT_SETTLE_S:g}s",
        help="file:// inputs: how long a file must stay unchanged before it is submitted",
    ),
    webhook: str | None = typer.Option(None, help="webhook URL for each batch"),
    priority: str = typer.Option("default", help="high, default or low"),
    redis_url: str = RedisURL,
) -> None:
    """Add (or replace) a cron pipeline."""
    try:
        interval = parse_duration(every) if every else None
        pipeline = CronPipeline(name=name, input=input, output=output, schedule=schedule, every=interval,
                                settle=parse_duration(settle),
                                webhook=webhook and check_url(webhook, get_settings().webhook_allow),
                                priority=priority)  # fmt: skip
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    add_pipeline(connect(redis_url), pipeline)
    typer.echo(f"added cron pipeline {name}")


@cron_app.command("list")
def list_command(redis_url: str = RedisURL, as_json: bool = typer.Option(False, "--json")) -> None:
    """List cron pipelines with their last tick and how many objects they processed."""
    connection = connect(redis_url)
    rows = []
    for p in list_pipelines(connection):
        state = {_text(k): _text(v) for k, v in connection.hgetall(state_key(p.name)).items()}
        last = float(state["last_tick"]) if "last_tick" in state else None
        rows.append({**p.model_dump(), "last_tick": last, "processed": connection.hlen(seen_key(p.name))})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        when = r["schedule"] or f"every {r['every']:g}s"
        last = datetime.fromtimestamp(r["last_tick"], UTC).isoformat() if r["last_tick"] else "never"
        typer.echo(f"{r['name']}\t{when}\t{r['input']} -> {r['output'] or '(default)'}\t"
                   f"{r['priority']}\tlast tick {last}\t{r['processed']} processed")  # fmt: skip


@cron_app.command("remove")
def remove_command(name: str, redis_url: str = RedisURL) -> None:
    """Remove a cron pipeline (objects it already processed stay recorded)."""
    if not remove_pipeline(connect(redis_url), name):
        raise typer.BadParameter(f"no cron pipeline named {name!r}")
    typer.echo(f"removed cron pipeline {name}")


@cron_app.command("tick")
def tick_command(name: str, redis_url: str = RedisURL) -> None:
    """Tick one pipeline now and print the ids of the batches it submitted."""
    connection = connect(redis_url)
    try:
        pipeline = get_pipeline(connection, name)
    except KeyError as exc:
        raise typer.BadParameter(str(exc)) from None
    submitted = tick(connection, pipeline, make_client(redis_url))
    if submitted is None:
        typer.echo(f"{name} is being ticked by another process", err=True)
        raise typer.Exit(1)
    for batch_id in submitted:
        typer.echo(batch_id)


@cron_app.command("run")
def run_command(
    redis_url: str = RedisURL,
    poll: float = typer.Option(5.0, help="seconds between checks for new pipelines"),
) -> None:
    """Run the cron scheduler process (several may run at once; each object is still processed once)."""
    connection = connect(redis_url)
    PipelineScheduler(connection, make_client(redis_url), poll_s=poll).start()


if __name__ == "__main__":
    cron_app()
