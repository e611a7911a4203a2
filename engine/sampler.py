"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from engine.request import Request


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row by row, vectorised over the batch."""
    dev = logits.device
    temps = torch.tensor([max(r.params.temperature, 1e-5) for r in reqs], device=dev)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        thresh = torch.tensor(min_p, device=dev)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1) - probs
    drop |= cum >= torch.tensor(top_p, device=logits.device)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_noise(n: int, generator: torch.Generator) -> torch.Tensor:
    """n draws of Exp(1) as -log(1 - U), kept above zero (4x faster than Tensor.exponential_ on CPU)."""
    return torch.rand(n, generator=generator).neg_().log1p_().neg_().clamp_min_(1e-30)


def _noise(reqs: list[Request], vocab: int, device, generator: torch.Generator) -> torch.Tensor:
    """Exponential noise per row; seeded requests draw from their own generator."""
    rows = [exponential_noise(vocab, r.generator if r.generator is not None else generator) for r in reqs]
    return torch.stack(rows).to(device)


def sample_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The filtered sampling distribution of each row (one-hot at argmax for greedy rows)."""
    probs = _filter(logits.float(), reqs).softmax(-1)
    greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draw(probs: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
    """One token per row from `probs`, via the exponential race (argmax of p / E)."""
    noise = _noise(reqs, probs.shape[-1], probs.device, generator)
    return (probs / noise).argmax(-1)


def sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
    """Sampled token ids [len(reqs)] from logits [len(reqs), vocab]."""
    if all(r.params.greedy for r in reqs):
        return logits.max(-1).indices
    tokens = draw(sample_probs(logits, reqs), reqs, generator)
    greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
    return torch.where(greedy, logits.argmax(-1), tokens)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[dict[int, float]]:
    """The sampled token's logprob plus the top-n of the raw distribution, per row."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    out: list[dict[int, float]] = [{} for _ in range(logits.shape[0])]
    if n > 0:
        vals, idx = logp.topk(n, dim=-1)
        for row, (v, i) in enumerate(zip(vals.tolist(), idx.tolist(), strict=True)):
            out[row] = dict(zip(i, v, strict=True))
    for row, t in enumerate(tokens.tolist()):
        out[row][t] = chosen[row]
    return out
