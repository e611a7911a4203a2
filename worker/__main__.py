"""`python -m sluice.worker ...` is `sluice worker ...`."""

import sys

from sluice.worker.prefetch import prefetch_for

prefetch_for(sys.argv[1:])  # first: the weights' disk read overlaps the imports below

import typer  # noqa: E402

from sluice.worker.cli import worker  # noqa: E402

app = typer.Typer(add_completion=False)
app.command()(worker)
app(prog_name="python -m sluice.worker")
