"""The `sluice` command line: batch commands, the worker, cron pipelines, webhook delivery, quantize,
doctor."""

from __future__ import annotations

import sys


def wanted(command: str) -> bool:
    """Whether this process's command line asks for command (or for the list of all commands)."""
    args = sys.argv[1:]
    return not args or args[0] in (command, "--help", "-h")


WORKER_ONLY = sys.argv[1:2] == ["worker"]
if WORKER_ONLY:  # first: the weights' disk read overlaps every import below
    from sluice.worker import collector
    from sluice.worker.prefetch import prefetch_for, reserve_for

    collector.pause()  # until the imports are done (sluice.worker.cli.start resumes it)
    reserve_for(sys.argv[2:])  # the weights' read into the arena overlaps the imports below
    prefetch_for(sys.argv[2:])

import typer  # noqa: E402

app = typer.Typer(name="sluice", help="Queue-driven batch inference for LLMs.", no_args_is_help=True)


@app.callback()
def sluice() -> None:
    """Queue-driven batch inference for LLMs."""


# The worker loads none of the other commands' modules (the server's FastAPI, boto3, cron): its start-up is
# the time to ready of every new GPU. These two import torch (seconds): loaded only for their own command or
# the list.
if not WORKER_ONLY:
    from sluice.cli.batch_commands import batches_app
    from sluice.cli.server import keys_app, serve
    from sluice.producer.cron import cron_app
    from sluice.worker.reaper import reaper_app
    from sluice.worker.webhooks import webhooks_app

    app.add_typer(batches_app)
    app.add_typer(cron_app, name="cron")
    app.add_typer(webhooks_app, name="webhooks")
    app.add_typer(reaper_app, name="reaper")
    app.command("serve")(serve)
    app.add_typer(keys_app, name="keys")
if not WORKER_ONLY:  # cheap to import: torch loads when it runs
    from sluice.cli.doctor import doctor

    app.command("doctor")(doctor)
if wanted("worker"):
    from sluice.worker.cli import worker

    app.command("worker")(worker)
if wanted("quantize"):
    from sluice.cli.quantize import quantize

    app.command("quantize")(quantize)

if __name__ == "__main__":
    app(sys.argv[1:])
