"""Which checkpoints are vision-language ones, and their language model's config (no heavy imports here)."""

from __future__ import annotations

from typing import Any

VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Served by transformers' own modules on the generic path (models.vl_generic, multimodal.vl_families).
GENERIC_VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration")


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    """True where config.json names a vision-language architecture the engine serves natively."""
    return any(a in VISION_ARCHITECTURES for a in hf_config.get("architectures") or [])


def is_generic_vision(hf_config: dict[str, Any]) -> bool:
    """True where config.json names a vision-language architecture the generic path serves."""
    return any(a in GENERIC_VISION_ARCHITECTURES for a in hf_config.get("architectures") or [])


def text_config_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a vision-language config.json (read as a Qwen2 causal LM); other configs
    as they are."""
    if not is_vision_language(hf_config):
        return hf_config
    text = dict(hf_config.get("text_config") or hf_config)
    text.setdefault("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
    text.setdefault("dtype", hf_config.get("dtype") or hf_config.get("torch_dtype"))
    return {**text, "architectures": ["Qwen2ForCausalLM"]}
