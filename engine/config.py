"""Engine configuration: one dataclass; `LLM` filters its keyword arguments against these fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to know besides the weights."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    quantization: str | None = None
    quant_type: str = "nf4"
    double_quant: bool = False
    llm_int8_threshold: float = 6.0
    kv_cache_dtype: str = "auto"
    speculative: dict[str, Any] | None = None
    enforce_eager: bool = False
    tokenizer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size: power of two"
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, refusing unknown keyword arguments by name."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
