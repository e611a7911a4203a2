"""The device sampler's counter-based noise: keyed by (seed, position, stream), uniform, batch-independent;
the C++ sampler that masks, scales, draws and takes the argmax in one pass picks the torch path's tokens."""

from __future__ import annotations

import shutil

import pytest
import torch

from sluice.engine.request import Request
from sluice.engine.sampler import DRAFT_STREAM, draw, fused_sample, keyed_noise, keyed_uniform, sample
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


def _torch_path(logits: torch.Tensor, reqs: list[Request], gen: torch.Generator, rows: list[int],
                bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The engine's torch path: a float32 copy masked by xgrammar, then `sample`."""
    import xgrammar as xgr

    out = logits.float()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, indices=rows)
    return sample(out, reqs, gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_sampler_picks_the_torch_paths_tokens(dtype):
    """Greedy, seeded and unseeded rows at several temperatures, masked by a bitmask or not, with logits wider
    than the masked vocabulary (tokens past it stay allowed): the C++ sampler's token is the torch path's."""
    from sluice.kernels import cpp_build, masked_sample

    if not cpp_build.enabled() or shutil.which(cpp_build.options.current().cxx) is None:
        pytest.skip("SLUICE_CPU_KERNEL=0 or no C++ compiler: the torch path serves")
    vocab, rows = 1000, 48
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab + 7) * 4).to(dtype)
    logits[::7, vocab:] = 50.0  # past the bitmask: only the torch path's own rule keeps or drops these
    reqs = [Request(str(i), [1, 2],
                    SamplingParams(temperature=(0.0, 0.3, 1.0, 1.7)[i % 4], top_k=(i % 11 == 5),
                                   seed=None if i % 3 == 0 else i)) for i in range(rows)]
    bitmask = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[1::5] = 0  # rows that allow nothing below `vocab`
    for masked in ([], [i for i in range(rows) if i % 4 != 1]):
        assert masked_sample.serves(logits)
        fused = fused_sample(logits, reqs, torch.Generator().manual_seed(9),
                             (masked, bitmask) if masked else None, vocab)
        expected = _torch_path(logits, reqs, torch.Generator().manual_seed(9), masked, bitmask, vocab)
        assert torch.equal(fused, expected)


def test_fused_sampler_leaves_filtering_rows_to_torch():
    """top-p, top-k and min-p need the sorted distribution: the fused sampler declines, the torch path
    samples."""
    logits = torch.randn(2, 64)
    for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1)):
        reqs = [Request("a", [1], SamplingParams()), Request("b", [1], params)]
        assert fused_sample(logits, reqs, torch.Generator()) is None
