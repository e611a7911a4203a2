"""Vision encoder outputs by image content hash: the same image in many prompts is encoded once."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class EncoderCache:
    """Image embeddings [tokens, hidden] by content hash, least recently used evicted past `max_tokens` rows.

    An evicted image is encoded again when a request needs it (a preempted or chunked prompt included), so the
    cache only saves work and never changes a result."""

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.num_encoded = 0  # images run through the encoder
        self.num_hits = 0  # images served from the cache

    def get(self, key: str) -> torch.Tensor | None:
        """The embeddings of image `key`, if cached (marked most recently used)."""
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
            self.num_hits += 1
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        """Keep the embeddings of image `key`, evicting the least recently used past the budget."""
        if key in self.entries:
            return
        self.entries[key] = value
        self.num_tokens += value.shape[0]
        self.num_encoded += 1
        while self.num_tokens > self.max_tokens and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.shape[0]

    def for_step(self, batch) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(cached embeddings by hash, items to encode by hash) of every image the step's new tokens cover:
        each image once, however many of the step's requests show it."""
        found: dict[str, torch.Tensor] = {}
        todo: dict[str, Any] = {}
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, mm = req.num_computed_tokens, getattr(req, "mm_inputs", None)
            for item in mm.items if mm is not None else ():
                key = item.content_hash
                if not (item.offset < start + n and start < item.offset + item.length):
                    continue
                if key in found or key in todo:
                    self.num_hits += 1  # another request of this step shows the same image
                elif (cached := self.get(key)) is not None:
                    found[key] = cached
                else:
                    todo[key] = item
        return found, todo

    def stats(self) -> dict[str, int]:
        """Images encoded and served from the cache so far."""
        return {"images_encoded": self.num_encoded, "encoder_cache_hits": self.num_hits}
