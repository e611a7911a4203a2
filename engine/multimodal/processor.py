"""Turn a prompt and its images into the engine's input: token ids with each image's placeholder expanded to
its tokens, the images' patches from the checkpoint's own image processor, and M-RoPE positions.

The prompt holds one placeholder per image (`<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL, as a
chat template renders an image part and as vLLM takes prompts); the image processor's grid says how many
`<|image_pad|>` tokens each becomes. Only the image processor is needed (never the processor class, which
reaches for video processing).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.engine.multimodal.image_patches import ImagePatcher, LazyPatches
from sluice.engine.multimodal.inputs import ImageItem, MultiModalInputs, mrope_positions
from sluice.engine.multimodal.vl_config import is_vision_language, text_config_of

__all__ = ["MultiModalError", "MultiModalProcessor", "is_vision_language", "text_config_of"]

MAX_IMAGES_PER_PROMPT = 16
PATCH_CACHE_SIZE = 64  # preprocessed images kept by content hash (the same image in many lines)


class MultiModalError(ValueError):
    """A prompt's images that cannot be used with this model (none taken, too many, placeholders amiss)."""


def placeholder_slots(processor, prompt: str | list[int], num_images: int) -> tuple[list[int], list[int]]:
    """(token ids, index of each image placeholder) of a prompt with `num_images` images, refused past the
    processor's `max_images` or where placeholders and images do not pair one to one."""
    if num_images > processor.max_images:
        raise MultiModalError(f"{num_images} images in one prompt, over the limit of {processor.max_images}")
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    slots = [i for i, t in enumerate(ids) if t == processor.image_token_id]
    if len(slots) != num_images:
        raise MultiModalError(f"the prompt has {len(slots)} image placeholder(s) but {num_images} "
                              "image(s) were given (one placeholder per image)")
    return ids, slots


def image_salt(hashes: Sequence[str]) -> int:
    """The prefix-cache salt of a prompt with these images: equal text with other images shares no block."""
    return hash(("images", *hashes))


class ImageProcessor:
    """The checkpoint's preprocessor_config.json through transformers' Qwen2VLImageProcessorPil (its pixels
    computed by multimodal.image_patches where that serves the settings)."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import Qwen2VLImageProcessorPil

        path = Path(model_path) / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no preprocessor_config.json (the image processor's settings) in "
                                    f"{model_path}")
        self.processor = Qwen2VLImageProcessorPil(**_processor_kwargs(json.loads(path.read_text())))
        self.merge_size = int(self.processor.merge_size)
        self.patcher = ImagePatcher(self.processor) if ImagePatcher.serves(self.processor) else None

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches [t*h*w, C*T*P*P] and grid (t, h, w) of one RGB PIL image."""
        patches, grid = self.lazy(image)
        return patches.get(), grid

    def lazy(self, image) -> tuple[LazyPatches, tuple[int, int, int]]:
        """Patches (computed when needed, where the fast path serves) and grid of one RGB PIL image."""
        if self.patcher is not None:
            return self.patcher.lazy(image)
        out = self.processor(images=[image], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return LazyPatches(*out["pixel_values"].shape, value=out["pixel_values"]), (t, h, w)


def _processor_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    drop = {"image_processor_type", "processor_class", "auto_map"}
    return {k: v for k, v in cfg.items() if k not in drop}


class MultiModalProcessor:
    """Prompt + images -> expanded token ids and MultiModalInputs, for one vision-language checkpoint."""

    def __init__(self, model_path: str | Path, hf_config: dict[str, Any], tokenizer,
                 max_images: int = MAX_IMAGES_PER_PROMPT) -> None:
        self.images = ImageProcessor(model_path)
        self.image_token_id = int(hf_config["image_token_id"])
        self.tokenizer = tokenizer
        self.max_images = max_images
        self._patches: OrderedDict[str, tuple[LazyPatches, tuple[int, int, int]]] = OrderedDict()

    def patches(self, image, key: str) -> tuple[LazyPatches, tuple[int, int, int]]:
        """Patches (computed when needed) and grid of an image by content hash: an image seen among the last
        PATCH_CACHE_SIZE is not taken again."""
        found = self._patches.get(key)
        if found is None:
            found = self._patches[key] = self.images.lazy(image)
            if len(self._patches) > PATCH_CACHE_SIZE:
                self._patches.popitem(last=False)
        self._patches.move_to_end(key)
        return found

    def tokens_per_image(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens an image of this patch grid takes."""
        t, h, w = grid
        return t * h * w // self.images.merge_size**2

    def process(self, prompt: str | list[int], images: Sequence) -> tuple[list[int], MultiModalInputs]:
        """Token ids with each image placeholder expanded, and the prompt's MultiModalInputs."""
        from sluice.engine.multimodal.image_decode import image_hash

        ids, slots = placeholder_slots(self, prompt, len(images))
        expanded: list[int] = []
        items: list[ImageItem] = []
        cursor = 0
        for slot, image in zip(slots, images, strict=True):
            rgb = rgb_image(image)
            key = image_hash(rgb)
            pixels, grid = self.patches(rgb, key)
            expanded += ids[cursor:slot]
            n = self.tokens_per_image(grid)
            items.append(ImageItem(key, pixels, grid, len(expanded), n))
            expanded += [self.image_token_id] * n
            cursor = slot + 1
        expanded += ids[cursor:]
        positions, delta = mrope_positions(expanded, items, self.images.merge_size)
        salt = image_salt([i.content_hash for i in items])
        return expanded, MultiModalInputs(items, positions, delta, salt)


def rgb_image(image):
    """An RGB PIL image (PIL images in other modes are converted; anything else is refused)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise MultiModalError(f"an image must be a PIL.Image, not {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


def split_prompt(prompt: dict[str, Any]) -> tuple[str | list[int], list]:
    """(prompt text or token ids, images) of a vLLM-style prompt dict: {"prompt" | "prompt_token_ids",
    "multi_modal_data": {"image": image | [images]}}."""
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise MultiModalError(f"unknown prompt field(s) {sorted(unknown)}")
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if text is None:
        raise MultiModalError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    data = prompt.get("multi_modal_data") or {}
    if set(data) - {"image"}:
        raise MultiModalError(f"multi_modal_data takes 'image' only, not {sorted(set(data) - {'image'})}")
    images = data.get("image", [])
    return text, list(images) if isinstance(images, list | tuple) else [images]
