"""Image parts in chat lines: sources (data:, file://, s3://, https://), decoding, the chat body schema."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from pydantic import ValidationError

from sluice.contract.images import ImageError, ImageSettings, decode_image, image_hash, load_image
from sluice.contract.schemas import ChatBody, Message
from sluice.contract.settings import Settings


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "png") -> str:
    return f"data:image/{mime};base64,{base64.b64encode(data).decode()}"


def gradient(width: int = 40, height: int = 24) -> Image.Image:
    img = Image.new("RGB", (width, height))
    img.putdata([(x * 6 % 256, y * 10 % 256, (x + y) % 256) for y in range(height) for x in range(width)])
    return img


@pytest.mark.parametrize("fmt,mime", [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"), ("GIF", "gif")])
def test_data_urls_of_each_format_decode_to_rgb(fmt, mime):
    loaded = load_image(data_url(encoded(gradient(), fmt), mime), ImageSettings())
    assert loaded.image.mode == "RGB" and loaded.image.size == (40, 24)
    if fmt in ("PNG", "WEBP"):
        assert loaded.image.tobytes() == gradient().tobytes() or fmt == "WEBP"


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    img = decode_image(encoded(gradient(40, 24), "JPEG", exif=exif), 10_000)
    assert img.size == (24, 40)


def test_animation_takes_the_first_frame_and_palette_and_alpha_become_rgb():
    frames = [Image.new("RGBA", (8, 8), (255, 0, 0, 128)), Image.new("RGBA", (8, 8), (0, 0, 255, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    img = decode_image(buf.getvalue(), 10_000)
    assert img.mode == "RGB" and img.getpixel((0, 0))[0] > 200 and img.getpixel((0, 0))[2] < 50


def test_pixel_limit_and_undecodable_bytes_are_refused():
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode_image(encoded(gradient(20, 20)), 100)
    with pytest.raises(ImageError, match="does not decode"):
        decode_image(b"not an image at all", 10_000)
    with pytest.raises(ImageError, match="not valid base64"):
        load_image("data:image/png;base64,@@@@", ImageSettings())
    with pytest.raises(ImageError, match="data:image/"):
        load_image("data:text/plain;base64,aGVsbG8=", ImageSettings())
    with pytest.raises(ImageError, match="over the limit of 64 bytes"):
        load_image(data_url(encoded(gradient())), ImageSettings(image_max_bytes=64))


def test_equal_pixels_hash_equal_whatever_the_encoding():
    png = load_image(data_url(encoded(gradient())), ImageSettings())
    again = load_image(data_url(encoded(gradient(), optimize=True)), ImageSettings())
    other = load_image(data_url(encoded(gradient(41, 24))), ImageSettings())
    assert png.content_hash == again.content_hash == image_hash(gradient())
    assert other.content_hash != png.content_hash


def test_file_urls_only_under_the_image_input_roots(tmp_path):
    inside, outside = tmp_path / "imgs", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    (inside / "a.png").write_bytes(encoded(gradient()))
    (outside / "b.png").write_bytes(encoded(gradient()))
    settings = ImageSettings(image_input_roots=inside.as_uri())
    assert load_image((inside / "a.png").as_uri(), settings).image.size == (40, 24)
    with pytest.raises(ImageError, match="outside the image input roots"):
        load_image((outside / "b.png").as_uri(), settings)
    with pytest.raises(ImageError, match="outside the image input roots"):
        load_image((inside / ".." / "elsewhere" / "b.png").as_uri(), settings)
    with pytest.raises(ImageError, match="outside the image input roots"):
        load_image((inside / "a.png").as_uri(), ImageSettings())
    with pytest.raises(ImageError, match="no such image"):
        load_image((inside / "missing.png").as_uri(), settings)


def test_s3_urls_under_the_roots_are_read_from_a_real_s3_server(s3_bucket, s3_server):
    s3_server.client().put_object(Bucket=s3_bucket, Key="catalogue/shoe.png", Body=encoded(gradient()))
    s3_server.client().put_object(Bucket=s3_bucket, Key="private/x.png", Body=encoded(gradient()))
    settings = ImageSettings(image_input_roots=f"s3://{s3_bucket}/catalogue")
    loaded = load_image(f"s3://{s3_bucket}/catalogue/shoe.png", settings)
    assert loaded.content_hash == image_hash(gradient())
    with pytest.raises(ImageError, match="outside the image input roots"):
        load_image(f"s3://{s3_bucket}/private/x.png", settings)
    with pytest.raises(ImageError, match="over the limit"):
        small = settings.model_copy(update={"image_max_bytes": 10})
        load_image(f"s3://{s3_bucket}/catalogue/shoe.png", small)


def test_https_is_off_by_default_and_guarded_when_on():
    with pytest.raises(ImageError, match="SLUICE_IMAGE_ALLOW_HTTPS"):
        load_image("https://example.com/a.png", ImageSettings())
    on = ImageSettings(image_allow_https=True)
    with pytest.raises(ImageError, match="internal address"):
        load_image("https://127.0.0.1/a.png", on)
    with pytest.raises(ImageError, match="internal address 169.254.169.254"):
        load_image("https://169.254.169.254/latest", on)
    with pytest.raises(ImageError, match="must be https"):
        load_image("http://example.com/a.png", on)
    with pytest.raises(ImageError, match="scheme 'ftp'"):
        load_image("ftp://example.com/a.png", on)


def test_image_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_IMAGE_ALLOW_HTTPS", "1")
    monkeypatch.setenv("SLUICE_IMAGE_INPUT_ROOTS", "s3://catalogue,file:///srv/images")
    monkeypatch.setenv("SLUICE_IMAGE_MAX_PIXELS", "1000")
    settings = ImageSettings.of(Settings())
    assert settings.image_allow_https and settings.image_max_pixels == 1000
    assert settings.roots() == ["s3://catalogue", "file:///srv/images"]


def test_chat_bodies_take_image_parts_and_name_each_one():
    url = data_url(encoded(gradient()))
    body = ChatBody.model_validate({"messages": [
        {"role": "system", "content": "describe"},
        {"role": "user", "content": [
            {"type": "text", "text": "first "},
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "s3://b/k.png"}},
            {"type": "text", "text": "second"},
        ]},
    ]})
    assert body.image_parts() == [("messages[1].content[1]", url), ("messages[1].content[2]", "s3://b/k.png")]
    assert body.messages[1].text() == "first second"
    assert body.messages[1].for_template()["content"] == [
        {"type": "text", "text": "first "}, {"type": "image"}, {"type": "image"},
        {"type": "text", "text": "second"},
    ]
    assert body.messages[0].for_template() == {"role": "system", "content": "describe"}


def test_malformed_image_parts_are_refused_by_name():
    with pytest.raises(ValidationError, match="detail"):
        Message.model_validate({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:x", "detail": "medium"}}]})
    with pytest.raises(ValidationError, match="image_url"):
        Message.model_validate({"role": "user", "content": [{"type": "image_url"}]})
    with pytest.raises(ValidationError, match="input_audio"):
        Message.model_validate({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]})


@pytest.fixture
def image_server():
    """A local HTTP server: /ok.png an image, /big.png over a small limit, /slow.png never answering in
    time."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = encoded(gradient())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(1.5)
            if self.path == "/missing.png":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body * (50 if self.path == "/big.png" else 1))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_fetch_reads_within_the_size_limit_and_the_timeout(image_server):
    from sluice.contract.images import _get
    from sluice.contract.signing import Target

    def target(path: str) -> Target:
        return Target(f"http://127.0.0.1:{image_server}{path}", "http", "127.0.0.1", image_server, path,
                      "127.0.0.1")

    assert decode_image(_get(target("/ok.png"), 5.0, 1 << 20), 10_000).size == (40, 24)
    with pytest.raises(ImageError, match="over the limit of 1000 bytes"):
        _get(target("/big.png"), 5.0, 1000)
    with pytest.raises(ImageError, match="HTTP 404"):
        _get(target("/missing.png"), 5.0, 1 << 20)
    with pytest.raises(ImageError, match="no complete answer in 0.5 s"):
        _get(target("/slow.png"), 0.5, 1 << 20)
