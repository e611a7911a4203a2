"""What the engine derives once at start-up from its config, the checkpoint's config.json and the
tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from sluice.engine.config import DTYPES, EngineConfig
from sluice.engine.models.llama import ModelConfig
from sluice.engine.models.loader import read_config


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but torch sees no CUDA device")
    return dev


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (bf16 in place of fp16 on CPU)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(DTYPES))} or 'auto'")
        return DTYPES[name]
    dtype = DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
    return torch.bfloat16 if dtype == torch.float16 and device.type == "cpu" else dtype


@dataclass(slots=True, frozen=True)
class ResolvedConfig:
    """Device, dtypes, length limit and EOS ids, resolved once; `hf_config` is config.json, read once."""

    hf_config: dict[str, Any]
    model: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]

    @classmethod
    def resolve(cls, config: EngineConfig) -> ResolvedConfig:
        """Read config.json and resolve every 'auto' setting; EOS ids from config.json and
        generation_config.json."""
        hf_config = read_config(config.model)
        model = ModelConfig.from_hf(hf_config)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, model.torch_dtype, device)
        kind = config.kv_cache_dtype
        kv_dtype = dtype if kind == "auto" else torch.int8 if kind == "int8" else DTYPES[kind]
        eos = frozenset(_eos_ids(config.model, model))
        return cls(hf_config, model, device, dtype, kv_dtype, _max_model_len(config, model), eos)

    def with_eos(self, eos_token_id: int | None) -> ResolvedConfig:
        """The same, with the tokenizer's EOS id among the EOS ids."""
        return self if eos_token_id is None else replace(self,
                                                         eos_token_ids=self.eos_token_ids | {eos_token_id})


def _max_model_len(config: EngineConfig, c: ModelConfig) -> int:
    limit = c.max_position_embeddings
    if c.sliding_window:
        limit = min(limit, c.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}")
        return config.max_model_len
    return limit


def _eos_ids(path: str, c: ModelConfig) -> set[int]:
    ids = set(c.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return ids
