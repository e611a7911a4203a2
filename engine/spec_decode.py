"""Speculative decoding inside the continuous batch: proposers (draft model, n-gram) and a lossless verifier."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.models.llama import ModelConfig
from engine.models.loader import load_model, read_config
from engine.request import Request
from engine.sampler import DRAFT_STREAM, draw, sample_probs
from engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.model_runner import StepLogits

METHODS = ("draft", "ngram")
# Measured on CPU with the bundled pair (docs/benchmarks.md, speculative decoding): the bf16 and int8 drafts
# gain >= 1.16x up to 8 running requests and 0.89-1.08x beyond, where a larger target's compute-bound step
# would lose; n-gram lookup costs nothing to propose but verifying still grows with the batch.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

@dataclass(slots=True)
class SpecConfig:
    """Validated speculative settings."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    quantization: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> SpecConfig:
        """Check the user's dict and name what is wrong."""
        raw = dict(raw)
        method = raw.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative method {method!r} is unknown; choose one of {', '.join(METHODS)}")
        k = raw.pop("num_speculative_tokens", 4)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative num_speculative_tokens must be an integer >= 1, got {k!r}")
        unknown = set(raw) - {"model", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                              "quantization"}
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        cfg = cls(method, k, **raw)
        if method == "draft" and not cfg.model:
            raise ValueError("speculative method 'draft' needs 'model': the draft checkpoint folder")
        if method != "draft" and cfg.quantization is not None:
            raise ValueError("speculative 'quantization' quantizes only a draft model (method 'draft')")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative prompt_lookup_min/max must satisfy 1 <= min <= max")
        if not isinstance(cfg.disable_by_batch_size, int) or cfg.disable_by_batch_size < 0:
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 0, "
                             f"got {cfg.disable_by_batch_size!r}")
        return cfg


class Proposer:
    """Proposes up to k tokens per running request and verifies them against the target's logits."""

    def __init__(self, engine: Engine, cfg: SpecConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.proposed = self.accepted = self.steps = 0

    def budget(self, req: Request) -> int:
        """How many tokens may be proposed without overrunning max_tokens or max_model_len."""
        left = self.engine.max_model_len - req.num_tokens - 1
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

    def _propose(self, reqs: list[Request]) -> None:
        raise NotImplementedError

    def release(self, req: Request) -> None:
        """Forget per-request proposer state."""

    def verify(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Request]:
        """Accept/reject each request's proposals (Leviathan et al.); append the emitted tokens."""
        finished = []
        best = rows.logits.max(-1).indices.tolist() if any(reqs[i].params.greedy for i in index) else []
        for i in index:
            req = reqs[i]
            start, n = rows.row_start[i], rows.num_rows[i]
            logits = rows.logits[start: start + n]
            emitted = _accept_greedy(req.spec_token_ids, best[start: start + n]) if req.params.greedy \
                else self._accept(req, logits)
            k, a = len(req.spec_token_ids), len(emitted) - 1
            self.proposed, self.accepted, self.steps = self.proposed + k, self.accepted + a, self.steps + 1
            m = req.metrics
            m.spec_proposed, m.spec_accepted, m.spec_steps = m.spec_proposed + k, m.spec_accepted + a, m.spec_steps + 1
            base = req.num_tokens
            req.spec_token_ids, req.draft_state = [], None
            lps = self.engine.logprobs_for(logits[: len(emitted)], emitted, req)
            if self.engine.append_tokens(req, emitted, lps):
                finished.append(req)
            else:
                req.num_computed_tokens = base + a
                self.engine.block_manager.trim(req, req.num_tokens)
        return finished

    def _accept(self, req: Request, logits: torch.Tensor) -> list[int]:
        spec = req.spec_token_ids
        p = sample_probs(logits, [req] * logits.shape[0])
        q = req.draft_state if req.draft_state is not None else _one_hot(spec, p.shape[-1], p.device)
        gen = req.generator if req.generator is not None else self.engine.generator
        out: list[int] = []
        for j, tok in enumerate(spec):
            u = torch.rand((), generator=gen).item()
            if u * q[j, tok].item() < p[j, tok].item():
                out.append(tok)
                continue
            residual = (p[j] - q[j]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[j]
            return out + self._draw(residual, req, j)
        return out + self._draw(p[len(spec)], req, len(spec))

    def _draw(self, probs: torch.Tensor, req: Request, offset: int) -> list[int]:
        return draw(probs[None], [req], self.engine.generator, [req.num_tokens + offset]).tolist()

    def stats(self) -> dict[str, float]:
        return {
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
        }


def _one_hot(tokens: list[int], vocab: int, device) -> torch.Tensor:
    return torch.zeros(len(tokens), vocab, device=device).scatter_(-1, torch.tensor(tokens, device=device)[:, None], 1.0)


def _accept_greedy(spec: list[int], best: list[int]) -> list[int]:
    """Against a greedy target the rejection rule reduces to: keep proposals while they are its argmax."""
    n = 0
    while n < len(spec) and spec[n] == best[n]:
        n += 1
    return best[: n + 1]


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
    """A small model with its own paged KV cache proposes k tokens autoregressively."""

    def __init__(self, engine: Engine, cfg: SpecConfig) -> None:
        super().__init__(engine, cfg)
        draft_cfg = ModelConfig.from_hf(read_config(cfg.model))
        _check_vocab(engine, draft_cfg, cfg.model)
        self.model = self._load(engine, cfg)
        num_blocks = engine.block_manager.num_blocks
        self.blocks = BlockManager(num_blocks, engine.config.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, num_blocks, engine.config.block_size, engine.dtype, engine.device)
        self.shadows: dict[str, Request] = {}

    @staticmethod
    def _load(engine: Engine, cfg: SpecConfig):
        """The draft in the target's dtype, quantized as `cfg.quantization` says (any engine method)."""
        from engine.quantization import linear_hook

        config = replace(engine.config, model=cfg.model, quantization=cfg.quantization, speculative=None)
        return load_model(cfg.model, engine.dtype, engine.device, engine.max_model_len,
                          linear_hook(config, engine.device, engine.dtype))

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
            active = [i for i in active if step < ks[i] and self._fits(shadows[i])]
            if not active:
                break
            batch = ScheduledBatch([shadows[i] for i in active],
                                   [shadows[i].num_tokens - shadows[i].num_computed_tokens for i in active], [])
            for s, n in zip(batch.requests, batch.num_new_tokens, strict=True):
                self.blocks.allocate(s, n)
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

    def _sample(self, logits: torch.Tensor, reqs: list[Request],
                positions: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens and, unless every row is greedy, the distributions they were drawn from."""
        if all(r.params.greedy for r in reqs):
            return logits.max(-1).indices.tolist(), None
        q = sample_probs(logits, reqs)
        return draw(q, reqs, self.engine.generator, positions, stream=DRAFT_STREAM).tolist(), q

    def _fits(self, s: Request) -> bool:
        return self.blocks.can_allocate(self.blocks.blocks_needed(s, s.num_tokens - s.num_computed_tokens))

    def release(self, req: Request) -> None:
        s = self.shadows.pop(req.request_id, None)
        if s is not None:
            self.blocks.free(s)


def _check_vocab(engine: Engine, draft: ModelConfig, path: str) -> None:
    target = engine.model_config
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {path} has vocab_size {draft.vocab_size}, the target has "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    try:
        from transformers import AutoTokenizer

        draft_vocab = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return
    if draft_vocab != engine.tokenizer.get_vocab():
        raise ValueError(f"draft model {path} uses a different tokenizer vocabulary than the target")


def make_proposer(engine: Engine) -> Proposer:
    """The proposer named by the engine's `speculative` setting."""
    cfg = SpecConfig.parse(engine.config.speculative or {})
    return DraftProposer(engine, cfg) if cfg.method == "draft" else NgramProposer(engine, cfg)
