"""Qwen2-VL's image preprocessing with the pixels of transformers' Qwen2VLImageProcessorPil, in less time.

The processor resizes with PIL, rescales in float64, normalizes in float32 and cuts patches with numpy,
all per pixel. Here the same PIL resize runs on the RGB image, and the rest becomes a gather: every output
value is a function of one byte and its channel, so a [channels, 256] table built by the processor's own
rescale and normalize gives each value exactly, gathered straight into the patch layout (duplicated over the
temporal patch). An RGB image with a transparent colour key (which the processor composites onto white) goes
through the processor.
"""

from __future__ import annotations

import numpy as np
import torch


class ImagePatcher:
    """Patches [h*w, C*T*P*P] and grid (1, h, w) of an RGB PIL image, equal to `processor`'s (a
    Qwen2VLImageProcessorPil)."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.patch, self.merge = int(processor.patch_size), int(processor.merge_size)
        self.temporal = int(processor.temporal_patch_size)
        self.size = processor.size
        self.table = value_table(processor).reshape(-1)  # [channels * 256]
        self.offsets = np.arange(0, 3 * 256, 256).reshape(3, 1, 1, 1)  # each channel's row of the table

    @staticmethod
    def serves(processor) -> bool:
        """Whether the processor's settings are the ones this class reproduces (it resizes and converts to
        RGB, as Qwen2-VL checkpoints have it)."""
        size = processor.size
        return bool(processor.do_resize and processor.do_convert_rgb and size.shortest_edge
                    and size.longest_edge)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size (the processor's smart resize)."""
        h, w = self.resized(width, height)
        return 1, h // self.patch, w // self.patch

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the processor resizes an image of this size to."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, self.patch * self.merge, self.size.shortest_edge,
                            self.size.longest_edge)

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches and grid of one RGB PIL image."""
        if image.info.get("transparency") is not None:
            out = self.processor(images=[image], return_tensors="pt")
            return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])  # type: ignore
        h, w = self.resized(image.width, image.height)
        pixels = np.asarray(image.resize((w, h), resample=self.processor.resample))
        return self.patches(pixels), (1, h // self.patch, w // self.patch)

    def patches(self, pixels: np.ndarray) -> torch.Tensor:
        """Patches of resized uint8 pixels [H, W, C]: per merge block, per patch, C x T x P x P values (numpy
        throughout: single-threaded copies of this size beat torch's)."""
        p, m = self.patch, self.merge
        height, width, channels = pixels.shape
        n = (height // p) * (width // p)
        grid = (height // p // m, m, p, width // p // m, m, p, channels)
        blocks = pixels.reshape(grid).transpose(0, 3, 1, 4, 6, 2, 5).reshape(n, channels, 1, p, p)
        index = blocks.astype(np.intp) + self.offsets[:channels]
        values = np.broadcast_to(self.table.take(index), (n, channels, self.temporal, p, p))
        return torch.from_numpy(values.reshape(n, -1))


def value_table(processor, channels: int = 3) -> np.ndarray:
    """[channels, 256] float32: each byte value of each channel after the processor's own rescale and
    normalize (as it applies them)."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)).copy()  # a C x 1 x 256 image
    if processor.do_rescale:
        values = processor.rescale(values, processor.rescale_factor)
    if processor.do_normalize:
        values = processor.normalize(values, processor.image_mean, processor.image_std)
    return np.asarray(values, dtype=np.float32).reshape(channels, 256)
