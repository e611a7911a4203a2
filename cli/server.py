"""`sluice serve` and `sluice keys create|list|revoke|webhook`."""

from __future__ import annotations

import json

import typer

from sluice.contract.logs import configure
from sluice.contract.redis_conn import connect
from sluice.contract.settings import get_settings
from sluice.producer.client import check_webhook

keys_app = typer.Typer(
    help="API keys for `sluice serve`: one project per key, stored hashed in Redis.", no_args_is_help=True
)
RedisUrl = typer.Option(None, "--redis-url", help="Redis URL (default: $SLUICE_REDIS_URL).")


def key_store(redis_url: str | None):
    from sluice.producer.server.keys import KeyStore  # producer.server imports fastapi: only for its commands

    return KeyStore(connect(redis_url or get_settings().redis_url))


def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8000, help="TCP port."),
    max_file_mb: int = typer.Option(200, help="Largest upload accepted, in MB."),
    max_file_requests: int = typer.Option(50_000, help="Most requests in one uploaded batch file."),
    log_format: str = typer.Option("text", help="text or json (one object per line, with batch/job ids)."),
    redis_url: str = RedisUrl,
) -> None:
    """Serve the OpenAI-compatible Batch API, the dashboard (/) and /metrics over the queues."""
    import uvicorn  # uvicorn and fastapi take a second to import: only for `sluice serve`

    from sluice.producer.server import create_app
    from sluice.producer.server.context import ServerLimits

    configure(log_format)
    settings = get_settings()
    if redis_url:
        settings.redis_url = redis_url
    app = create_app(settings, ServerLimits(max_file_mb * 1000 * 1000, max_file_requests))
    uvicorn.run(app, host=host, port=port, access_log=False, log_config=None)


@keys_app.command("create")
def create(
    project: str = typer.Argument(..., help="The project the key acts for (owns its files and batches)."),
    name: str = typer.Option("", help="A label, e.g. who uses the key."),
    redis_url: str = RedisUrl,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a key; its secret is printed once and only its hash is stored."""
    try:
        key, secret = key_store(redis_url).create(project, name)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"id": key.id, "project": key.project, "name": key.name, "secret": secret}))
    else:
        typer.echo(
            f"{key.id} (project {key.project})\n{secret}\nKeep this secret: it is not stored and cannot be "
            "shown again."
        )


@keys_app.command("list")
def list_keys(
    project: str = typer.Option(None, help="Only this project's keys."),
    redis_url: str = RedisUrl,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List live keys (ids, projects, prefixes; never secrets)."""
    keys = key_store(redis_url).list(project)
    if as_json:
        typer.echo(json.dumps([k.model_dump(exclude={"digest"}) for k in keys]))
        return
    for k in keys:
        typer.echo(f"{k.id}  {k.project}  {k.prefix}…  {k.name}")


@keys_app.command("revoke")
def revoke(key_id: str, redis_url: str = RedisUrl) -> None:
    """Revoke a key: its secret stops working at once."""
    try:
        key = key_store(redis_url).revoke(key_id)
    except KeyError:
        typer.echo(f"error: no such key: {key_id}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"revoked {key.id} (project {key.project})")


@keys_app.command("webhook")
def webhook(
    project: str,
    url: str = typer.Argument(
        None, help="URL called when each of the project's batches ends; omit to clear."
    ),
    redis_url: str = RedisUrl,
) -> None:
    """Set (or clear) the webhook used by every batch the project creates through the API."""
    from sluice.producer.server.keys import ProjectSettings  # fastapi, as in key_store

    try:
        checked = check_webhook(url, get_settings().webhook_allow)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    key_store(redis_url).set_settings(project, ProjectSettings(webhook_url=checked))
    typer.echo(f"project {project}: webhook {'set' if checked else 'cleared'}")
