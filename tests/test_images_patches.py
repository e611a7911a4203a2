"""Qwen2-VL's image preprocessing (multimodal.image_patches) gives transformers' image processor's pixels
exactly, whatever the image's size, orientation or mode, and under other processor settings."""

from __future__ import annotations

import io
import json
import threading

import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from sluice.engine.multimodal.image_decode import decode_image
from sluice.engine.multimodal.image_patches import ImagePatcher, LazyPatches, compute_all
from sluice.engine.multimodal.processor import ImageProcessor, rgb_image


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height, width, bands), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(data[..., 0] if bands == 1 else data, mode)


def exif_rotated(width: int, height: int) -> Image.Image:
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    buf = io.BytesIO()
    noise(width, height, seed=3).save(buf, format="JPEG", exif=exif)
    return decode_image(buf.getvalue(), 10**7)


def keyed_rgb() -> Image.Image:
    """An RGB image with a transparent colour key, as a PNG with a tRNS chunk decodes."""
    image = noise(45, 61, seed=4)
    image.info["transparency"] = image.getpixel((0, 0))
    return image


IMAGES = {
    "odd sizes": noise(333, 251, seed=1),
    "tall and thin": noise(31, 517, seed=2),
    "smaller than min_pixels": noise(19, 23, seed=5),
    "larger than max_pixels": noise(901, 677, seed=6),
    "exif rotated": exif_rotated(97, 43),
    "grayscale": noise(77, 55, "L", seed=7),
    "rgba": noise(83, 59, "RGBA", seed=8),
    "rgb with a colour key": keyed_rgb(),
}

SETTINGS = {
    "qwen2-vl": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64, patch_size=14, merge_size=2,
                     temporal_patch_size=2),
    "other statistics and sizes": dict(min_pixels=32 * 32, max_pixels=96 * 96, patch_size=16, merge_size=2,
                                       temporal_patch_size=3, image_mean=[0.5, 0.25, 0.75],
                                       image_std=[0.2, 0.3, 0.4], rescale_factor=1 / 127.5),
    "no normalize": dict(min_pixels=56 * 56, max_pixels=112 * 112, do_normalize=False),
    "no rescale, bilinear": dict(min_pixels=56 * 56, max_pixels=112 * 112, do_rescale=False, resample=2),
}


@pytest.fixture(scope="module", params=list(SETTINGS), ids=list(SETTINGS))
def processors(request, tmp_path_factory) -> tuple[ImageProcessor, Qwen2VLImageProcessorPil]:
    """The engine's image processor of a checkpoint with these settings, and transformers' own."""
    reference = Qwen2VLImageProcessorPil(**SETTINGS[request.param])
    path = tmp_path_factory.mktemp("processor")
    reference.save_pretrained(path)
    assert json.loads((path / "preprocessor_config.json").read_text())["patch_size"] == reference.patch_size
    return ImageProcessor(path), Qwen2VLImageProcessorPil.from_pretrained(path)


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_and_grid_equal_the_processors_exactly(processors, name):
    ours, reference = processors
    assert isinstance(ours.patcher, ImagePatcher)  # the fast path serves these settings
    image = rgb_image(IMAGES[name])
    pixels, grid = ours(image)
    ref = reference(images=[image], return_tensors="pt")
    assert pixels.dtype == ref["pixel_values"].dtype == torch.float32
    assert torch.equal(pixels, ref["pixel_values"])
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert ours.patcher.grid(image.width, image.height) == grid


def test_the_colour_key_changes_pixels_as_the_processor_composites_it(processors):
    ours, _ = processors
    image = IMAGES["rgb with a colour key"]
    plain = image.copy()
    plain.info.pop("transparency")
    assert not torch.equal(ours(image)[0], ours(plain)[0])  # the keyed colour turns white, as in transformers


def test_a_steps_patches_are_written_into_one_buffer_on_a_thread_per_core(tmp_path):
    Qwen2VLImageProcessorPil(**SETTINGS["qwen2-vl"]).save_pretrained(tmp_path)
    ours, reference = ImageProcessor(tmp_path), Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    images = [noise(40 + 37 * i, 300 - 29 * i, seed=20 + i) for i in range(6)]
    lazy = [ours.lazy(image) for image in images]
    expected = reference(images=images, return_tensors="pt")
    assert [grid for _, grid in lazy] == [tuple(g) for g in expected["image_grid_thw"].tolist()]
    threads: set[str] = set()

    def traced(patches: LazyPatches):
        def fill(out: torch.Tensor) -> None:
            threads.add(threading.current_thread().name)
            patches.fill(out)
        return fill

    pixels = compute_all([LazyPatches(p.rows, p.dim, traced(p)) for p, _ in lazy])
    assert torch.equal(pixels, expected["pixel_values"])
    assert torch.get_num_threads() == 1 or any(name.startswith("sluice-patches") for name in threads)
    assert len(threads) <= torch.get_num_threads()
    keyed, _ = ours.lazy(IMAGES["rgb with a colour key"])  # computed by the processor at once, then copied
    first = reference(images=images[:1], return_tensors="pt")["pixel_values"]
    with torch.inference_mode():  # as the engine's step runs it
        both = compute_all([keyed, lazy[0][0]])
    assert torch.equal(both, torch.cat([keyed.get(), first]))
