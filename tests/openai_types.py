"""Response bodies checked against the official openai package's own types, strictly."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def _no_extra(model: Any, where: str) -> None:
    if isinstance(model, BaseModel):
        extra = model.model_extra or {}
        assert not extra, f"{where}: fields unknown to the openai package: {sorted(extra)}"
        for name in type(model).model_fields:
            _no_extra(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for i, item in enumerate(model):
            _no_extra(item, f"{where}[{i}]")


def openai_body(body: dict[str, Any]) -> BaseModel:
    """The body parsed as openai's ChatCompletion, Completion or CreateEmbeddingResponse in strict mode, with
    no field it does not know and nothing lost or changed in a round trip."""
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    kinds = {"chat.completion": ChatCompletion, "text_completion": Completion,
             "list": CreateEmbeddingResponse}
    cls = kinds[body["object"]]
    parsed = cls.model_validate(body, strict=True)
    _no_extra(parsed, cls.__name__)
    assert parsed.model_dump(mode="json", exclude_unset=True) == body
    return parsed
