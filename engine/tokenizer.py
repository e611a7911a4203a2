"""The model's tokenizer: a folder with transformers' generic tokenizers-backed class is read through
`tokenizers` and jinja2 directly (no transformers import on a worker's start); anything else through
AutoTokenizer."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types whose tokenizer transformers loads as the generic class when the folder names it
# (AutoTokenizer's mapping gives no class of their own); the others have a class with its own pre-processing.
NATIVE_MODEL_TYPES = frozenset({"llama", "mistral"})
# tokenizer_config.json keys with which transformers rewrites the folder's post-processor or its text.
REWRITING_KEYS = ("add_bos_token", "add_eos_token", "auto_map", "add_prefix_space", "legacy")
SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(path: str | Path, hf_config: dict[str, Any] | None = None) -> Any:
    """The tokenizer transformers' AutoTokenizer would load for `path` (`hf_config`: the folder's config.json
    where the caller has read it already): a `Tokenizer` where the folder allows it, else AutoTokenizer's."""
    root = Path(path)
    tok_config = _native_config(root, hf_config)
    if tok_config is not None:
        return Tokenizer(root, tok_config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _native_config(root: Path, hf_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """tokenizer_config.json when the folder's tokenizer is the generic class over tokenizer.json, else
    None."""
    try:
        tok_config = json.loads((root / "tokenizer_config.json").read_text())
        if hf_config is None:
            hf_config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    native = (
        (root / "tokenizer.json").is_file()
        and tok_config.get("tokenizer_class") in GENERIC
        and hf_config.get("model_type") in NATIVE_MODEL_TYPES
        and not any(key in tok_config for key in REWRITING_KEYS)
    )
    return tok_config if native else None


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """tokenizer.json through `tokenizers`, with tokenizer_config.json's special tokens and chat template:
    encode, decode and apply_chat_template give what transformers' generic class gives for the folder."""

    def __init__(self, root: Path, tok_config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(root / "tokenizer.json"))
        self.special_tokens = {k: t for k in SPECIALS if (t := _token(tok_config.get(k))) is not None}
        for name in SPECIALS:  # eos_token, eos_token_id, ... as transformers names them
            token = self.special_tokens.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self.backend.token_to_id(token))
        self.chat_template = _chat_template(root, tok_config)
        bpe = type(self.backend.model).__name__ == "BPE"  # transformers skips the clean-up for BPE models
        self.clean_up = bool(tok_config.get("clean_up_tokenization_spaces")) and not bpe

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the post-processor's special tokens unless add_special_tokens=False)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """{"input_ids": encode(text)}, as transformers' tokenizers answer a call."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`."""
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up else text

    def get_vocab(self) -> dict[str, int]:
        """Every token, added ones included, to its id."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers` object, under transformers' name for it."""
        return self.backend

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """The vocabulary piece of each id (None for an id outside the vocabulary), as transformers
        answers."""
        return self.backend.id_to_token(ids) if isinstance(ids, int) else [self.backend.id_to_token(i)
                                                                           for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """The id of each vocabulary piece (None for an unknown one)."""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation through the folder's chat template: its text, or its token ids when
        tokenize=True."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        text = _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


@functools.cache
def _compile(template: str) -> Any:
    """The template in the sandboxed environment transformers renders chat templates in."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for spaced, tight in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, tight)
    return text
