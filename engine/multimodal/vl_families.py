"""Vision-language families on the generic path: each family's image processor, how many tokens an image's
placeholder becomes, and its vision tower + projector run over a batch of images.

A family is what `models.vl_generic` needs of a checkpoint beyond transformers' own modules: the prompt
holds one placeholder per image (as vLLM takes prompts and as a chat template renders an image part), which
the family expands from the image processor's output; the image's embeddings later replace the expansion's
image tokens, in order. Only the image processor is used (the Pil variant transformers picks where torchvision
is absent), never the processor class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice.engine.multimodal.inputs import MultiModalInputs
from sluice.engine.multimodal.processor import (
    MAX_IMAGES_PER_PROMPT,
    PATCH_CACHE_SIZE,
    MultiModalError,
    MultiModalProcessor,
    image_salt,
    placeholder_slots,
    rgb_image,
)
from sluice.engine.multimodal.vl_config import is_generic_vision

# LLaVA's vision towers, with the class-token rows they put before the patches' rows.
LLAVA_TOWERS = {"clip_vision_model": 1, "siglip_vision_model": 0}


@dataclass(slots=True, frozen=True)
class VisionItem:
    """One image of a prompt on the generic path: pixels, content hash and the token span it expanded to."""

    content_hash: str
    pixel_values: torch.Tensor  # [tiles, channels, height, width]
    offset: int  # index in the prompt of the expansion's first token
    length: int  # tokens of the expansion (image tokens and any text tokens between them)
    image_rows: torch.Tensor  # indices within the expansion of the image tokens, in embedding order
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # other encoder inputs, per tile

    @property
    def num_embeddings(self) -> int:
        """Rows of the image's embeddings (its image tokens)."""
        return int(self.image_rows.numel())


@dataclass(slots=True)
class Pixels:
    """An image as its family preprocessed it: pixel tiles, other per-tile encoder inputs, its expansion."""

    pixel_values: torch.Tensor
    expansion: list[int]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class VisionFamily:
    """LLaVA (LlavaForConditionalGeneration): a CLIP or SigLIP tower, a projector, a fixed number of image
    tokens per image (one per patch, plus CLIP's class token under the "full" feature strategy)."""

    architecture = "LlavaForConditionalGeneration"

    def __init__(self, model_path: str | Path, hf_config: dict[str, Any], tokenizer) -> None:
        from transformers import AutoImageProcessor

        if not (Path(model_path) / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"no preprocessor_config.json (the image processor's settings) in "
                                    f"{model_path}")
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self.image_token_id = int(hf_config.get("image_token_id", hf_config.get("image_token_index")))
        check_family(hf_config)

    def preprocess(self, image) -> Pixels:
        """Pixels [1, C, H, W] of one RGB PIL image and the image tokens it takes."""
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        vision = self.hf_config["vision_config"]
        patch = int(vision.get("patch_size", 14))
        n = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) + LLAVA_TOWERS[vision["model_type"]]
        if self.hf_config.get("vision_feature_select_strategy", "default") == "default":
            n -= 1
        return Pixels(pixels, [self.image_token_id] * n)

    @classmethod
    def encode(cls, hf_model, pixel_values: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """Embeddings [images * tokens, hidden] of a batch of images through the tower and projector."""
        cfg = hf_model.config
        out = hf_model.model.get_image_features(
            pixel_values=pixel_values, vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True)
        return torch.cat(list(out.pooler_output))


class Idefics3Family(VisionFamily):
    """Idefics3 / SmolVLM (Idefics3ForConditionalGeneration): an image split into tiles of the processor's
    max_image_size plus a global view, each tile `image_seq_len` image tokens after the pixel-shuffle
    connector; the expansion puts the processor's tile markers (`<fake_token_around_image>`,
    `<row_r_col_c>`, `<global-img>`) between the tiles' image tokens, as Idefics3Processor writes it."""

    architecture = "Idefics3ForConditionalGeneration"

    def __init__(self, model_path: str | Path, hf_config: dict[str, Any], tokenizer) -> None:
        super().__init__(model_path, hf_config, tokenizer)
        vision = hf_config["vision_config"]
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        self.image_seq_len = patches // int(hf_config.get("scale_factor", 2)) ** 2

    def preprocess(self, image) -> Pixels:
        """Tiles [n, C, H, W] of one RGB PIL image (its global view last), their pixel masks and the
        expansion with the tile markers."""
        out = self.processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        extra = {"pixel_attention_mask": out["pixel_attention_mask"][0]}
        return Pixels(out["pixel_values"][0], self._expansion(rows, cols), extra)

    def _expansion(self, rows: int, cols: int) -> list[int]:
        """Token ids of the expansion of an image in rows x cols tiles (0 x 0: the global view only)."""
        image = self.tokenizer.convert_ids_to_tokens(self.image_token_id) * self.image_seq_len
        text = ""
        for r in range(rows):
            text += "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
            text += "\n"
        text = (text + "\n" if rows or cols else "") + f"<fake_token_around_image><global-img>{image}" \
            "<fake_token_around_image>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if ids.count(self.image_token_id) != self.image_seq_len * (rows * cols + 1):
            raise MultiModalError("the tokenizer does not read Idefics3's image markers as single tokens")
        return ids

    @classmethod
    def encode(cls, hf_model, pixel_values: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """Embeddings [tiles * image_seq_len, hidden] of a batch of tiles through the tower and connector."""
        out = hf_model.model.get_image_features(
            pixel_values=pixel_values[None], pixel_attention_mask=extra["pixel_attention_mask"][None],
            return_dict=True)
        return torch.cat(list(out.pooler_output))


FAMILIES: dict[str, type[VisionFamily]] = {f.architecture: f for f in (VisionFamily, Idefics3Family)}


def family_of(hf_config: dict[str, Any]) -> type[VisionFamily] | None:
    """The generic-path family of a config.json's architecture, if it names one."""
    return next((FAMILIES[a] for a in hf_config.get("architectures") or [] if a in FAMILIES), None)


def check_family(hf_config: dict[str, Any]) -> None:
    """ValueError naming what the family of this config cannot serve (an unknown vision tower)."""
    vision = (hf_config.get("vision_config") or {}).get("model_type")
    if family_of(hf_config) is VisionFamily and vision not in LLAVA_TOWERS:
        raise ValueError(f"LlavaForConditionalGeneration with vision tower {vision!r} is not supported (only "
                         f"{', '.join(LLAVA_TOWERS)})")


class GenericVLProcessor:
    """Prompt + images -> expanded token ids and MultiModalInputs of VisionItems (a generic-path family)."""

    def __init__(self, model_path: str | Path, hf_config: dict[str, Any], tokenizer,
                 max_images: int = MAX_IMAGES_PER_PROMPT) -> None:
        family = family_of(hf_config)
        if family is None:
            raise MultiModalError(f"{hf_config.get('architectures')} is not a generic-path vision family")
        self.family = family(model_path, hf_config, tokenizer)
        self.image_token_id = self.family.image_token_id
        self.tokenizer, self.max_images = tokenizer, max_images
        self._pixels: OrderedDict[str, Pixels] = OrderedDict()

    def pixels(self, image, key: str) -> Pixels:
        """An image preprocessed, by content hash (the last PATCH_CACHE_SIZE images are not preprocessed
        again)."""
        found = self._pixels.get(key)
        if found is None:
            found = self._pixels[key] = self.family.preprocess(image)
            if len(self._pixels) > PATCH_CACHE_SIZE:
                self._pixels.popitem(last=False)
        self._pixels.move_to_end(key)
        return found

    def process(self, prompt: str | list[int], images: Sequence) -> tuple[list[int], MultiModalInputs]:
        """Token ids with each image placeholder expanded, and the prompt's MultiModalInputs."""
        from sluice.engine.multimodal.image_decode import image_hash

        ids, slots = placeholder_slots(self, prompt, len(images))
        expanded: list[int] = []
        items: list[VisionItem] = []
        cursor = 0
        for slot, image in zip(slots, images, strict=True):
            rgb = rgb_image(image)
            key = image_hash(rgb)
            pixels = self.pixels(rgb, key)
            expanded += ids[cursor:slot]
            span = torch.tensor(pixels.expansion)
            rows = (span == self.image_token_id).nonzero().flatten()
            items.append(VisionItem(key, pixels.pixel_values, len(expanded), len(span), rows, pixels.extra))
            expanded += pixels.expansion
            cursor = slot + 1
        expanded += ids[cursor:]
        salt = image_salt([i.content_hash for i in items])
        return expanded, MultiModalInputs(items, torch.empty(3, 0, dtype=torch.long), 0, salt)  # type: ignore


def processor_for(model_path: str | Path, hf_config: dict[str, Any], tokenizer):
    """The prompt processor of a vision-language checkpoint: its family's on the generic path, else
    Qwen2-VL's (multimodal.processor)."""
    if is_generic_vision(hf_config):
        return GenericVLProcessor(model_path, hf_config, tokenizer)
    return MultiModalProcessor(model_path, hf_config, tokenizer)
