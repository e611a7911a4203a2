"""Verify speculative tokens against the target's logits: greedy accept and lossless rejection sampling.

All requests of a step are verified together on the logits' device; the emitted tokens cross to the host
in one copy (one sync per step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.logits_processors import LogitsProcessors
from sluice.engine.model_runner import StepLogits
from sluice.engine.request import Request
from sluice.engine.sampler import device_tensor, draw, keyed_uniforms, sample_probs
from sluice.kernels.elementwise import argmax


@dataclass(slots=True)
class SpecStats:
    """Proposed and accepted speculative tokens across all requests, and the verify steps that saw them."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """Count one verify step of `req` in the totals and in the request's metrics."""
        self.proposed, self.accepted = self.proposed + proposed, self.accepted + accepted
        self.steps += 1
        m = req.metrics
        m.spec_proposed, m.spec_accepted, m.spec_steps = (m.spec_proposed + proposed,
                                                          m.spec_accepted + accepted, m.spec_steps + 1)

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
        }


@dataclass(slots=True)
class Verified:
    """One request's verify step: the tokens it emits, the target's rows that gave them (raw and processed)
    and the tokens it had before."""

    req: Request
    emitted: list[int]
    logits: torch.Tensor
    processed: torch.Tensor
    base: int


class SpecVerifier:
    """A step's speculative verification: the requests' proposals checked against the target's rows (logits
    processing applied as if each proposal were sampled), counted, and the rejected slots rolled back."""

    def __init__(self, processors: LogitsProcessors, generator: torch.Generator,
                 blocks: BlockManager) -> None:
        self.processors, self.generator, self.blocks = processors, generator, blocks
        self.stats = SpecStats()

    def verify(self, reqs: list[Request], rows: StepLogits, index: list[int]) -> list[Verified]:
        """Verify each listed request's proposals (which are cleared); what each emits."""
        step_logits = [rows.logits[rows.row_start[i]: rows.row_start[i] + rows.num_rows[i]] for i in index]
        processed_all = self._processed_rows([reqs[i] for i in index], step_logits)
        emitted_all = verify_proposals([reqs[i] for i in index], processed_all, self.generator)
        found = []
        for i, logits, processed, emitted in zip(index, step_logits, processed_all, emitted_all, strict=True):
            req = reqs[i]
            self.stats.record(req, len(req.spec_token_ids), len(emitted) - 1)
            n = len(emitted)
            found.append(Verified(req, emitted, logits[:n], processed[:n], req.num_tokens))
            req.spec_token_ids, req.draft_state = [], None
        return found

    def roll_back(self, v: Verified) -> None:
        """Keep the KV of the accepted proposals of a request that goes on; the rejected slots are freed."""
        v.req.num_computed_tokens = v.base + len(v.emitted) - 1
        self.blocks.trim(v.req, v.req.num_tokens)

    def _processed_rows(self, reqs: list[Request], step_logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """The verify rows with logits processing applied, each row seeing the proposals before it."""
        if not any(r.params.processed for r in reqs):
            return step_logits
        row_reqs = [r for r, lg in zip(reqs, step_logits, strict=True) for _ in range(lg.shape[0])]
        ahead = [j for lg in step_logits for j in range(lg.shape[0])]
        processed = self.processors.apply(torch.cat(step_logits), row_reqs, ahead)
        return list(processed.split([lg.shape[0] for lg in step_logits]))


def accept_greedy(spec: list[int], best: list[int]) -> list[int]:
    """Against a greedy target the rejection rule reduces to: keep proposals while they are its argmax."""
    n = 0
    while n < len(spec) and spec[n] == best[n]:
        n += 1
    return best[: n + 1]


def verify_proposals(reqs: list[Request], logits: list[torch.Tensor],
                     generator: torch.Generator) -> list[list[int]]:
    """Emitted tokens per request (accepted proposals, then a corrected or bonus token), with one host sync.

    `logits[i]` holds the target's rows for request i's speculative positions plus one. Greedy requests keep
    proposals while they are the argmax; the others run rejection sampling vectorized over every row."""
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    parts = [argmax(torch.cat([logits[i] for i in greedy]))] if greedy else []
    if sampled:
        parts += _rejection_tensors([reqs[i] for i in sampled], [logits[i] for i in sampled], generator)
    flat = iter(torch.cat(parts).tolist())
    best = {i: [next(flat) for _ in range(logits[i].shape[0])] for i in greedy}
    accepted = {i: [next(flat) for _ in reqs[i].spec_token_ids] for i in sampled}
    drawn = {i: [next(flat) for _ in range(logits[i].shape[0])] for i in sampled}
    out = []
    for i, r in enumerate(reqs):
        if i in best:
            out.append(accept_greedy(r.spec_token_ids, best[i]))
        else:
            n = accepted[i].index(0) if 0 in accepted[i] else len(accepted[i])
            out.append(r.spec_token_ids[:n] + [drawn[i][n]])
    return out


def _rejection_tensors(reqs: list[Request], logits: list[torch.Tensor],
                       generator: torch.Generator) -> list[torch.Tensor]:
    """Per proposal: accepted (u * q < p, Leviathan et al.); per row: a draw from the residual max(p - q, 0)
    (p where that is empty) at proposal rows and from p at each request's last row (the bonus token)."""
    rows = [r for r, lg in zip(reqs, logits, strict=True) for _ in range(lg.shape[0])]
    offsets = [j for lg in logits for j in range(lg.shape[0])]
    positions = [r.num_tokens + j for r, j in zip(rows, offsets, strict=True)]
    p = sample_probs(torch.cat(logits), rows)
    dev, vocab = p.device, p.shape[-1]
    spec_at = [k for k, (r, j) in enumerate(zip(rows, offsets, strict=True)) if j < len(r.spec_token_ids)]
    tokens = [t for r in reqs for t in r.spec_token_ids]
    q = torch.cat([r.draft_state if r.draft_state is not None else _one_hot(r.spec_token_ids, vocab, dev)
                   for r in reqs])
    at, tok = device_tensor(spec_at, torch.int64, dev), device_tensor(tokens, torch.int64, dev)[:, None]
    ps = p.index_select(0, at)
    u = keyed_uniforms([rows[k] for k in spec_at], dev, generator, [positions[k] for k in spec_at])
    accept = u * q.gather(-1, tok)[:, 0] < ps.gather(-1, tok)[:, 0]
    residual = (ps - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, ps)
    drawn = draw(p.index_copy(0, at, residual), rows, generator, positions)
    return [accept.long(), drawn]


def _one_hot(tokens: list[int], vocab: int, device) -> torch.Tensor:
    return torch.zeros(len(tokens), vocab,
                       device=device).scatter_(-1, torch.tensor(tokens, device=device)[:, None], 1.0)
