"""Sluice's inference engine: continuous batching over a paged KV cache (vLLM-compatible names)."""

from engine.config import EngineConfig
from engine.engine import Engine, RequestRejected
from engine.llm import LLM
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestMetrics", "RequestOutput", "RequestRejected", "SamplingParams"]
