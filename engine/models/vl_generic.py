"""Vision-language checkpoints on the generic path: transformers' own model (vision tower, projector, language
model) with its language model's attention on our paged KV cache (models.generic).

Each step the runner hands the model its batch (`prepare_step`) before the forward: the family's vision tower
and projector encode, in one batched call, the images of the requests being prefilled whose tokens this step
covers and that the encoder cache lacks; the forward embeds the step's tokens and their embeddings replace
the image token rows of the flat batch (a chunk that starts or ends inside an image takes the rows it
covers), then runs the language model over the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.engine.models.generic import (
    ATTN_IMPL,
    GenericModel,
    generic_config_fields,
    into_arena,
    register,
    use_our_kernels,
)
from sluice.engine.multimodal.encoder_cache import EncoderCache
from sluice.engine.multimodal.vl_families import VisionFamily, VisionItem, check_family, family_of


def vl_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of our ModelConfig for a generic-path vision-language config.json: its language model's, run
    on the generic path, under the checkpoint's own architecture name."""
    check_family(cfg)
    from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

    text_conf = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg).get_text_config()
    text = text_conf.to_dict()
    text["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING[type(text_conf)].__name__]
    text.setdefault("eos_token_id", cfg.get("eos_token_id"))
    fields = generic_config_fields(text)
    fields["architecture"] = cfg["architectures"][0]
    fields["torch_dtype"] = cfg.get("torch_dtype") or cfg.get("dtype") or fields["torch_dtype"]
    return fields


@dataclass(slots=True)
class ImageRows:
    """The next forward's image token rows of the flat batch and the embeddings that replace them."""

    rows: torch.Tensor
    embeds: torch.Tensor


class GenericVLModel(GenericModel):
    """A transformers vision-language model behind our model interface; images through `prepare_step`."""

    def __init__(self, hf_model: torch.nn.Module, config, family: type[VisionFamily]) -> None:
        super().__init__(hf_model, config)
        self.family = family
        self.image_token_id = int(hf_model.config.image_token_id)
        self.encoder_cache = EncoderCache()
        self._images: ImageRows | None = None

    def prepare_step(self, batch) -> None:
        """The image rows of the batch the next forward runs (the runner's flat order), their embeddings."""
        rows, chunks, offset = [], [], 0
        found = self._encode_missing(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, mm = req.num_computed_tokens, getattr(req, "mm_inputs", None)
            for item in mm.items if mm is not None else ():
                lo, hi = start - item.offset, start + n - item.offset  # the step's tokens within the item
                taken = (item.image_rows >= lo) & (item.image_rows < hi)
                if taken.any():
                    rows.append(item.image_rows[taken] - lo + offset)
                    chunks.append(found[item.content_hash][taken.to(found[item.content_hash].device)])
            offset += n
        device = self.embed_tokens.weight.device
        self._images = ImageRows(torch.cat(rows).to(device), torch.cat(chunks)) if rows else None

    def _encode_missing(self, batch) -> dict[str, torch.Tensor]:
        """Embeddings of every image this step's tokens cover: from the encoder cache, the rest encoded in one
        batched call of the family's vision tower and projector."""
        found, todo = self.encoder_cache.for_step(batch)
        if todo:
            found.update(self._encode(list(todo.values())))
        return found

    def _encode(self, items: list[VisionItem]) -> dict[str, torch.Tensor]:
        """Embeddings of `items`' images, their tiles in one batch through the family's encoder."""
        device = self.embed_tokens.weight.device
        pixels = torch.cat([i.pixel_values for i in items]).to(device)
        extra = {k: torch.cat([i.extra[k] for i in items]).to(device) for k in items[0].extra}
        embeds = self.family.encode(self.hf, pixels, extra)
        sizes = [i.num_embeddings for i in items]
        if embeds.shape[0] != sum(sizes):
            raise RuntimeError(f"the vision encoder gave {embeds.shape[0]} embeddings for {sum(sizes)} image "
                               f"tokens")
        out = {}
        for item, emb in zip(items, embeds.split(sizes), strict=True):
            out[item.content_hash] = emb
            self.encoder_cache.put(item.content_hash, emb)
        return out

    def hf_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's token embeddings as one packed sequence, image token rows taking their images'
        embeddings (what `prepare_step` found)."""
        images, self._images = self._images, None
        ids = input_ids
        if self.image_token_id >= self.embed_tokens.num_embeddings:  # an image token outside the vocabulary
            ids = ids.masked_fill(ids == self.image_token_id, 0)
        x = self.embed_tokens(ids)
        if images is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        return {"inputs_embeds": x[None]}


def load_vl_generic(path: str | Path, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device,
                    config, linear_hook=None, huge_pages: bool = True) -> GenericVLModel:
    """transformers' vision-language model for the checkpoint, its language model's attention ours (the vision
    tower keeps transformers' sdpa); `linear_hook` quantizes the language model's linears."""
    from transformers import AutoModelForImageTextToText

    family = family_of(hf_config)
    assert family is not None, hf_config.get("architectures")
    register()
    impl = {"text_config": ATTN_IMPL, "vision_config": "sdpa", "": "sdpa"}
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=impl)
    hf = hf.to(device).eval()
    language = getattr(hf.model, "language_model", None) or hf.model.text_model  # Idefics3: text_model
    if linear_hook is not None:
        linear_hook.quantize_module(language, config.architecture)
    use_our_kernels(language)
    model = GenericVLModel(hf, config, family).eval()
    if huge_pages:
        into_arena(model)
    return model
