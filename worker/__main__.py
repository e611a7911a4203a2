"""`python -m worker ...` is `sluice worker ...`."""

import typer

from worker.cli import worker

app = typer.Typer(add_completion=False)
app.command()(worker)
app(prog_name="python -m worker")
