"""Sluice: queue-driven batch inference for LLMs.

The short public surface, `from sluice import LLM, SamplingParams, Client`, is loaded on first use, so that
`import sluice.worker` or `sluice.contract` pays for no torch or Redis client it does not need.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["LLM", "Client", "LoRARequest", "SamplingParams"]

_HOMES = {"LLM": "sluice.engine", "SamplingParams": "sluice.engine", "LoRARequest": "sluice.engine",
          "Client": "sluice.producer.client"}

if TYPE_CHECKING:
    from sluice.engine import LLM, LoRARequest, SamplingParams
    from sluice.producer.client import Client


def __getattr__(name: str):
    """`LLM`, `SamplingParams`, `LoRARequest` and `Client`, imported from their modules when first asked
    for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
