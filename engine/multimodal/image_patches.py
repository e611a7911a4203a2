"""Qwen2-VL's image preprocessing with the pixels of transformers' Qwen2VLImageProcessorPil, in less time.

The processor resizes with PIL, rescales in float64, normalizes in float32 and cuts patches with numpy,
all per pixel. Here the same PIL resize runs on the RGB image, and the rest becomes a gather: every output
value is a function of one byte and its channel, so a [channels, 256] table built by the processor's own
rescale and normalize gives each value exactly, gathered straight into the patch layout (duplicated over the
temporal patch). An RGB image with a transparent colour key (which the processor composites onto white) goes
through the processor.

The grid (and so the prompt's image tokens) follows from the image's size alone, so intake takes it at once
and leaves the patches to `LazyPatches`: the step that encodes a batch of images computes all their patches
together, on a thread per core (PIL's resize and numpy's gathers and copies release the GIL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_POOL: list[ThreadPoolExecutor] = []  # made on first use, one worker per torch thread


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

    def lazy(self, image) -> tuple[LazyPatches, tuple[int, int, int]]:
        """Patches (computed when first needed) and grid of one RGB PIL image."""
        if image.info.get("transparency") is not None:
            out = self.processor(images=[image], return_tensors="pt")
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            return LazyPatches(value=out["pixel_values"]), (t, h, w)
        h, w = self.resized(image.width, image.height)
        return LazyPatches(lambda: self.resize_and_cut(image, h, w)), (1, h // self.patch, w // self.patch)

    def resize_and_cut(self, image, height: int, width: int) -> torch.Tensor:
        """Patches of an RGB PIL image resized to height x width."""
        return self.patches(np.asarray(image.resize((width, height), resample=self.processor.resample)))

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


class LazyPatches:
    """An image's patches, computed on first use and then kept."""

    __slots__ = ("_compute", "_value")

    def __init__(self, compute: Callable[[], torch.Tensor] | None = None,
                 value: torch.Tensor | None = None) -> None:
        assert (compute is None) != (value is None)
        self._compute, self._value = compute, value

    def get(self) -> torch.Tensor:
        """The patches [t*h*w, C*T*P*P]."""
        if self._value is None:
            assert self._compute is not None
            self._value = self._compute()
        return self._value

    @property
    def ready(self) -> bool:
        """Whether the patches are computed."""
        return self._value is not None


def compute_all(patches: Sequence[LazyPatches]) -> list[torch.Tensor]:
    """Every image's patches, those not yet computed across a pool of threads (one per torch thread)."""
    pending = list({id(p): p for p in patches if not p.ready}.values())
    if len(pending) > 1 and torch.get_num_threads() > 1:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="sluice-patches"))
        list(_POOL[0].map(LazyPatches.get, pending))
    return [p.get() for p in patches]
