"""Sluice's inference engine: continuous batching over a paged KV cache (vLLM-compatible names)."""

from sluice.engine.config import EngineConfig
from sluice.engine.engine import Engine, RequestRejected
from sluice.engine.llm import LLM
from sluice.engine.outputs import EmbeddingOutput, RequestMetrics, RequestOutput
from sluice.engine.pooling import PoolingParams
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "EmbeddingOutput", "Engine", "EngineConfig", "PoolingParams", "RequestMetrics", "RequestOutput",
    "RequestRejected", "SamplingParams",
]
