"""The images of a chat line: checked against the model and the limits, fetched and decoded, each problem
naming its part (messages[i].content[j])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.contract.images import ImageError, ImageSettings, load_image
from sluice.contract.schemas import ChatBody

if TYPE_CHECKING:
    from sluice.engine import LLM


class ImageRefused(ValueError):
    """An image part this worker cannot use: the line becomes an error record naming the part."""


def prompt_with_images(llm: LLM, body: ChatBody, ids: list[int],
                settings: ImageSettings) -> list[int] | dict[str, Any]:
    """The engine prompt of a rendered chat line: its ids, with its images as multi_modal_data if any."""
    parts = body.image_parts()
    if not parts:
        return ids
    if not llm.takes_images():
        raise ImageRefused(f"{parts[0][0]}: this model takes no images (a text-only model); send text only "
                           "or use a vision-language model")
    if len(parts) > settings.image_max_per_request:
        limit = settings.image_max_per_request
        raise ImageRefused(f"{parts[limit][0]}: more than {limit} images in one request "
                           "(SLUICE_IMAGE_MAX_PER_REQUEST)")
    images = []
    for name, url in parts:
        try:
            images.append(load_image(url, settings).image)
        except ImageError as exc:
            raise ImageRefused(f"{name}: {exc}") from None
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
