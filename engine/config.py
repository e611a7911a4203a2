"""Engine configuration: the settings `LLM` and the worker take, each with its default and help, validated
once.

`LLM` filters its keyword arguments against EngineConfig's fields; the CLI builds worker flags from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from sluice.engine.models.loader import WEIGHT_LOADING
from sluice.engine.quantization.spec import QuantSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "half": torch.float16}
KV_CACHE_DTYPES = ("auto", "int8", *DTYPES)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

METHODS = ("draft", "ngram")
# Measured on CPU with the bundled pair (docs/benchmarks.md, "Speculative decoding"): the drafts gain up to
# this many running requests and not beyond, where a larger target's compute-bound step would lose; n-gram
# lookup costs nothing to propose but verifying still grows with the batch.
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
            raise ValueError(
                f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
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
        if self.quantization is not None:
            QuantSpec(self.quantization)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Check the user's dict and name what is wrong."""
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        return cls(**{"method": None, **raw})


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to know besides the weights."""

    model: str = field(metadata={"help": "Hugging Face checkpoint folder (config.json + safetensors)."})
    dtype: str = _opt("auto",
                      "Compute dtype: auto (the checkpoint's; bf16 for fp16 on CPU), bfloat16, float16, "
                      "float32.")
    device: str = _opt("auto", "Device: auto (CUDA when present, else CPU), cpu, cuda, cuda:N.")
    block_size: int = _opt(16, "Tokens per KV cache block (a power of two).")
    max_num_seqs: int = _opt(256, "Most requests running in one step.")
    max_num_batched_tokens: int = _opt(4096, "Most tokens computed in one step (prefill is chunked to fit).")
    max_model_len: int | None = _opt(None, "Longest prompt + output in tokens (default: the model's limit).")
    kv_cache_memory_gb: float | None = _opt(None, "KV cache size in GiB (default: free GPU memory times "
                                                  "gpu_memory_utilization; on CPU enough for max_num_seqs "
                                                  "full-length requests, at most 4 GiB).")
    gpu_memory_utilization: float = _opt(0.9,
                                         "Fraction of GPU memory the engine may fill (weights + KV cache).")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of identical prompt prefixes.")
    seed: int = _opt(0, "Seed of the sampler for requests without their own seed.")
    quantization: str | None = _opt(None,
                                    "Weight quantization: int8, int4 (bitsandbytes) or int8_weight_only.")
    quant_type: str = _opt("nf4", "4-bit data type for int4: nf4 or fp4.")
    double_quant: bool = _opt(False, "int4: also quantize the quantization constants.")
    llm_int8_threshold: float = _opt(6.0,
                                     "int8: outlier threshold of LLM.int8() (0 disables outlier columns).")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype: auto (the compute dtype), int8, bfloat16, float16, "
                                       "float32.")
    speculative: dict[str, Any] | None = _opt(None, 'Speculative decoding as JSON, e.g. {"method": "ngram", '
                                                    '"num_speculative_tokens": 4}; methods: ngram, draft.')
    enforce_eager: bool = _opt(False,
                               "CUDA: run every step eagerly (no CUDA graph replay of pure-decode steps).")
    tokenizer: str | None = _opt(None, "Tokenizer folder (default: the model folder).")
    weight_loading: str = _opt("auto",
                               "CPU weights: auto (from 4 GiB of weights, unquantized tensors stored as "
                               "used are the checkpoint file's own page-cache pages, mapped "
                               "copy-on-write; below that, copy), mmap (at any size), copy (each read "
                               "into private memory).")
    huge_pages: bool = _opt(True, "CPU: private weights in one arena collapsed into transparent huge pages "
                                  "after loading (faster decode steps where they stream weights: "
                                  "docs/benchmarks.md).")
    cpu_kernel: bool | None = _opt(None, "CPU: our C++ kernels; off runs torch's implementations (default: "
                                         "SLUICE_CPU_KERNEL, on).")
    cpu_isa: str | None = _opt(None, "CPU: cap on the ISA tier the C++ kernels are built for: avx2, avx512, "
                                     "avx512_bf16 or amx (default: SLUICE_CPU_ISA, else the host's).")
    packed_weights: bool | None = _opt(None, "CPU, AVX512-BF16 without AMX: each bf16 weight also packed "
                                             "into panels, its products' faster layout at every row count (a "
                                             "second copy, at most half the memory available; default: "
                                             "SLUICE_PACKED_WEIGHTS, on).")
    device_path: bool | None = _opt(None,
                                    "FlatMetadata steps (Triton on CUDA) forced on or off on any device "
                                    "(default: SLUICE_DEVICE_PATH, else on where CUDA has triton).")
    logprobs_mode: str = _opt("raw_logprobs",
                              "What logprobs report (vLLM's choices): raw_logprobs (the model's "
                              "distribution), raw_logits, processed_logprobs or processed_logits "
                              "(after logit_bias, penalties, the grammar mask, temperature, min-p, "
                              "top-k and top-p).")
    json_max_number_digits: int = _opt(32, "Structured outputs: most digits in each part (integer, fraction, "
                                           "exponent) of a number a JSON schema allows "
                                           "(SLUICE_JSON_MAX_NUMBER_DIGITS).")
    json_max_string_chars: int = _opt(8192, "Structured outputs: most characters in a string a JSON schema "
                                            "does not bound itself (SLUICE_JSON_MAX_STRING_CHARS).")
    moderation_thresholds: dict[str, float] | None = _opt(
        None, 'Encoder classifiers: /v1/moderations thresholds per category as JSON, e.g. {"toxic": 0.7, '
              '"default": 0.5} (0.5 for a category without one).')
    enable_lora: bool = _opt(False,
                             "Serve PEFT LoRA adapters (requests name one by LoRARequest); the decoder "
                             "projections get adapter slots.")
    max_loras: int = _opt(1, "LoRA: adapters in working memory at once (requests of more adapters wait).")
    max_lora_rank: int = _opt(16,
                              "LoRA: the largest adapter rank served (at most 128); slots are sized by it.")
    max_cpu_loras: int | None = _opt(None, "LoRA: adapters kept loaded in host memory, least recently used "
                                           "dropped first (default: max_loras).")
    extra: dict[str, Any] = field(default_factory=dict,
                                  metadata={"help": "Free-form settings the engine ignores."})
    speculative_config: SpeculativeConfig | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(set(DTYPES))} or 'auto'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose auto, int8, bfloat16, "
                             "float16 or float32")
        if self.weight_loading not in WEIGHT_LOADING:
            raise ValueError(f"unknown weight_loading {self.weight_loading!r}; choose one of "
                             f"{', '.join(WEIGHT_LOADING)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"unknown logprobs_mode {self.logprobs_mode!r}; choose one of {', '.join(LOGPROBS_MODES)}")
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 128:
            raise ValueError(f"max_loras must be >= 1 and max_lora_rank in [1, 128], got {self.max_loras} "
                             f"and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.quantization is not None:
            QuantSpec(self.quantization, self.quant_type, self.double_quant, self.llm_int8_threshold)
        self.speculative_config = SpeculativeConfig.parse(self.speculative) if self.speculative else None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, refusing unknown keyword arguments by name."""
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
