"""Which forward a checkpoint takes: our native Llama-family one, or transformers' own modules on our paged
KV."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sluice.engine.models.rope import rope_parameters

NATIVE = "native"
GENERIC = "generic"
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
NATIVE_ROPE = ("default", "linear", "llama3")
_forced: list[bool] = []  # forced_generic() nesting


@contextmanager
def forced_generic() -> Iterator[None]:
    """Within it, models load on the generic path even where the native one serves them (parity tests,
    bench)."""
    _forced.append(True)
    try:
        yield
    finally:
        _forced.pop()


def native_architecture(cfg: dict[str, Any]) -> str | None:
    """The config's first architecture our native forward implements, if any."""
    return next((a for a in cfg.get("architectures") or [] if a in NATIVE_ARCHITECTURES), None)


def model_path_for(cfg: dict[str, Any]) -> tuple[str, str]:
    """(NATIVE or GENERIC, why) for a config.json dict; ValueError naming the feature where neither path
    serves it."""
    arch = native_architecture(cfg)
    rope = rope_parameters(cfg)["rope_type"]
    act = cfg.get("hidden_act", "silu")
    if arch is not None and rope in NATIVE_ROPE and act == "silu" and not _forced:
        return NATIVE, (f"{arch} runs on the native Llama-family forward (fused kernels, decode stack, "
                        "native MoE)")
    from sluice.engine.models.generic import check_generic

    name = check_generic(cfg)
    if arch is not None and _forced:
        return GENERIC, f"{arch}: generic path forced"
    if arch is not None:
        return GENERIC, (f"{arch} with rope_type {rope!r} / hidden_act {act!r}, which the native forward "
                         f"lacks (it has {', '.join(NATIVE_ROPE)} / silu): transformers' modules on the "
                         "paged KV cache")
    return GENERIC, (f"{name} is not a native architecture ({', '.join(NATIVE_ARCHITECTURES)}): "
                     "transformers' modules on the paged KV cache")
