"""The device sampler's counter-based noise: keyed by (seed, position, stream), uniform, batch-independent."""

from __future__ import annotations

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import DRAFT_STREAM, draw, keyed_noise, keyed_uniform
from sluice.engine.sampling_params import SamplingParams


def req(seed: int | None, tokens: int = 3) -> Request:
    return Request(str(seed), list(range(tokens)), SamplingParams(temperature=1.0, seed=seed))


def test_seeded_noise_ignores_batch_composition_and_order():
    gen = torch.Generator().manual_seed(0)
    alone = keyed_noise([req(7)], 1000, "cpu", gen)
    batch = keyed_noise([req(None), req(3), req(7), req(None)], 1000, "cpu", gen)
    assert torch.equal(batch[2], alone[0])
    assert not torch.equal(batch[1], alone[0]) and not torch.equal(batch[0], batch[3])


def test_noise_changes_with_position_stream_and_seed():
    gen = torch.Generator()
    base = keyed_noise([req(7)], 500, "cpu", gen, [10])
    for other in (keyed_noise([req(7)], 500, "cpu", gen, [11]),
                  keyed_noise([req(7)], 500, "cpu", gen, [10], stream=DRAFT_STREAM),
                  keyed_noise([req(8)], 500, "cpu", gen, [10]),
                  keyed_noise([req(7 + 2**32)], 500, "cpu", gen, [10])):
        assert torch.corrcoef(torch.stack([base[0], other[0]]))[0, 1].abs() < 0.15


def test_keyed_uniform_is_uniform_and_open():
    keys = torch.tensor([[s, 0, p, 0] for s in range(16) for p in range(16)], dtype=torch.int64)
    u = keyed_uniform(keys, 4096).flatten()
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7  # chi-square, 15 dof, p = 0.001


def test_draw_follows_the_distribution_across_seeds():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 4000
    reqs = [req(s) for s in range(n)]
    tokens = draw(probs.expand(n, -1), reqs, torch.Generator())
    counts = torch.bincount(tokens, minlength=6).float()
    assert counts[5] == 0
    expected = probs[:5] * n
    assert ((counts[:5] - expected) ** 2 / expected).sum() < 18.47  # chi-square, 4 dof, p = 0.001
