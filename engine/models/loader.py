"""Load HF checkpoint folders (config.json + single or sharded safetensors) into our model, layer by layer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.llama import LlamaModel, ModelConfig
from engine.models.rope import RotaryEmbedding

LinearHook = Callable[[str, nn.Linear], nn.Module]


def read_config(path: str | Path) -> dict:
    """The checkpoint's config.json as a dict, with a clear error when it is missing."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {path!s}")
    return json.loads(cfg_file.read_text())


class CheckpointReader:
    """Tensors by name across one or many safetensors files, read one at a time."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: root / f for name, f in weight_map.items()}
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {root} (only safetensors is supported)")
            self.files = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    self.files.update({name: f for name in h.keys()})
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def _param(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)


def _load_linear(mod: nn.Linear, reader: CheckpointReader, hf_prefix: str, parts, dtype, device) -> None:
    names = [f"{hf_prefix}{p}" for p in parts]
    mod.weight = _param(torch.cat([reader.get(f"{n}.weight") for n in names]), dtype, device)
    if mod.bias is not None:
        mod.bias = _param(torch.cat([reader.get(f"{n}.bias") for n in names]), dtype, device)


def _load_layer(layer: nn.Module, reader, i: int, dtype, device, hook: LinearHook | None) -> None:
    prefix = f"model.layers.{i}."
    for name, mod in list(layer.named_modules()):
        if isinstance(mod, nn.Linear):
            if not getattr(hook, "prequantized", False):
                _load_linear(mod, reader, prefix, LlamaModel.FUSED.get(name, (name,)), dtype, device)
            if hook is not None:
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent), attr, hook(f"{prefix}{name}", mod))
        elif hasattr(mod, "weight") and isinstance(mod.weight, nn.Parameter) and name:
            mod.weight = _param(reader.get(f"{prefix}{name}.weight"), dtype, device)


def _head(model: LlamaModel) -> nn.Linear:
    """The LM head as a linear (sharing the embedding table when tied)."""
    if model.lm_head is not None:
        return model.lm_head
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
    head.weight = model.embed_tokens.weight
    return head


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    linear_hook: LinearHook | None = None,
    config: ModelConfig | None = None,
) -> LlamaModel:
    """Build our model from an HF folder, streaming tensors layer by layer onto `device` (`config`: its
    config.json when the caller has already read it)."""
    config = config or ModelConfig.from_hf(read_config(path))
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model.embed_tokens.weight = _param(reader.get("model.embed_tokens.weight"), dtype, device)
    model.norm.weight = _param(reader.get("model.norm.weight"), dtype, device)
    if model.lm_head is not None:
        name = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
        model.lm_head.weight = _param(reader.get(name), dtype, device)
    for i, layer in enumerate(model.layers):
        _load_layer(layer, reader, i, dtype, device, linear_hook)
    if getattr(linear_hook, "quantizes_head", False):
        model.lm_head = linear_hook("lm_head", _head(model))
    model.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope).to(device)
    reader.close()
    return model.eval()
