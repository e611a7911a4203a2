"""Images the engine reads itself: data: URLs decoded with Pillow (no storage, no network), and the pixel hash
the encoder and prefix caches key on, both from sluice.image_codec (the decode the contract shares). Fetching
file://, s3:// and https:// images is the contract's (contract.images), handed to LLM.chat as an image
loader."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.image_codec import ImageError, data_url_bytes, decode_image, image_hash

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["MAX_BYTES", "MAX_PIXELS", "ImageError", "data_url_bytes", "decode_image", "image_hash",
           "load_data_url"]

MAX_BYTES = 20 * 1024 * 1024  # SLUICE_IMAGE_MAX_BYTES' default
MAX_PIXELS = 40_000_000  # SLUICE_IMAGE_MAX_PIXELS' default


def load_data_url(url: str) -> Image.Image:
    """The image of a data: URL under the default limits; other schemes need the contract's loader."""
    if not url.lower().startswith("data:"):
        shown = url.split("?", 1)[0]
        raise ImageError(f"image {shown!r} is outside the image input roots: LLM.chat reads data: URLs "
                         "itself and file://, s3:// or https:// ones through image_loader (contract.images)")
    return decode_image(data_url_bytes(url, MAX_BYTES), MAX_PIXELS)
