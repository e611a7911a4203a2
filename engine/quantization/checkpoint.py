"""Write pre-quantized checkpoints in transformers' bitsandbytes format, so they load without
re-quantizing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from sluice.engine.models.llama import ModelConfig
from sluice.engine.models.loader import CheckpointReader, load_model, read_config
from sluice.engine.quantization.four_bit import Linear4bitCpu
from sluice.engine.quantization.int8_cpu import LLMInt8Linear
from sluice.engine.quantization.linears import FusedLinear, Quantizer, part_names
from sluice.engine.quantization.spec import QuantSpec, check_shapes

WEIGHTS = "model.safetensors"


def serialized(part: nn.Module) -> dict[str, torch.Tensor]:
    """A quantized linear's tensors as bitsandbytes serializes them (an LLM.int8() linear: `weight` (CB),
    `bias`, `SCB` and the `weight_format` marker 0, row-major, that Linear8bitLt writes beside them)."""
    state = {k: v.contiguous() for k, v in part.state_dict().items()}
    if isinstance(part, LLMInt8Linear):
        state["weight_format"] = torch.tensor(0, dtype=torch.uint8)
    return state


def quantized_linears(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """bitsandbytes' serialized state of every quantized linear, by the checkpoint's linear name."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        for name, mod in layer.named_modules():
            if ".parts." in name or not isinstance(mod,
                                                   FusedLinear | nn.Linear | LLMInt8Linear | Linear4bitCpu):
                continue
            parts = mod.parts if isinstance(mod, FusedLinear) else [mod]
            for hf_name, part in zip(part_names(f"model.layers.{i}.{name}"), parts, strict=True):
                out[hf_name] = serialized(part)
    return out


def save_quantized(src: str | Path, dst: str | Path, spec: QuantSpec, dtype: torch.dtype) -> Path:
    """Quantize the checkpoint at `src` layer by layer on CPU and write it, loadable as is, to `dst`."""
    src, dst = Path(src), Path(dst)
    quantization_config = spec.hf_config(dtype)
    hf_config = read_config(src)
    if hf_config.get("quantization_config"):
        raise ValueError(
            f"{src} is already quantized ({hf_config['quantization_config'].get('quant_method')})")
    c = ModelConfig.from_hf(hf_config)
    cpu = torch.device("cpu")
    check_shapes(spec, c, cpu)
    model = load_model(src, dtype, cpu, c.max_position_embeddings, Quantizer(spec, c, dtype, cpu),
                       huge_pages=False)  # written out, never run
    linears = quantized_linears(model)
    tensors = {f"{name}.{k}": v for name, state in linears.items() for k, v in state.items()}
    reader = CheckpointReader(src)
    for name in reader.names():
        if name.rsplit(".", 1)[0] not in linears:
            t = reader.get(name)
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
    for f in src.iterdir():
        skipped = ("config.json", f"{WEIGHTS}.index.json")
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in skipped:
            shutil.copy2(f, dst / f.name)
    hf_config |= {"quantization_config": quantization_config, "dtype": str(dtype).removeprefix("torch.")}
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return dst
