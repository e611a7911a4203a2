"""Chat lines with image parts through rq and the engine worker: the same output as LLM.chat, and each bad
image a per-line error naming its part while the rest of the batch runs."""

from __future__ import annotations

import pytest
import redis
from PIL import Image

from sluice.contract.images import ImageSettings, load_image
from sluice.contract.settings import Settings
from sluice.engine import LLM, SamplingParams
from sluice.producer import BatchStatus, Client
from sluice.worker.worker import EngineWorker
from tests.checkpoints import make_qwen2_vl_checkpoint
from tests.test_images import data_url, encoded
from tests.test_images_qwen2_vl import noise_image


@pytest.fixture(scope="module")
def vl_llm(tmp_path_factory):
    path = make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2-vl"))
    return LLM(str(path), dtype="float32", device="cpu")


def chat_line(cid: str, content) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def run_batch(llm, redis_url: str, lines: list[dict], tmp_path) -> tuple[Client, str]:
    client = Client(redis_url)
    batch = client.submit_batch(lines, output=tmp_path.as_uri(), shard_size=4)
    worker = EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5)
    worker.work(burst=True, logging_level="WARNING")
    assert client.get(batch.id).status == BatchStatus.completed
    return client, batch.id


def test_image_lines_match_llm_chat_and_bad_images_fail_alone(vl_llm, redis_url, tmp_path, monkeypatch):
    roots = tmp_path / "images"
    roots.mkdir()
    (roots / "shoe.png").write_bytes(encoded(noise_image(100, 80, 3)))
    monkeypatch.setenv("SLUICE_IMAGE_INPUT_ROOTS", roots.as_uri())
    one, two = data_url(encoded(noise_image(112, 112, 1))), data_url(encoded(noise_image(60, 90, 2)), "png")
    good = {
        "one": [{"type": "text", "text": "describe "}, image_part(one)],
        "two": [image_part(one), {"type": "text", "text": " and "}, image_part(two)],
        "file": [{"type": "text", "text": "caption "}, image_part((roots / "shoe.png").as_uri())],
        "text": "the quick brown fox",
    }
    bad = {
        "garbage": [{"type": "text", "text": "x"}, image_part("data:image/png;base64,aGVsbG8=")],
        "ftp": [image_part("ftp://example.com/a.png")],
        "outside": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"},
                    image_part((tmp_path / "elsewhere.png").as_uri())],
        "https": [image_part("https://example.com/a.png")],
    }
    lines = [chat_line(k, v) for k, v in (good | bad).items()]
    client, batch_id = run_batch(vl_llm, redis_url, lines, tmp_path)

    records = {r.custom_id: r for r in client.results(batch_id)}
    images = ImageSettings.of(Settings())  # the worker's SLUICE_IMAGE_* settings
    want = vl_llm.chat([[{"role": "user", "content": v}] for v in good.values()],
                       SamplingParams(max_tokens=6, temperature=0), progress=False,
                       image_loader=lambda url: load_image(url, images).image)
    assert set(records) == set(good)
    for (cid, _), out in zip(good.items(), want, strict=True):
        body = records[cid].response.body
        assert body["choices"][0]["message"]["content"] == out.text
        assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    assert records["one"].response.body["usage"]["prompt_tokens"] > 16  # the image's 16 tokens are counted
    errors = {e.custom_id: e.error for e in client.results(batch_id, errors=True)}
    assert {k: e.code for k, e in errors.items()} == dict.fromkeys(bad, "invalid_image")
    assert errors["garbage"].message.startswith("messages[0].content[1]: image does not decode")
    assert errors["ftp"].message.startswith("messages[0].content[0]: image URL scheme 'ftp'")
    assert errors["outside"].message.startswith("messages[0].content[2]:") and "input roots" in \
        errors["outside"].message
    assert "SLUICE_IMAGE_ALLOW_HTTPS" in errors["https"].message


def test_an_image_to_a_text_only_model_is_a_line_error_naming_the_part(tiny_llama, redis_url, tmp_path):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    url = data_url(encoded(Image.new("RGB", (32, 32), (1, 2, 3))))
    lines = [chat_line("img", [{"type": "text", "text": "hi"}, image_part(url)]),
             chat_line("txt", "to be or")]
    client, batch_id = run_batch(llm, redis_url, lines, tmp_path)
    assert [r.custom_id for r in client.results(batch_id)] == ["txt"]
    (error,) = client.results(batch_id, errors=True)
    assert error.custom_id == "img" and error.error.code == "invalid_image"
    assert error.error.message.startswith("messages[0].content[1]: this model takes no images")
