"""`python -m sluice.worker ...` is `sluice worker ...`."""

import sys

from sluice.worker import collector
from sluice.worker.prefetch import prefetch_for, reserve_for

collector.pause()  # until the imports are done (sluice.worker.cli.start resumes it)
reserve_for(sys.argv[1:])  # first: the weights' read into the arena overlaps the imports below
prefetch_for(sys.argv[1:])  # the page-cache read, where that read does not run

import typer  # noqa: E402

from sluice.worker.cli import worker  # noqa: E402

app = typer.Typer(add_completion=False)
app.command()(worker)
app(prog_name="python -m sluice.worker")
