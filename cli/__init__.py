"""The `sluice` command line, on top of the producer and the worker (neither imports it)."""
