"""Sluice's inference engine: continuous batching over a paged KV cache (vLLM-compatible names).

The public names load on first use, so that the torch-free modules (engine.weight_reserve, which the worker's
entry point runs before torch is imported) can be imported without torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = [
    "LLM", "ClassificationOutput", "EmbeddingOutput", "Engine", "EngineConfig", "LoRARequest",
    "PoolingParams", "RequestMetrics", "RequestOutput", "RequestRejected", "SamplingParams",
]

_HOMES = {
    "EngineConfig": "config", "Engine": "engine", "RequestRejected": "engine", "LLM": "llm",
    "LoRARequest": "lora.lora_request", "EmbeddingOutput": "outputs", "RequestMetrics": "outputs",
    "RequestOutput": "outputs", "PoolingParams": "pooling", "SamplingParams": "sampling_params",
    "ClassificationOutput": "outputs",
}

if TYPE_CHECKING:
    from sluice.engine.config import EngineConfig
    from sluice.engine.engine import Engine, RequestRejected
    from sluice.engine.llm import LLM
    from sluice.engine.lora.lora_request import LoRARequest
    from sluice.engine.outputs import ClassificationOutput, EmbeddingOutput, RequestMetrics, RequestOutput
    from sluice.engine.pooling import PoolingParams
    from sluice.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    """A public name, imported from its module when first asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'sluice.engine' has no attribute {name!r}")
    value = getattr(import_module(f"sluice.engine.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
