"""One request inside the engine: its tokens, progress and KV blocks."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import Any

import torch

from sluice.engine.outputs import RequestMetrics
from sluice.engine.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Request:
    """Tokens so far (prompt + output), how many have KV in cache, and the block table."""

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "params", "status", "num_computed_tokens",
        "block_table", "num_cached_tokens", "metrics", "finish_reason", "generator", "logprobs",
        "stop_text_len", "text", "spec_token_ids", "want_prompt_logits", "prompt_logits", "error",
        "draft_state", "grammar", "lora_request",
        "cache_salt", "mm_inputs",  # the prefix cache's hash seed (adapter, images); the prompt's images
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: Any = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.stop_text_len = 0
        self.text: str | None = None
        self.spec_token_ids: list[int] = []
        self.want_prompt_logits = False
        self.prompt_logits: list[torch.Tensor] = []
        self.error: str | None = None
        self.draft_state: object | None = None
        self.grammar: Any = None
        self.lora_request = lora_request  # engine.lora.LoRARequest, None for the base model
        self.cache_salt: int | None = None
        self.mm_inputs: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_target_tokens(self) -> int:
        """Tokens whose KV the next steps must compute: all known tokens plus speculative ones."""
        return self.num_tokens + len(self.spec_token_ids)

    def tokens_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output + speculative tokens (copies only what it must)."""
        n = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:stop] if start < n else []
        if stop <= n:
            return head
        return head + (self.output_token_ids + self.spec_token_ids)[max(0, start - n):stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
