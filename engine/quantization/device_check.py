"""Refuse devices bitsandbytes has no kernels for, by running one tiny quantized matmul there first (where
bitsandbytes serves: not on CPU, where LLM.int8() and the 4-bit linears run our kernels)."""

from __future__ import annotations

import torch

from sluice.engine.quantization.linears import quantized_linear
from sluice.engine.quantization.spec import (
    BLOCKSIZE,
    CPU_INT4_ROWS,
    INT4_WEIGHT_ONLY,
    SERVED_DEVICES,
    WEIGHT_ONLY,
    QuantSpec,
)


def check_device(spec: QuantSpec, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse devices bitsandbytes has no kernels for, and run one tiny quantized matmul there."""
    if spec.method in (WEIGHT_ONLY, INT4_WEIGHT_ONLY) or device.type == "cpu":
        return  # our own kernels (on CPU: engine/quantization/int8_cpu.py, four_bit.py)
    if device.type not in SERVED_DEVICES:
        raise ValueError(f"quantization={spec.method!r} needs bitsandbytes kernels, which exist for "
                         f"{', '.join(SERVED_DEVICES)}; not for device {device.type!r}")
    probe = torch.nn.Linear(BLOCKSIZE, CPU_INT4_ROWS, bias=False, device=device, dtype=dtype)
    try:
        quantized_linear(spec, probe.weight.data, None, dtype).eval()(torch.ones(1, BLOCKSIZE, device=device,
                                                                                dtype=dtype))
    except Exception as exc:
        raise ValueError(f"bitsandbytes {_bnb_version()} cannot serve quantization={spec.method!r} "
                         f"on {device} in {dtype}: {exc}") from exc


def _bnb_version() -> str:
    import bitsandbytes

    return bitsandbytes.__version__
