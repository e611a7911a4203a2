"""Engine configuration: one dataclass; `LLM` filters its keyword arguments against these fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("draft", "ngram")
# Measured on CPU with the bundled pair (docs/benchmarks.md, speculative decoding): the bf16 and int8 drafts
# gain >= 1.16x up to 8 running requests and 0.89-1.08x beyond, where a larger target's compute-bound step
# would lose; n-gram lookup costs nothing to propose but verifying still grows with the batch.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(slots=True)
class SpeculativeConfig:
    """Validated speculative settings (the `speculative={...}` dict of `LLM`)."""

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs 'model': the draft checkpoint folder")
        if self.method != "draft" and self.quantization is not None:
            raise ValueError("speculative 'quantization' quantizes only a draft model (method 'draft')")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative prompt_lookup_min/max must satisfy 1 <= min <= max")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 0, "
                             f"got {self.disable_by_batch_size!r}")

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Check the user's dict and name what is wrong."""
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        return cls(**{"method": None, **raw})


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
    speculative_config: SpeculativeConfig | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size: power of two"
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative) if self.speculative else None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, refusing unknown keyword arguments by name."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
