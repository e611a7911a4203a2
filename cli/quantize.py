"""`sluice quantize SRC DST`: write a pre-quantized copy of a checkpoint (mounted by cli/main.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from sluice.engine.models.loader import read_config
from sluice.engine.quantization import QuantSpec, save_quantized
from sluice.engine.resolved import resolve_dtype


def quantize(
    src: Path,
    dst: Path,
    quantization: str = "int4",
    quant_type: str = "nf4",
    double_quant: bool = False,
    llm_int8_threshold: float = 6.0,
    dtype: str = "auto",
) -> None:
    """Quantize SRC (an HF folder) with bitsandbytes int8/int4 into DST, which then loads without
    re-quantizing."""
    spec = QuantSpec(quantization, quant_type, double_quant, llm_int8_threshold)
    cfg = read_config(src)
    torch_dtype = resolve_dtype(dtype, cfg.get("torch_dtype") or cfg.get("dtype"), torch.device("cpu"))
    out = save_quantized(src, dst, spec, torch_dtype)
    how = f"{quant_type}{', double quant' if double_quant else ''}" if quantization == "int4" else \
        f"threshold {llm_int8_threshold}"
    print(f"wrote {quantization} ({how}) checkpoint to {out}")
