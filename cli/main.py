"""The `sluice` command line: batch commands, the worker, cron pipelines, webhook delivery, quantize."""

from __future__ import annotations

import sys

import typer

from cli.batches import batches_app
from cli.server import keys_app, serve
from producer.cron import cron_app
from worker.reaper import reaper_app
from worker.webhooks import webhooks_app

app = typer.Typer(name="sluice", help="Queue-driven batch inference for LLMs.", no_args_is_help=True)
app.add_typer(batches_app)
app.add_typer(cron_app, name="cron")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(reaper_app, name="reaper")
app.command("serve")(serve)
app.add_typer(keys_app, name="keys")


def wanted(command: str) -> bool:
    """Whether this process's command line asks for command (or for the list of all commands)."""
    args = sys.argv[1:]
    return not args or args[0] in (command, "--help", "-h")


# These two import torch (seconds): loaded only for their own command or the list of commands.
if wanted("worker"):
    from worker.cli import worker

    app.command("worker")(worker)
if wanted("quantize"):
    from cli.quantize import quantize

    app.command("quantize")(quantize)

if __name__ == "__main__":
    app(sys.argv[1:])
