"""A PEFT LoRA adapter read from its folder (adapter_config.json + adapter_model.safetensors) and checked
against the base model it is to serve.

The adapter's low-rank pairs are kept per decoder layer and per projection of our models, where the fused
projections (q/k/v as `self_attn.qkv_proj`, gate/up as `mlp.gate_up_proj`) hold one pair per part. The
scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is kept beside each pair.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_RANK = 128
# A checkpoint linear's name -> (our projection, part index inside it).
PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
PROJECTIONS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                 r"(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the reason."""


@dataclass(slots=True)
class LoRAPair:
    """One checkpoint linear's low-rank update: delta = scaling * B (A x)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: its pairs by (layer, projection, part), its largest rank and its size in bytes."""

    name: str
    path: str
    pairs: dict[tuple[int, str, int], LoRAPair] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((p.rank for p in self.pairs.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def read_adapter(name: str, path: str | Path, max_rank: int = MAX_RANK) -> LoRAAdapter:
    """Read and check an adapter folder (a clear LoRAError naming the field for anything not served)."""
    folder = Path(path)
    config = check_config(name, folder, max_rank)
    tensors = _weights(name, folder)
    default_scale = _scaling(config, int(config["r"]))
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: weight {key!r} is not a LoRA pair of a decoder linear "
                            "(embedding, lm_head and modules_to_save are not served)")
        layer, block, module, which = int(m[1]), m[2], m[3], m[4]
        local = f"{block}.{module}"
        if local not in PARTS:
            raise LoRAError(
                f"adapter {name!r}: target module {module!r} is not served (q/k/v/o/gate/up/down)")
        proj, part = PARTS[local]
        pairs.setdefault((layer, proj, part), {})[which] = tensor
    adapter = LoRAAdapter(name, str(folder))
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"adapter {name!r}: layer {where[0]} {where[1]} part {where[2]} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"adapter {name!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} of layer "
                            f"{where[0]} {where[1]} do not pair")
        if a.shape[0] > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {a.shape[0]} exceeds max_lora_rank ({max_rank})")
        adapter.pairs[where] = LoRAPair(a.contiguous(), b.contiguous(), default_scale)
    if not adapter.pairs:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} holds no LoRA weights")
    return adapter


def check_base(adapter: LoRAAdapter, num_layers: int, shapes: dict[str, list[tuple[int, int]]]) -> None:
    """Refuse an adapter made for another base: a layer it lacks or a pair whose shape does not fit.
    `shapes`: per projection, the (out, in) of each part."""
    for (layer, proj, part), pair in adapter.pairs.items():
        if layer >= num_layers:
            raise LoRAError(f"adapter {adapter.name!r}: layer {layer} does not exist in the base model "
                            f"({num_layers} layers): an adapter for another base")
        out, inp = shapes[proj][part]
        if pair.a.shape[1] != inp or pair.b.shape[0] != out:
            raise LoRAError(f"adapter {adapter.name!r}: layer {layer} {proj} part {part} is "
                            f"{pair.b.shape[0]}x{pair.a.shape[1]} but the base model's is {out}x{inp}: an "
                            "adapter for another base")


def check_config(name: str, path: str | Path, max_rank: int = MAX_RANK) -> dict:
    """The adapter's config, checked (cheap: no weights read); LoRAError naming what is not served."""
    config = _config(name, Path(path))
    _check_config(name, config, max_rank)
    return config


def _config(name: str, folder: Path) -> dict:
    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: {folder} is not a folder")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise LoRAError(f"adapter {name!r}: {folder} has no {CONFIG}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAError(f"adapter {name!r}: {CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG} is not a JSON object")
    return config


def _check_config(name: str, config: dict, max_rank: int) -> None:
    """Every PEFT field whose meaning we do not run is an error naming it."""
    def refuse(what: str) -> LoRAError:
        return LoRAError(f"adapter {name!r}: {what} is not served")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} (LORA only)")
    if config.get("use_dora"):
        raise refuse("use_dora (DoRA)")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']!r}")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config['bias']!r} (only 'none')")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise refuse(key)
    if config.get("use_qalora") or config.get("lora_bias"):
        raise refuse("use_qalora/lora_bias")
    for key in ("layer_replication", "trainable_token_indices"):
        if config.get(key):
            raise refuse(key)
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAError(f"adapter {name!r}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {r} exceeds max_lora_rank ({max_rank})")
    targets = config.get("target_modules") or []
    named = [targets] if isinstance(targets, str) else list(targets)
    for t in named:
        if t in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
            raise refuse(f"target module {t!r} (embedding or lm_head LoRA)")


def _scaling(config: dict, r: int) -> float:
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / WEIGHTS
    if not file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoRAError(f"adapter {name!r}: adapter_model.bin is a pickle, which is never loaded; save "
                            "the adapter with safetensors (PEFT's default)")
        raise LoRAError(f"adapter {name!r}: {folder} has no {WEIGHTS}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} cannot be read ({exc})") from None
