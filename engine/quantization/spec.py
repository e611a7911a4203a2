"""What to quantize and how: the engine's settings or a checkpoint's `quantization_config`, checked up
front."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sluice.engine.models.llama import ModelConfig
from sluice.kernels import int4_weights

BNB_METHODS = ("int8", "int4")
WEIGHT_ONLY = "int8_weight_only"
INT4_WEIGHT_ONLY = "int4_weight_only"
METHODS = (*BNB_METHODS, WEIGHT_ONLY, INT4_WEIGHT_ONLY)
QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZE = 64
SERVED_DEVICES = ("cpu", "cuda", "xpu")
CPU_INT4_ROWS = 32


@dataclass(slots=True)
class QuantSpec:
    """A bitsandbytes method (LLM.int8() linears, or 4-bit NF4/FP4 linears with blocksize 64), or int8 weights
    with one scale per output row (`int8_weight_only`), or 4-bit weights in groups of 32 (`int4_weight_only`),
    LM head included in both."""

    method: str
    quant_type: str = "nf4"
    double_quant: bool = False
    threshold: float = 6.0
    prequantized: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown quantization {self.method!r}; choose one of {', '.join(METHODS)} or None")
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"unknown quant_type {self.quant_type!r} for int4; choose nf4 or fp4")
        if self.threshold < 0:
            raise ValueError(
                f"llm_int8_threshold must be >= 0 (0 disables outlier columns), got {self.threshold}")

    def hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The `quantization_config` transformers writes for bitsandbytes checkpoints."""
        if self.method not in BNB_METHODS:
            raise ValueError(f"{self.method} quantizes while loading; only {' and '.join(BNB_METHODS)} "
                             "(bitsandbytes) checkpoints can be written")
        four = self.method == "int4"
        return {
            "quant_method": "bitsandbytes",
            "load_in_8bit": not four,
            "load_in_4bit": four,
            "llm_int8_threshold": self.threshold,
            "llm_int8_has_fp16_weight": False,
            "llm_int8_skip_modules": ["lm_head"],
            "llm_int8_enable_fp32_cpu_offload": False,
            "bnb_4bit_quant_type": self.quant_type,
            "bnb_4bit_use_double_quant": self.double_quant,
            "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch."),
            "bnb_4bit_quant_storage": "uint8",
        }

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> QuantSpec:
        """Read a checkpoint's bitsandbytes `quantization_config`; refuse other methods by name."""
        method = qc.get("quant_method")
        if method != "bitsandbytes":
            raise ValueError(
                f"checkpoint quantization_config has quant_method={method!r}; only bitsandbytes loads")
        if not (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
            raise ValueError("bitsandbytes quantization_config sets neither load_in_4bit nor load_in_8bit")
        return cls(
            method="int4" if qc.get("load_in_4bit") else "int8",
            quant_type=qc.get("bnb_4bit_quant_type", "nf4"),
            double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)),
            threshold=float(qc.get("llm_int8_threshold", 6.0)),
            prequantized=True,
        )


def resolve_spec(config, hf_config: dict[str, Any]) -> QuantSpec | None:
    """The checkpoint's own quantization if it has one (a different request is an error), else the
    config's."""
    qc = hf_config.get("quantization_config")
    if qc:
        spec = QuantSpec.from_hf(qc)
        if config.quantization not in (None, spec.method):
            raise ValueError(f"checkpoint {config.model} is already quantized as {spec.method}; "
                             f"quantization={config.quantization!r} cannot re-quantize it (pass None)")
        return spec
    if config.quantization is None:
        return None
    return QuantSpec(config.quantization, config.quant_type, config.double_quant, config.llm_int8_threshold)


def check_shapes(spec: QuantSpec, c: ModelConfig, device: torch.device) -> None:
    """Refuse linear shapes the 4-bit kernels cannot pack, naming the layer."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if spec.method == INT4_WEIGHT_ONLY:
        _check_int4_weight_only(c, q, kv)
    if spec.method != "int4" or device.type != "cpu":
        return
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    for name, (n_in, n_out) in shapes.items():
        if n_in % BLOCKSIZE or n_out % CPU_INT4_ROWS:
            raise ValueError(
                f"int4 cannot quantize {name} ({n_in} -> {n_out}) on CPU: the CPU 4-bit layout needs "
                f"in_features divisible by the blocksize {BLOCKSIZE} and out_features by {CPU_INT4_ROWS}"
            )


def _check_int4_weight_only(c: ModelConfig, q: int, kv: int) -> None:
    shapes = {"qkv_proj": (c.hidden_size, q + 2 * kv), "o_proj": (q, c.hidden_size),
              "gate_up_proj": (c.hidden_size, 2 * c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size), "lm_head": (c.hidden_size, c.vocab_size)}
    for name, (n_in, n_out) in shapes.items():
        err = int4_weights.shape_error(n_out, n_in)
        if err:
            raise ValueError(f"int4_weight_only cannot quantize {name} ({n_in} -> {n_out}): {err}")
