"""`sluice` batch commands: submit, status, wait, cancel, resume, results, list (human output or --json)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sluice.contract.events import delivery_log
from sluice.contract.responses_api import output_text
from sluice.contract.schemas import Batch
from sluice.producer.client import BatchNotFound, Client

batches_app = typer.Typer()
console = Console()
err = Console(stderr=True)

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
    """The batch's webhook delivery attempts."""
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


@batches_app.command()
def submit(
    file: str = typer.Argument(..., help="JSONL file: a path, file:// or s3:// URL."),
    output: str = typer.Option(
        None, "--output", "-o", help="Where results go: s3://bucket/prefix or file:///dir."
    ),
    priority: str = typer.Option("default", help="Queue: high, default or low."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="key=value, repeatable."),
    idempotency_key: str = typer.Option(None, help="Re-submitting with the same key returns the same batch."),
    completion_window: str = typer.Option(
        None, help="Unfinished requests expire after this long (default: $SLUICE_COMPLETION_WINDOW or 24h)."
    ),
    shard_size: int = typer.Option(
        None, help="Requests per shard (rq job) (default: $SLUICE_SHARD_SIZE or 256)."
    ),
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


@batches_app.command()
def status(batch_id: str, redis_url: str = RedisUrl, as_json: bool = AsJson) -> None:
    """Show a batch's status, counts and files."""
    with reported():
        c = client(redis_url)
        show_batch(c.get(batch_id), as_json, webhook_deliveries(c, batch_id))


@batches_app.command()
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


@batches_app.command()
def cancel(batch_id: str, redis_url: str = RedisUrl, as_json: bool = AsJson) -> None:
    """Cancel a batch: queued shards are dropped, running requests aborted, partial results kept."""
    with reported():
        show_batch(client(redis_url).cancel(batch_id), as_json)


@batches_app.command()
def resume(
    batch_id: str,
    output: str = typer.Option(None, "--output", "-o", help="Where results go (default: the original's)."),
    priority: str = typer.Option(None, help="Queue: high, default or low (default: the original's)."),
    completion_window: str = typer.Option(None, help="For the new batch (default: the original's)."),
    shard_size: int = typer.Option(None, help="Requests per shard (default: $SLUICE_SHARD_SIZE or 256)."),
    redis_url: str = RedisUrl,
    as_json: bool = AsJson,
) -> None:
    """A new batch of a done batch's lines without a result (expired, cancelled, failed shards); its output
    also carries the finished ones, so it holds every custom_id of the original once."""
    with reported():
        batch = client(redis_url).resume(batch_id, output=output, priority=priority,
                                         completion_window=completion_window, shard_size=shard_size)
    show_batch(batch, as_json)
    if batch.status.value == "failed":
        raise typer.Exit(2)


@batches_app.command()
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
    if body.get("object") == "response":  # /v1/responses
        return output_text(body)
    if "results" in body:  # /v1/rerank, /v1/moderations
        return f"{len(body['results'])} result(s)"
    if body.get("object") == "list" and body["data"] and body["data"][0].get("object") == "score":
        return "scores " + ", ".join(f"{d['score']:.4g}" for d in body["data"])
    if body.get("object") == "list":  # /v1/embeddings
        first = body["data"][0]["embedding"]
        return f"{len(body['data'])} embedding(s) of " + (f"{len(first)} values" if isinstance(first, list)
                                                          else "base64")
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@batches_app.command("list")
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
