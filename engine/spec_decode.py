"""Speculative proposers (n-gram lookup, draft model): each attaches up to k proposed tokens to running
requests.

Proposers only propose; `engine.verification` verifies and the engine appends and rolls back (vLLM v1's
split).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.model_runner import ModelRunner
from sluice.engine.models.llama import LlamaModel, ModelConfig
from sluice.engine.models.loader import load_model, read_config
from sluice.engine.quantization import linear_hook
from sluice.engine.request import Request
from sluice.engine.sampler import DRAFT_STREAM, draw, sample_probs
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.tokenizer import load_tokenizer
from sluice.kernels.elementwise import argmax


class Proposer:
    """Proposes up to k tokens per eligible running request, within max_tokens and max_model_len."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg, self.max_model_len = cfg, max_model_len

    def budget(self, req: Request) -> int:
        """How many tokens may be proposed without overrunning max_tokens or max_model_len."""
        left = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(0, min(self.cfg.num_speculative_tokens, left))

    def propose(self, running: list[Request]) -> None:
        """Attach speculative tokens (and their draft probabilities) to eligible running requests."""
        if len(running) > self.cfg.disable_by_batch_size:
            return
        eligible = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and self.budget(r) > 0]
        if eligible:
            self._propose(eligible)

    def fit(self, batch: ScheduledBatch, running: list[Request]) -> None:
        """Drop the speculative tokens that did not fit this step's budget (they are dropped, not chunked)."""
        scheduled = set(map(id, batch.requests))
        for req in running:
            if req.spec_token_ids and id(req) not in scheduled:
                req.spec_token_ids, req.draft_state = [], None
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if req.spec_token_ids:
                keep = req.num_computed_tokens + n - req.num_tokens
                req.spec_token_ids = req.spec_token_ids[: max(0, keep)]
                if req.draft_state is not None:
                    req.draft_state = req.draft_state[: max(0, keep)] if keep > 0 else None

    def _propose(self, reqs: list[Request]) -> None:
        raise NotImplementedError

    def release(self, req: Request) -> None:
        """Forget per-request proposer state."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed."""

    def _propose(self, reqs: list[Request]) -> None:
        for req in reqs:
            req.spec_token_ids = self.lookup(req.all_token_ids, self.budget(req))
            req.draft_state = None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min - 1, -1):
            if len(tokens) <= n:
                continue
            pattern = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == pattern:
                    return tokens[start + n: start + n + k]
        return []


class DraftProposer(Proposer):
    """A small model with its own paged KV cache proposes k tokens autoregressively.

    Each request has a shadow request in the draft's block pool. When that pool is full the request gets no
    (or fewer) proposals this step and shadows of requests no longer running are freed: speculation backs off
    under memory pressure, it never fails."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, runner: ModelRunner, blocks: BlockManager,
                 generator: torch.Generator) -> None:
        super().__init__(cfg, max_model_len)
        self.runner, self.blocks, self.generator = runner, blocks, generator
        self.shadows: dict[str, Request] = {}

    @property
    def model(self) -> LlamaModel:
        return self.runner.model

    def propose(self, running: list[Request]) -> None:
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.shadows if rid not in live]:
            self.blocks.free(self.shadows.pop(rid))
        super().propose(running)

    def _shadow(self, req: Request) -> Request:
        tokens = req.all_token_ids
        s = self.shadows.get(req.request_id)
        if s is None:
            s = self.shadows[req.request_id] = Request(req.request_id, tokens, req.params)
            return s
        common = 0
        for a, b in zip(s.prompt_token_ids, tokens, strict=False):
            if a != b:
                break
            common += 1
        s.prompt_token_ids = tokens
        s.num_computed_tokens = min(s.num_computed_tokens, common)
        self.blocks.trim(s, s.num_computed_tokens)
        return s

    def _propose(self, reqs: list[Request]) -> None:
        shadows = [self._shadow(r) for r in reqs]
        ks = [self.budget(r) for r in reqs]
        active = list(range(len(reqs)))
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for step in range(max(ks)):
            active = [i for i in active if step < ks[i] and self._allocate(shadows[i])]
            if not active:
                break
            batch = ScheduledBatch([shadows[i] for i in active],
                                   [shadows[i].num_tokens - shadows[i].num_computed_tokens for i in active],
                                   [])
            tokens, q = self._sample(self.runner.run(batch).logits, [reqs[i] for i in active],
                                     [shadows[i].num_tokens for i in active])
            for j, i in enumerate(active):
                s = shadows[i]
                s.num_computed_tokens = s.num_tokens
                s.prompt_token_ids.append(tokens[j])
                if q is not None and not reqs[i].params.greedy:
                    probs[i].append(q[j])
        for i, req in enumerate(reqs):
            req.spec_token_ids = shadows[i].prompt_token_ids[req.num_tokens:]
            req.draft_state = torch.stack(probs[i]) if probs[i] else None

    def _allocate(self, s: Request) -> bool:
        """Blocks for the shadow's uncomputed tokens, if the draft pool has them; False (no allocation) if
        not."""
        n = s.num_tokens - s.num_computed_tokens
        if not self.blocks.can_allocate(self.blocks.blocks_needed(s, n)):
            return False
        self.blocks.allocate(s, n)
        return True

    def _sample(self, logits: torch.Tensor, reqs: list[Request],
                positions: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens and, unless every row is greedy, the distributions they were drawn from."""
        if all(r.params.greedy for r in reqs):
            return argmax(logits).tolist(), None
        q = sample_probs(logits, reqs)
        return draw(q, reqs, self.generator, positions, stream=DRAFT_STREAM).tolist(), q

    def release(self, req: Request) -> None:
        s = self.shadows.pop(req.request_id, None)
        if s is not None:
            self.blocks.free(s)


def load_draft(cfg: SpeculativeConfig, engine_config: EngineConfig, target: ModelConfig, target_vocab: dict,
               dtype: torch.dtype, device: torch.device, max_model_len: int) -> LlamaModel:
    """The draft model in the target's dtype on its device, quantized as `cfg.quantization` says."""
    assert cfg.model is not None
    hf_config = read_config(cfg.model)
    draft = ModelConfig.from_hf(hf_config)
    _check_vocab(draft, target, target_vocab, cfg.model, hf_config)
    config = replace(engine_config, model=cfg.model, quantization=cfg.quantization, speculative=None)
    return load_model(cfg.model, dtype, device, max_model_len, linear_hook(config, device, dtype, hf_config),
                      draft, engine_config.weight_loading, engine_config.huge_pages, hf_config=hf_config)


def _check_vocab(draft: ModelConfig, target: ModelConfig, target_vocab: dict, path: str,
                 hf_config: dict) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {path} has vocab_size {draft.vocab_size}, the target has "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    try:
        draft_vocab = load_tokenizer(path, hf_config).get_vocab()
    except (OSError, ValueError):
        return
    if draft_vocab != target_vocab:
        raise ValueError(f"draft model {path} uses a different tokenizer vocabulary than the target")
