"""Triton kernels for the device path; import lazily (triton is optional and absent on most CPU hosts)."""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether triton can be imported here."""
    return importlib.util.find_spec("triton") is not None
