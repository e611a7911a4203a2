"""Image bytes as the contract and the engine both read them, with Pillow: data: URLs, decoding (EXIF
orientation, first frame, RGB, a pixel limit) and the pixel hash the encoder and prefix caches key on.

It imports nothing of the project, so the contract (which may not import the engine) and the engine (which may
not import the contract) share this one copy.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif);base64,", re.IGNORECASE)


class ImageError(ValueError):
    """An image part that cannot be used (its source is refused, unreadable, too large or undecodable)."""


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The encoded bytes of a data:image/...;base64 URL, refusing more than max_bytes."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("a data URL must be data:image/<png|jpeg|webp|gif>;base64,<data>")
    payload = url[match.end():]
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImageError(f"image data is over the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode PNG/JPEG/WebP/GIF bytes: EXIF orientation applied, first frame, RGB, at most max_pixels."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(f"image is {width}x{height} pixels, over the limit of {max_pixels}")
            img.seek(0)
            img.load()
            return ImageOps.exif_transpose(img).convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"image does not decode as PNG, JPEG, WebP or GIF: {type(exc).__name__}") from None


def image_hash(image: Image.Image) -> str:
    """A hash of an RGB image's size and pixels (equal images from different sources hash equal)."""
    digest = hashlib.blake2b(f"{image.width}x{image.height}:".encode(), digest_size=16)
    digest.update(image.tobytes())
    return digest.hexdigest()
