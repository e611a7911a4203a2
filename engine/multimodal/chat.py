"""Chat messages with image parts: the images fetched and decoded, the parts the chat template renders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.engine.multimodal.image_decode import ImageError, load_data_url

ImageLoader = Callable[[str], Any]  # an image URL -> its decoded PIL image, raising a ValueError it refuses


def _image_of(part: dict[str, Any], load: ImageLoader):
    """The PIL image of an image_url (OpenAI) or image_pil (vLLM) content part."""
    if part["type"] == "image_pil":
        return part["image_pil"]
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise ImageError("an image_url part needs image_url.url")
    return load(url)


def chat_images(messages: list[dict[str, Any]],
                load: ImageLoader = load_data_url) -> tuple[list[dict[str, Any]], list]:
    """Messages with each image part as {"type": "image"} (what chat templates render as the model's image
    placeholder), and the images in order (image_url ones read by `load`); the error names the part
    (messages[i].content[j])."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        kinds = [p.get("type") for p in content] if isinstance(content, list) else []
        if "image_url" not in kinds and "image_pil" not in kinds:
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if part.get("type") not in ("image_url", "image_pil"):
                parts.append(part)
                continue
            try:
                images.append(_image_of(part, load))
            except ValueError as exc:  # ImageError, or the loader's own (contract.images.ImageError)
                raise type(exc)(f"messages[{i}].content[{j}]: {exc}") from None
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def image_prompt(ids: list[int], images: list) -> list[int] | dict[str, Any]:
    """The engine prompt of a rendered chat: its ids, with multi_modal_data where it has images."""
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
