"""Bidirectional attention of unpadded sequences back to back (kernels.varlen_attention: the encoder engine's
and the vision towers' attention) against float64 SDPA over each sequence alone, on every CPU tier."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import cpp_build, varlen_attention
from tests.tiers import tier_fixture

cpu_tier = tier_fixture(autouse=True)


def reference(q, k, v, lengths, scale):
    outs, start = [], 0
    for n in lengths:
        qi, ki, vi = (t[start:start + n].double().transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}  # fp32 sums, one rounding of out


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("heads,dim", [(4, 32), (3, 64), (2, 80), (1, 16)])
def test_each_token_attends_its_own_sequence_alone(heads, dim, dtype):
    """Sequences of 1 to 300 tokens (query blocks of 64 with a tail, row groups cut short) laid back to back,
    q, k and v the strided thirds of one fused qkv: within one rounding of the output's dtype (2e-6 in fp32)
    of float64 SDPA over each sequence alone, and the C++ kernel ran wherever the tier's vectors divide the
    head dim."""
    torch.manual_seed(0)
    lengths = [1, 17, 64, 65, 300, 3, 0, 130]
    qkv = torch.randn(sum(lengths), 3, heads, dim).to(dtype)
    q, k, v = qkv.unbind(1)
    got = varlen_attention.varlen_attention(q, k, v, lengths, dim**-0.5)
    assert got.dtype is dtype
    want = reference(q, k, v, lengths, dim**-0.5)
    assert ((got.double() - want).abs() <= want.abs() * TOL[dtype] + 2e-6).all()
    built = cpp_build.enabled() and varlen_attention._build() is not None
    multiple = varlen_attention._build().HEAD_DIM_MULTIPLE if built else 1
    assert varlen_attention.varlen_serves(q) == (built and dim % multiple == 0)
    if cpp_build.cpu_isa.tier() != cpp_build.cpu_isa.GENERIC:
        assert varlen_attention.varlen_serves(q), "every x86 tier's vectors divide 16"


def test_a_head_dim_the_vectors_do_not_divide_runs_torch():
    """D = 12 fits no tier's vectors: torch's SDPA per sequence serves, the same answer, into the given
    out."""
    torch.manual_seed(1)
    lengths = [5, 40]
    q, k, v = torch.randn(3, sum(lengths), 2, 12).unbind(0)
    assert not varlen_attention.varlen_serves(q)
    out = torch.full_like(q, float("nan"))
    varlen_attention.varlen_attention(q, k, v, lengths, 0.3, out)
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, 0.3), atol=2e-6, rtol=0)


def test_bad_shapes_are_named():
    """The kernel names what it refuses: float64, mixed dtypes, lengths that do not cover the tokens."""
    ext = varlen_attention._build()
    if ext is None:
        pytest.skip("no C++ toolchain")  # the torch path above still ran
    q = torch.randn(10, 2, 32)
    with pytest.raises(RuntimeError, match="float32, bf16 or fp16"):
        ext.varlen_attention_cpu(q.double(), q, q, q.clone(), torch.tensor([0, 10]), 1.0)
    with pytest.raises(RuntimeError, match="of one dtype"):
        ext.varlen_attention_cpu(q.bfloat16(), q, q, q.clone(), torch.tensor([0, 10]), 1.0)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        ext.varlen_attention_cpu(q, q, q, q.clone(), torch.tensor([0, 9]), 1.0)


def test_rotary_positions_are_applied_to_queries_and_keys():
    """cos, sin [T, D] per token (a vision tower's 2D positions) turn q and k as transformers does
    (x cos + rotate_half(x) sin) before the scores: the same answer as rotating first, on the kernel's path
    and torch's."""
    from sluice.kernels.elementwise import rotate_half

    torch.manual_seed(2)
    lengths, heads, dim = [7, 70, 1], 4, 32
    q, k, v = torch.randn(3, sum(lengths), heads, dim).unbind(0)
    angles = torch.rand(sum(lengths), dim // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    c, s = cos[:, None].double(), sin[:, None].double()
    turned = [t.double() * c + rotate_half(t.double()) * s for t in (q, k)]
    want = reference(*turned, v, lengths, dim**-0.5)
    got = varlen_attention.varlen_attention(q, k, v, lengths, dim**-0.5, rotary=(cos, sin))
    torch.testing.assert_close(got.double(), want, atol=4e-6, rtol=0)
    assert (reference(q, k, v, lengths, dim**-0.5) - want).abs().max() > 1e-2  # the rotation mattered
