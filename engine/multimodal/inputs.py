"""A prompt's images as the engine keeps them: pixels, grids, where their tokens lie, and M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.engine.multimodal.image_patches import LazyPatches


@dataclass(slots=True, frozen=True)
class ImageItem:
    """One image of a prompt: its patches, (t, h, w) patch grid, content hash and placeholder token span."""

    content_hash: str
    patches: LazyPatches  # computed when the image is encoded
    grid_thw: tuple[int, int, int]
    offset: int  # index in the prompt of the image's first placeholder token
    length: int  # placeholder tokens (t * h * w / merge**2)

    @property
    def pixel_values(self) -> torch.Tensor:
        """The image's patches [t * h * w, channels * temporal_patch * patch * patch]."""
        return self.patches.get()


@dataclass(slots=True)
class MultiModalInputs:
    """A request's images and its prompt's M-RoPE positions [3, prompt_len] (positions past the prompt: index
    + mrope_delta on all three axes)."""

    items: list[ImageItem]
    mrope_positions: torch.Tensor
    mrope_delta: int
    cache_salt: int = field(default=0)

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens of every image of the prompt."""
        return sum(item.length for item in self.items)

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """M-RoPE positions [3, stop - start] of token indices [start, stop)."""
        n = self.mrope_positions.shape[1]
        head = self.mrope_positions[:, start:min(stop, n)]
        if stop <= n:
            return head
        tail = torch.arange(max(start, n), stop) + self.mrope_delta
        return torch.cat([head, tail.expand(3, -1)], 1)


def step_positions(requests, num_new_tokens: list[int]) -> torch.Tensor:
    """M-RoPE positions of a step's new tokens, requests in the flat batch's order: [T] where every token's
    three axes agree (text-only requests, and images' requests past their prompts, as in decode), else
    [3, T], the 1D positions with the spans of prompts with images written over."""
    linear: list[int] = []
    spans: list[tuple[int, torch.Tensor]] = []
    for req, n in zip(requests, num_new_tokens, strict=True):
        start, mm = req.num_computed_tokens, getattr(req, "mm_inputs", None)
        shift = 0 if mm is None else mm.mrope_delta
        if mm is not None and start < mm.mrope_positions.shape[1]:
            spans.append((len(linear), mm.positions(start, start + n)))
        linear.extend(range(start + shift, start + n + shift))
    positions = torch.tensor(linear, dtype=torch.long)
    if spans:
        positions = positions.repeat(3, 1)
        for at, span in spans:
            positions[:, at:at + span.shape[1]] = span
    return positions


def mrope_positions(ids: list[int], items: list[ImageItem], merge: int) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's 3D positions of a prompt (text: one step per token on all axes; an image: (t, h, w) over its
    merged grid from the position after the text before it; text after it continues from its largest + 1) and
    the delta of positions past the prompt."""
    pieces, pos, cursor = [], 0, 0
    for item in items:
        text = item.offset - cursor
        pieces.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        t, h, w = item.grid_thw[0], item.grid_thw[1] // merge, item.grid_thw[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = item.offset + item.length
    pieces.append(torch.arange(len(ids) - cursor).expand(3, -1) + pos)
    positions = torch.cat(pieces, 1)
    return positions, int(positions.max()) + 1 - len(ids)


def with_images(req, mm: MultiModalInputs | None):
    """The request carrying a prompt's images and their prefix-cache salt (as it is where mm is None)."""
    if mm is not None:
        req.mm_inputs, req.cache_salt = mm, mm.cache_salt
    return req
