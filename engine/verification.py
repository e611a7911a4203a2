"""Verify speculative tokens against the target's logits: greedy accept and lossless rejection sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.sampler import draw, sample_probs


@dataclass(slots=True)
class SpecStats:
    """Proposed and accepted speculative tokens across all requests, and the verify steps that saw them."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """Count one verify step of `req` in the totals and in the request's metrics."""
        self.proposed, self.accepted, self.steps = self.proposed + proposed, self.accepted + accepted, self.steps + 1
        m = req.metrics
        m.spec_proposed, m.spec_accepted, m.spec_steps = (m.spec_proposed + proposed, m.spec_accepted + accepted,
                                                          m.spec_steps + 1)

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
        }


def accept_greedy(spec: list[int], best: list[int]) -> list[int]:
    """Against a greedy target the rejection rule reduces to: keep proposals while they are its argmax."""
    n = 0
    while n < len(spec) and spec[n] == best[n]:
        n += 1
    return best[: n + 1]


def rejection_sample(req: Request, logits: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Accept each proposal with min(1, p/q), else draw from the residual (Leviathan et al.); then a bonus token.

    `logits` holds the target's rows for the request's speculative positions plus one; `req.draft_state` holds the
    draft's distributions q (None: the proposals were deterministic, q is one-hot)."""
    spec = req.spec_token_ids
    p = sample_probs(logits, [req] * logits.shape[0])
    q = req.draft_state if req.draft_state is not None else _one_hot(spec, p.shape[-1], p.device)
    gen = req.generator if req.generator is not None else generator
    out: list[int] = []
    for j, tok in enumerate(spec):
        u = torch.rand((), generator=gen).item()
        if u * q[j, tok].item() < p[j, tok].item():
            out.append(tok)
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        residual = residual if residual.sum() > 0 else p[j]
        return out + draw(residual[None], [req], generator, [req.num_tokens + j]).tolist()
    return out + draw(p[len(spec)][None], [req], generator, [req.num_tokens + len(spec)]).tolist()


def _one_hot(tokens: list[int], vocab: int, device) -> torch.Tensor:
    return torch.zeros(len(tokens), vocab, device=device).scatter_(-1, torch.tensor(tokens, device=device)[:, None], 1.0)
