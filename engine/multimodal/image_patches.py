"""Qwen2-VL's image preprocessing with the pixels of transformers' Qwen2VLImageProcessorPil, in less time.

The processor resizes with PIL, rescales in float64, normalizes in float32 and cuts patches with numpy,
all per pixel. Here the same PIL resize runs on the RGB image, and the rest becomes a gather: every output
value is a function of one byte and its channel, so a [channels, 256] table built by the processor's own
rescale and normalize gives each value exactly, gathered straight into the patch layout (duplicated over the
temporal patch). An RGB image with a transparent colour key (which the processor composites onto white) goes
through the processor.

The grid (and so the prompt's image tokens) follows from the image's size alone, so intake takes it at once
and leaves the patches to `LazyPatches`: the step that encodes a batch of images writes all their patches
into its pixel buffer together, on a thread per core (PIL's resize and numpy's gathers and copies release the
GIL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

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
        """Patches (computed when needed) and grid of one RGB PIL image."""
        if image.info.get("transparency") is not None:
            out = self.processor(images=[image], return_tensors="pt")
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            return LazyPatches(*out["pixel_values"].shape, value=out["pixel_values"]), (t, h, w)
        h, w = self.resized(image.width, image.height)
        grid = (1, h // self.patch, w // self.patch)
        fill = partial(self.resize_and_cut, image, h, w)
        return LazyPatches(grid[1] * grid[2], 3 * self.temporal * self.patch**2, fill), grid

    def resize_and_cut(self, image, height: int, width: int, out: torch.Tensor) -> None:
        """Write into out the patches of an RGB PIL image resized to height x width."""
        pixels = np.asarray(image.resize((width, height), resample=self.processor.resample))
        self.patches(pixels, out.numpy())

    def patches(self, pixels: np.ndarray, out: np.ndarray) -> None:
        """Write into out [n, C*T*P*P] the patches of resized uint8 pixels [H, W, C]: per merge block, per
        patch, C x T x P x P values (numpy throughout: single-threaded copies of this size beat torch's)."""
        p, m = self.patch, self.merge
        height, width, channels = pixels.shape
        n = (height // p) * (width // p)
        grid = (height // p // m, m, p, width // p // m, m, p, channels)
        blocks = pixels.reshape(grid).transpose(0, 3, 1, 4, 6, 2, 5).reshape(n, channels, 1, p, p)
        index = blocks.astype(np.intp) + self.offsets[:channels]
        dest = out.reshape(n, channels, self.temporal, p, p)
        np.copyto(dest, self.table.take(index))  # broadcast over the temporal patch


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
    """An image's patches [rows, dim], computed each time they are needed, into the pixel buffer of the step
    that encodes the image; only the image is kept (a fraction of its patches' size)."""

    __slots__ = ("rows", "dim", "_fill", "_value")

    def __init__(self, rows: int, dim: int, fill: Callable[[torch.Tensor], None] | None = None,
                 value: torch.Tensor | None = None) -> None:
        assert (fill is None) != (value is None)
        self.rows, self.dim, self._fill, self._value = rows, dim, fill, value

    def fill(self, out: torch.Tensor) -> None:
        """Write the patches into out [rows, dim]."""
        if self._fill is None:
            out.copy_(self._value)
        else:
            self._fill(out)

    def get(self) -> torch.Tensor:
        """The patches [t*h*w, C*T*P*P]."""
        out = torch.empty(self.rows, self.dim)
        self.fill(out)
        return out


def compute_all(patches: Sequence[LazyPatches]) -> torch.Tensor:
    """Every image's patches, laid end to end in one new tensor; written across a pool of threads (one per
    torch thread)."""
    out = torch.empty(sum(p.rows for p in patches), patches[0].dim if patches else 0)
    jobs = list(zip(patches, out.split([p.rows for p in patches]), strict=True))
    if len(jobs) > 1 and torch.get_num_threads() > 1:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="sluice-patches"))
        inference = torch.is_inference_mode_enabled()  # thread-local: the workers take the caller's

        def fill(job: tuple[LazyPatches, torch.Tensor]) -> None:
            with torch.inference_mode(inference):
                job[0].fill(job[1])

        list(_POOL[0].map(fill, jobs))
    else:
        for p, rows in jobs:
            p.fill(rows)
    return out
