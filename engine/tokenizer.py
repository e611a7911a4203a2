"""The model's tokenizer, loaded without transformers' model-config machinery where the folder allows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path, hf_config: dict[str, Any] | None = None) -> Any:
    """The tokenizer transformers' AutoTokenizer would load for `path` (`hf_config`: the folder's config.json
    where the caller has read it already).

    A local folder whose tokenizer_config.json names the generic tokenizers-backed class (what transformers
    itself writes) is loaded through that class directly: AutoTokenizer would first build the model's
    config class, whose module pulls in transformers' modeling and torch's distributed and compiler stacks
    (over a second of CPU at every worker start) only to reach the same class. Anything else goes through
    AutoTokenizer.
    """
    if _generic_folder(Path(path), hf_config):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generic_folder(root: Path, hf_config: dict[str, Any] | None = None) -> bool:
    """Whether AutoTokenizer would pick the generic class for this folder whatever its model type."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    try:
        tok_config = json.loads((root / "tokenizer_config.json").read_text())
        if hf_config is None:
            hf_config = json.loads((root / "config.json").read_text())
        model_type = hf_config.get("model_type")
    except (OSError, ValueError):
        return False
    return (
        (root / "tokenizer.json").is_file()
        and tok_config.get("tokenizer_class") in GENERIC
        and "auto_map" not in tok_config
        and model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        and TOKENIZER_MAPPING_NAMES.get(model_type) in (None, *GENERIC)
    )
