"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Everything runs on the logits' device. Sampling noise comes from a counter-based hash of (request seed,
position, stream, vocab index) computed there, so a seeded request's tokens do not depend on what else is
in the batch and no [batch, vocab] noise crosses from the host.
"""

from __future__ import annotations

import torch

from sluice.engine.request import Request
from sluice.kernels import masked_sample
from sluice.kernels.elementwise import argmax

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
DRAFT_STREAM = 1  # a draft model's proposals: noise apart from the target's draw at one position
ACCEPT_STREAM = 2  # speculative acceptance tests


def device_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small per-row parameter tensor on `device`: pinned and copied without blocking on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row by row, vectorised over the batch."""
    dev = logits.device
    # greedy rows take the argmax whatever the filter gives them; at temperature 1 (as vLLM) their processed
    # logprobs stay finite
    temps = device_tensor([1.0 if r.params.greedy else max(r.params.temperature, 1e-5) for r in reqs],
                          torch.float32, dev)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        thresh = device_tensor(min_p, torch.float32, dev)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = device_tensor([k if k > 0 else vocab for k in top_k], torch.int64, logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cum = probs.cumsum(-1) - probs
    drop |= cum >= device_tensor(top_p, torch.float32, logits.device)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _row_keys(reqs: list[Request], positions: list[int] | None, stream: int, device,
              generator: torch.Generator) -> torch.Tensor:
    """One key per row from (request seed, position, stream); unseeded rows take a fresh seed from
    `generator`."""
    fresh = torch.randint(0, 2**62, (len(reqs),), generator=generator).tolist()
    seeds = [r.params.seed if r.params.seed is not None else f for r, f in zip(reqs, fresh, strict=True)]
    pos = positions if positions is not None else [r.num_tokens for r in reqs]
    rows = [[s & MASK32, (s >> 32) & MASK32, p & MASK32, stream] for s, p in zip(seeds, pos, strict=True)]
    return device_tensor(rows, torch.int64, device)


def keyed_uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """U(0, 1) float32 [rows, n] from a counter-based hash of each row's key and the column index."""
    lo, hi, pos, stream = keys.unbind(-1)
    row = _mix32(_mix32(lo ^ _mix32(hi ^ _mix32(stream))) ^ pos)
    col = torch.arange(n, device=keys.device, dtype=torch.int64) * GOLDEN
    bits = _mix32(_mix32((row[:, None] + col) & MASK32) ^ row[:, None])
    return ((bits >> 8).float() + 0.5) * 2.0**-24


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply) in int64 arithmetic that cannot overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def keyed_uniforms(reqs: list[Request], device, generator: torch.Generator, positions: list[int],
                   stream: int = ACCEPT_STREAM) -> torch.Tensor:
    """One U(0, 1) per row on `device`, keyed like the noise (seeded rows ignore the rest of the batch)."""
    return keyed_uniform(_row_keys(reqs, positions, stream, device, generator), 1)[:, 0]


def keyed_noise(reqs: list[Request], vocab: int, device, generator: torch.Generator,
                positions: list[int] | None = None, stream: int = 0) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] made on `device`; a seeded row's noise depends only on (seed, position,
    stream)."""
    return keyed_uniform(_row_keys(reqs, positions, stream, device, generator), vocab).log_().neg_()


def sample_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The filtered sampling distribution of each row (one-hot at argmax for greedy rows)."""
    probs = _filter(logits.float(), reqs).softmax(-1)
    if any(r.params.greedy for r in reqs):
        greedy = device_tensor([r.params.greedy for r in reqs], torch.bool, logits.device)
        onehot = torch.zeros_like(probs).scatter_(-1, argmax(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draw(probs: torch.Tensor, reqs: list[Request], generator: torch.Generator,
         positions: list[int] | None = None, stream: int = 0) -> torch.Tensor:
    """One token per row from `probs` via the exponential race (argmax of p / E), for the token at `positions`
    (default: each request's next one); `stream` separates draws at one position (target, draft, ...)."""
    noise = keyed_noise(reqs, probs.shape[-1], probs.device, generator, positions, stream)
    return argmax(probs / noise)


def sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
    """Sampled token ids [len(reqs)] from logits [len(reqs), vocab]."""
    if all(r.params.greedy for r in reqs):
        return argmax(logits)
    tokens = draw(sample_probs(logits, reqs), reqs, generator)
    greedy = device_tensor([r.params.greedy for r in reqs], torch.bool, logits.device)
    return torch.where(greedy, argmax(logits), tokens)


def fused_sample(logits: torch.Tensor, reqs: list[Request], generator: torch.Generator,
                 mask: tuple[list[int], torch.Tensor] | None = None,
                 mask_vocab: int = 0) -> torch.Tensor | None:
    """`sample`'s tokens from logits before the grammar's mask, by one C++ pass per row that masks (rows,
    bitmask: row i for reqs[i]), scales, draws and takes the argmax; None where it does not serve (another
    device, no kernel, a sampled row that filters by top-k, top-p or min-p): then mask the logits and call
    `sample`."""
    if not masked_sample.serves(logits) or any(not r.params.greedy
                                               and (r.params.top_k > 0 or r.params.top_p < 1
                                                    or r.params.min_p > 0) for r in reqs):
        return None
    temps = torch.tensor([0.0 if r.params.greedy else max(r.params.temperature, 1e-5) for r in reqs])
    if all(r.params.greedy for r in reqs):  # as `sample`: no draw from the generator
        keys = torch.zeros(len(reqs), 4, dtype=torch.int64)
    else:
        keys = _row_keys(reqs, None, 0, logits.device, generator)
    if mask is None:
        return masked_sample.masked_sample(logits, temps, keys)
    rows = torch.full((len(reqs),), -1, dtype=torch.int64)
    rows[mask[0]] = torch.tensor(mask[0])
    return masked_sample.masked_sample(logits, temps, keys, mask[1], rows, mask_vocab)


def processed_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The float32 logits each row samples from: after temperature (1 for greedy rows), min-p, top-k and top-p
    (filtered tokens at -inf); `logits` already carry bias, penalties and the grammar mask."""
    return _filter(logits.float(), reqs)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int,
                 normalize: bool = True) -> list[dict[int, float]]:
    """The sampled token's logprob plus the top-n of the row's distribution, per row (`normalize` False: the
    logits' own values, vLLM's *_logits modes)."""
    logp = logits.float().log_softmax(-1) if normalize else logits.float()
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    out: list[dict[int, float]] = [{} for _ in range(logits.shape[0])]
    if n > 0:
        vals, idx = logp.topk(n, dim=-1)
        for row, (v, i) in enumerate(zip(vals.tolist(), idx.tolist(), strict=True)):
            out[row] = dict(zip(i, v, strict=True))
    for row, t in enumerate(tokens.tolist()):
        out[row][t] = chosen[row]
    return out
