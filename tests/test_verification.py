"""Verification of a whole step at once: no per-token host reads, the greedy rule, seeded batch
independence."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.verification import verify_proposals

VOCAB = 50


class ScalarReads(TorchDispatchMode):
    """Counts `.item()`-style reads of one tensor element to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "_local_scalar_dense" in str(func)
        return func(*args, **(kwargs or {}))


def spec_req(name: str, spec: list[int], seed: int | None, greedy: bool = False) -> Request:
    r = Request(name, [1, 2, 3], SamplingParams(temperature=0 if greedy else 1.0, seed=seed))
    r.spec_token_ids = spec
    return r


def test_step_verifies_without_scalar_reads_and_keeps_greedy_rule():
    g = torch.Generator().manual_seed(0)
    reqs = [spec_req("a", [4, 5, 6], 1), spec_req("b", [7, 8], None, greedy=True), spec_req("c", [9], 2)]
    logits = [torch.randn(len(r.spec_token_ids) + 1, VOCAB, generator=g) for r in reqs]
    best = logits[1].argmax(-1).tolist()
    reqs[1].spec_token_ids = [best[0], (best[1] + 1) % VOCAB]
    with ScalarReads() as reads:
        out = verify_proposals(reqs, logits, torch.Generator())
    assert reads.count == 0
    assert out[1] == best[:2]
    for r, emitted in zip(reqs, out, strict=True):
        n = len(emitted) - 1
        assert 0 <= n <= len(r.spec_token_ids) and emitted[:n] == r.spec_token_ids[:n]


def test_seeded_verify_ignores_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(1)
    target = spec_req("t", [3, 4, 5, 6], 42)
    logits = torch.randn(5, VOCAB, generator=g) * 0.3
    alone = verify_proposals([target], [logits], torch.Generator())[0]
    others = [spec_req(f"o{i}", [i + 1] * (i + 1), None) for i in range(3)]
    mixed = verify_proposals([others[0], target, others[1], others[2]],
                   [torch.randn(i + 2, VOCAB, generator=g) for i in range(1)] + [logits]
                   + [torch.randn(i + 3, VOCAB, generator=g) for i in range(2)], torch.Generator())[1]
    assert mixed == alone
