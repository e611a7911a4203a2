"""Images in chat lines: fetch an image_url part's bytes (data:, file://, s3://, https://) and decode them.

Sources are checked before anything is read: file:// and s3:// must lie under the configured image input
roots, https:// is off unless allowed and then goes through the webhooks' SSRF guard (every address public or
allow-listed, the connection made to the checked address) with a timeout and a size limit. Decoding
(sluice.image_codec, shared with the engine) applies the EXIF orientation, takes the first frame of an
animation, converts to RGB and refuses more pixels than the limit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from sluice.contract.storage import S3_STYLE, read_url, within
from sluice.image_codec import ImageError, data_url_bytes, decode_image, image_hash

if TYPE_CHECKING:
    from PIL import Image
    from urllib3.connection import HTTPConnection

    from sluice.contract.settings import Settings
    from sluice.contract.signing import Target

__all__ = ["ImageError", "ImageSettings", "LoadedImage", "decode_image", "fetch_image_bytes", "image_hash",
           "load_image"]


class ImageSettings(BaseModel):
    """Where images may come from and how large they may be; `of(settings)` takes SLUICE_IMAGE_* fields."""

    image_input_roots: str = ""
    image_allow_https: bool = False
    image_max_bytes: int = Field(20 * 1024 * 1024, gt=0)
    image_max_pixels: int = Field(40_000_000, gt=0)
    image_max_per_request: int = Field(16, ge=0)
    image_timeout: float = Field(10.0, gt=0)
    webhook_allow: str = ""
    s3_addressing_style: str = S3_STYLE

    @classmethod
    def of(cls, settings: Settings) -> ImageSettings:
        """The image fields of settings (plus the webhooks' SSRF allow-list and the S3 addressing style)."""
        return cls(**settings.model_dump(include=set(cls.model_fields)))

    def roots(self) -> list[str]:
        """The file:// and s3:// roots image URLs may name (none by default)."""
        return [r.strip() for r in self.image_input_roots.split(",") if r.strip()]


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image and the hash of its pixels (the encoder and prefix caches key on it)."""

    image: Image.Image
    content_hash: str


def _stored_bytes(url: str, settings: ImageSettings) -> bytes:
    from sluice.contract.signing import redact_url  # the signing and HTTP modules load where URLs are fetched

    roots = settings.roots()
    if not roots or not any(within(url, root) for root in roots):
        shown = redact_url(url) if "://" in url else url
        raise ImageError(f"image {shown!r} is outside the image input roots (SLUICE_IMAGE_INPUT_ROOTS)")
    try:
        return read_url(url, settings.image_max_bytes, s3_style=settings.s3_addressing_style)
    except FileNotFoundError:
        raise ImageError(f"no such image: {url}") from None
    except ValueError as exc:
        raise ImageError(str(exc)) from None
    except Exception as exc:  # storage errors (permissions, S3) become the line's error
        raise ImageError(f"image {url} could not be read: {type(exc).__name__}") from None


def _connection(target: Target, timeout: float) -> HTTPConnection:
    from urllib3.connection import HTTPConnection, HTTPSConnection

    if target.scheme == "https":
        return HTTPSConnection(target.address, target.port, timeout=timeout, server_hostname=target.host,
                               assert_hostname=target.host)
    return HTTPConnection(target.address, target.port, timeout=timeout)


def _cut(conn: HTTPConnection, expired: threading.Event) -> None:
    expired.set()
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.close()


def _https_bytes(url: str, settings: ImageSettings) -> bytes:
    if not settings.image_allow_https:
        raise ImageError("https image URLs are off; set SLUICE_IMAGE_ALLOW_HTTPS=1 to fetch them")
    if not url.startswith("https://"):
        raise ImageError("image URLs must be https://, data:, file:// or s3://")
    from sluice.contract.signing import UnsafeWebhookURL, resolve_target

    try:
        target = resolve_target(url, settings.webhook_allow)
    except UnsafeWebhookURL as exc:
        raise ImageError(f"image URL refused: {exc}".replace("webhook", "image")) from None
    return _get(target, settings.image_timeout, settings.image_max_bytes)


def _get(target: Target, timeout: float, max_bytes: int) -> bytes:
    """GET the checked target within timeout seconds in all, refusing a body over max_bytes."""
    from sluice.contract.signing import redact_url

    conn, expired = _connection(target, timeout), threading.Event()
    timer = threading.Timer(timeout, _cut, args=(conn, expired))
    timer.daemon = True
    started = time.monotonic()
    try:
        timer.start()
        conn.request("GET", target.request_uri, headers={"host": target.host_header, "connection": "close",
                                                        "user-agent": "sluice-images/0.1"},
                     preload_content=False)
        response = conn.getresponse()
        if response.status != 200:
            raise ImageError(f"image URL {redact_url(target.url)} answered HTTP {response.status}")
        body = bytearray()
        for chunk in response.stream(64 * 1024):
            body += chunk
            if len(body) > max_bytes:
                raise ImageError(f"image at {redact_url(target.url)} is over the limit of {max_bytes} bytes")
        return bytes(body)
    except ImageError:
        raise
    except Exception as exc:
        if expired.is_set() or time.monotonic() - started >= timeout:
            raise ImageError(f"image URL {redact_url(target.url)}: no complete answer in {timeout:g} s") \
                from None
        raise ImageError(f"image URL {redact_url(target.url)} failed: {type(exc).__name__}") from None
    finally:
        timer.cancel()
        conn.close()


def fetch_image_bytes(url: str, settings: ImageSettings) -> bytes:
    """The encoded bytes an image URL names, after checking its scheme, place and size."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = data_url_bytes(url, settings.image_max_bytes)
    elif scheme in ("file", "s3"):
        data = _stored_bytes(url, settings)
    elif scheme in ("https", "http"):
        data = _https_bytes(url, settings)
    else:
        raise ImageError(f"image URL scheme {scheme or 'empty'!r} is not one of data, file, s3, https")
    if len(data) > settings.image_max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {settings.image_max_bytes}")
    return data


def load_image(url: str, settings: ImageSettings) -> LoadedImage:
    """Fetch and decode the image an image_url names."""
    image = decode_image(fetch_image_bytes(url, settings), settings.image_max_pixels)
    return LoadedImage(image, image_hash(image))
