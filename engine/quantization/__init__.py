"""Quantization of weights: LLM.int8() and NF4/FP4 linears in bitsandbytes' format (quantized while loading,
or read pre-quantized; ours on CPU, bitsandbytes' elsewhere) and weight-only int8/int4 linears. The int8 KV
cache is engine.kv_cache's."""

from __future__ import annotations

import torch

from sluice.engine.models.llama import ModelConfig
from sluice.engine.models.loader import LinearHook, read_config
from sluice.engine.quantization.checkpoint import save_quantized
from sluice.engine.quantization.device_check import check_device
from sluice.engine.quantization.linears import FusedLinear, Quantizer, pack_4bit_for_cpu
from sluice.engine.quantization.spec import QuantSpec, check_shapes, resolve_spec

__all__ = ["FusedLinear", "QuantSpec", "linear_hook", "pack_4bit_for_cpu", "save_quantized"]


def linear_hook(config, device: torch.device, dtype: torch.dtype,
                hf_config: dict | None = None) -> LinearHook | None:
    """The loader hook for the config's (or the checkpoint's) quantization, checked before any weight loads;
    `hf_config` is the checkpoint's config.json when the caller has already read it."""
    hf_config = hf_config if hf_config is not None else read_config(config.model)
    spec = resolve_spec(config, hf_config)
    if spec is None:
        return None
    c = ModelConfig.from_hf(hf_config)
    check_device(spec, device, dtype)
    check_shapes(spec, c, device)
    return Quantizer(spec, c, dtype, device, spec.prequantized)
