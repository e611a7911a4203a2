"""The `sluice` command line: submit, status, wait, cancel, results, list, worker (human output or --json)."""

from __future__ import annotations

import importlib
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from producer.client import BatchNotFound, Client
from producer.schemas import Batch

app = typer.Typer(name="sluice", help="Queue-driven batch inference for LLMs.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)
# Commands other modules add: (module, attribute, command name); a Typer is mounted, a function registered.
EXTENSIONS = [
    ("producer.cron", "cron_app", "cron"),
    ("worker.webhooks", "webhooks_app", "webhooks"),
    ("engine.cli", "quantize", "quantize"),
]
HEAVY = {"engine.cli"}  # imports torch: loaded only when its command or the top-level help is asked for

RedisUrl = typer.Option(
    None, "--redis-url", help="Redis URL (default: $SLUICE_REDIS_URL or redis://127.0.0.1:6379/0)"
)
AsJson = typer.Option(False, "--json", help="Machine-readable JSON output.")


def client(redis_url: str | None) -> Client:
    return Client(redis_url)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


@contextmanager
def reported() -> Iterator[None]:
    """Turn the client's expected errors into a one-line message and an exit code."""
    try:
        yield
    except BatchNotFound as exc:
        fail(f"no such batch: {exc.args[0]}")
    except TimeoutError as exc:
        fail(str(exc), code=3)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def webhook_deliveries(c: Client, batch_id: str) -> list[dict[str, Any]]:
    """The batch's webhook delivery attempts, when the webhooks module is installed."""
    try:
        from worker.webhooks import delivery_log
    except ImportError:
        return []
    return delivery_log(c.connection, batch_id)


def show_batch(batch: Batch, as_json: bool, deliveries: list[dict[str, Any]] | None = None) -> None:
    """Print one batch: a JSON object, or a short human summary."""
    if as_json:
        extra = {"webhook_deliveries": deliveries} if deliveries is not None else {}
        typer.echo(json.dumps({**batch.model_dump(mode="json"), **extra}))
        return
    c = batch.request_counts
    console.print(
        f"[bold]{batch.id}[/bold]  {batch.status.value}  {c.completed}/{c.total} completed, {c.failed} failed"
    )
    console.print(
        f"  priority {batch.priority}, created {when(batch.created_at)}, expires {when(batch.expires_at)}"
    )
    for label, value in (
        ("output", batch.output_file),
        ("errors", batch.error_file),
        ("webhook", batch.webhook),
    ):
        if value:
            console.print(f"  {label}: {value}")
    if batch.metadata:
        console.print("  metadata: " + ", ".join(f"{k}={v}" for k, v in batch.metadata.items()))
    for e in batch.errors[:20]:
        where = f"line {e.line}: " if e.line else ""
        console.print(f"  [red]{e.code}[/red] {where}{e.message}")
    if len(batch.errors) > 20:
        console.print(f"  ... {len(batch.errors) - 20} more errors (use --json)")
    for d in deliveries or []:
        console.print("  webhook: " + " ".join(f"{k}={v}" for k, v in d.items()))


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--metadata expects key=value, got {pair!r}")
        out[key] = value
    return out


@app.command()
def submit(
    file: str = typer.Argument(..., help="JSONL file: a path, file:// or s3:// URL."),
    output: str = typer.Option(
        None, "--output", "-o", help="Where results go: s3://bucket/prefix or file:///dir."
    ),
    priority: str = typer.Option("default", help="Queue: high, default or low."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="key=value, repeatable."),
    idempotency_key: str = typer.Option(None, help="Re-submitting with the same key returns the same batch."),
    completion_window: str = typer.Option("24h", help="Unfinished requests expire after this long."),
    shard_size: int = typer.Option(256, help="Requests per shard (rq job)."),
    webhook: str = typer.Option(None, help="URL called when the batch ends."),
    redis_url: str = RedisUrl,
    as_json: bool = AsJson,
) -> None:
    """Validate and enqueue a batch file."""
    if "://" not in file and not Path(file).is_file():
        fail(f"no such file: {file}")
    with reported():
        batch = client(redis_url).submit_batch(
            file,
            output=output,
            priority=priority,
            metadata=parse_metadata(metadata),
            idempotency_key=idempotency_key,
            completion_window=completion_window,
            shard_size=shard_size,
            webhook=webhook,
        )
    show_batch(batch, as_json)
    if batch.status.value == "failed":
        raise typer.Exit(2)


@app.command()
def status(batch_id: str, redis_url: str = RedisUrl, as_json: bool = AsJson) -> None:
    """Show a batch's status, counts and files."""
    with reported():
        c = client(redis_url)
        show_batch(c.get(batch_id), as_json, webhook_deliveries(c, batch_id))


@app.command()
def wait(
    batch_id: str,
    timeout: float = typer.Option(None, help="Give up after this many seconds (exit 3)."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    redis_url: str = RedisUrl,
    as_json: bool = AsJson,
) -> None:
    """Wait for a batch to finish, with a progress bar."""
    with reported():
        batch = client(redis_url).wait(batch_id, timeout=timeout, progress=progress and not as_json)
    show_batch(batch, as_json)


@app.command()
def cancel(batch_id: str, redis_url: str = RedisUrl, as_json: bool = AsJson) -> None:
    """Cancel a batch: queued shards are dropped, running requests aborted, partial results kept."""
    with reported():
        show_batch(client(redis_url).cancel(batch_id), as_json)


@app.command()
def results(
    batch_id: str,
    errors: bool = typer.Option(False, "--errors", help="The error records instead of the outputs."),
    redis_url: str = RedisUrl,
    as_json: bool = AsJson,
) -> None:
    """Print a finished batch's output (or error) records."""
    with reported():
        for record in client(redis_url).results(batch_id, errors=errors):
            if as_json:
                typer.echo(record.model_dump_json())
            elif record.error is not None:
                console.print(
                    f"[bold]{record.custom_id}[/bold] [red]{record.error.code}[/red] {record.error.message}"
                )
            else:
                console.print(f"[bold]{record.custom_id}[/bold] {response_text(record.response.body)!r}")


def response_text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@app.command("list")
def list_batches(
    limit: int = typer.Option(20, help="How many, newest first."),
    redis_url: str = RedisUrl,
    as_json: bool = AsJson,
) -> None:
    """List recent batches."""
    batches = client(redis_url).list(limit)
    if as_json:
        typer.echo(json.dumps([b.model_dump(mode="json") for b in batches]))
        return
    table = Table("id", "status", "completed", "failed", "total", "priority", "created")
    for b in batches:
        c = b.request_counts
        table.add_row(
            b.id,
            b.status.value,
            str(c.completed),
            str(c.failed),
            str(c.total),
            b.priority,
            when(b.created_at),
        )
    console.print(table)


@app.command()
def worker(
    model: str = typer.Option(..., "--model", envvar="SLUICE_MODEL", help="Hugging Face checkpoint folder."),
    queues: str = typer.Option("high,default,low", help="Queues in priority order."),
    burst: bool = typer.Option(False, "--burst", help="Exit once the queues are empty."),
    dtype: str = typer.Option("auto"),
    device: str = typer.Option("auto"),
    quantization: str = typer.Option(None),
    kv_cache_dtype: str = typer.Option("auto"),
    max_num_seqs: int = typer.Option(256),
    max_num_batched_tokens: int = typer.Option(4096),
    max_model_len: int = typer.Option(None),
    block_size: int = typer.Option(16),
    kv_cache_memory_gb: float = typer.Option(None),
    gpu_memory_utilization: float = typer.Option(0.9),
    speculative: str = typer.Option(
        None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'.'
    ),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
    seed: int = typer.Option(0),
    heartbeat_ttl: int = typer.Option(
        None, help="Seconds before a silent worker's shards count as abandoned."
    ),
    grace: float = typer.Option(
        60.0, help="Seconds to finish in-flight shards after SIGTERM before handing back."
    ),
    name: str = typer.Option(None, help="Worker name (default: rq's)."),
    webhooks: bool = typer.Option(
        True, "--webhooks/--no-webhooks", help="Also deliver webhook events from a background thread."
    ),
    redis_url: str = RedisUrl,
) -> None:
    """Run a GPU worker: one engine kept full with shards from the queues."""
    import redis

    from engine import LLM
    from producer.settings import get_settings
    from worker.worker import EngineWorker

    settings = get_settings()
    engine_args = dict(
        dtype=dtype,
        device=device,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory_gb=kv_cache_memory_gb,
        gpu_memory_utilization=gpu_memory_utilization,
        speculative=json.loads(speculative) if speculative else None,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
    )
    llm = LLM(model, **engine_args)
    connection = redis.Redis.from_url(redis_url or settings.redis_url)
    ttl = heartbeat_ttl or settings.heartbeat_ttl
    w = EngineWorker(queues.split(","), llm, connection, heartbeat_ttl=ttl, grace=grace, name=name)
    stop = threading.Event()
    if webhooks:
        from worker import webhooks as delivery

        threading.Thread(target=delivery.run, args=(connection,), kwargs={"stop": stop}, daemon=True).start()
    try:
        w.work(burst=burst)
    finally:
        stop.set()


def wanted(command: str) -> bool:
    """Whether this process's command line asks for command (or for the list of all commands)."""
    args = sys.argv[1:]
    return not args or args[0] in (command, "--help", "-h")


def mount_extensions() -> None:
    """Add the commands other modules provide (`cron`, `quantize`) when those modules exist."""
    for module, attr, command in EXTENSIONS:
        if module in HEAVY and not wanted(command):
            continue
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        if isinstance(target, typer.Typer):
            app.add_typer(target, name=command)
        else:
            app.command(command)(target)


mount_extensions()

if __name__ == "__main__":
    app(sys.argv[1:])
