"""`python -m worker ...` is `sluice worker ...`."""

import sys

from producer.cli import app

app(["worker", *sys.argv[1:]], prog_name="python -m worker")
