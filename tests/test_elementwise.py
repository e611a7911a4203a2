"""The fused CPU rope kernel rounds exactly like the torch ops (and HF) it replaces, SwiGLU is within a few
ulps of an fp64 reference; the argmax picks the index torch does."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import cpp_build, elementwise, options
from sluice.kernels.elementwise import apply_rope
from tests.tiers import tier_fixture

pytestmark = pytest.mark.skipif(elementwise._ext() is None, reason="C++ toolchain missing: torch path only")
cpu_tier = tier_fixture()  # every test on every tier the host runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 4, 64), (8, 8, 128), (6, 2, 32)])
def test_rope_qk_is_bitwise_the_torch_rotation(dtype, tokens, heads, kv_heads, dim):
    torch.manual_seed(tokens * dim)
    width = (heads + 2 * kv_heads) * dim
    projected = torch.randn(tokens, width + 3 * dim, dtype=dtype) * 4  # rows wider than qkv: strided rows
    qkv = projected[:, dim: dim + width].view(tokens, heads + 2 * kv_heads, dim)
    angles = torch.rand(tokens, 1, dim) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k = elementwise.rope_qk(qkv, cos, sin, heads, kv_heads)
    reference = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, reference[:, :heads]) and torch.equal(k, reference[:, heads:])


MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - want| in units in the last place of `dtype` at want's magnitude (fp64; subnormals at the
    smallest normal's spacing)."""
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(want.abs().clamp(min=tiny)))
    return (got.double() - want).abs() / torch.exp2(exponent - MANTISSA[dtype])


def swiglu_fp64(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp64, silu(gate) rounded to the activations' dtype first as the torch ops (and HF)
    do."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(gate_up.dtype).double()
    return silu * up


# fp32: the exp of a vectorized silu (torch's or ours) is within a few ulps, and the product adds one
# rounding; bf16/fp16: silu computed in fp32 then rounded, so at most one ulp from a tie broken the other way,
# per rounding.
SILU_ULPS = {torch.float32: 8.0, torch.float16: 2.0, torch.bfloat16: 2.0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 2048), (3, 37), (64, 2048), (5, 700)])
def test_silu_mul_is_within_ulps_of_the_fp64_swiglu(dtype, tokens, inter):
    """The fused SwiGLU against an fp64 reference (rounded where the torch ops round), within a few ulps of
    the activations' dtype, as torch's own ops are (never bitwise against torch: summation and exp differ by
    ISA)."""
    torch.manual_seed(inter)
    gate_up = torch.randn(tokens, 2 * inter + 16, dtype=dtype)[:, : 2 * inter] * 6  # strided rows
    want = swiglu_fp64(gate_up)
    got = elementwise.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (tokens, inter)
    assert ulps(got, want, dtype).max().item() <= SILU_ULPS[dtype]
    gate, up = gate_up.chunk(2, dim=-1)
    assert ulps(torch.nn.functional.silu(gate) * up, want,
                dtype).max().item() <= SILU_ULPS[dtype], "torch's too"


def test_kernels_off_takes_the_torch_path(monkeypatch, request):
    """SLUICE_CPU_KERNEL=0: the same results from torch ops (the reference the kernel is held to)."""
    qkv = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(3, 1, 16, dtype=torch.bfloat16), torch.randn(3, 1, 16, dtype=torch.bfloat16)
    fused = elementwise.rope_qk(qkv, cos, sin, 2, 1)
    monkeypatch.setenv("SLUICE_CPU_KERNEL", "0")
    options.reset()
    request.addfinalizer(options.reset)  # read again once the environment is restored
    assert not cpp_build.enabled()
    plain = elementwise.rope_qk(qkv, cos, sin, 2, 1)
    assert not plain[0].is_contiguous()  # views of the torch rotation, not the kernel's output
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_store_kv_writes_the_slots_index_copy_writes(dtype, tokens):
    """One C++ call stores k (contiguous) and v (a strided view of qkv, as the model passes it) exactly where
    the two index_copy_ of the torch path do, and nowhere else; a bad slot is refused, nothing written."""
    from sluice.kernels.attention import write_kv

    torch.manual_seed(tokens)
    hk, blocks, block, d = 2, 40, 16, 32
    qkv = torch.randn(tokens, 6 + 2 * hk, d).to(dtype)
    k, v = qkv[:, 6 : 6 + hk].contiguous(), qkv[:, 6 + hk :]
    slots = torch.randperm(blocks * block)[:tokens]
    ours = [torch.zeros(hk, blocks, block, d, dtype=dtype) for _ in range(2)]
    theirs = [torch.zeros(hk, blocks, block, d, dtype=dtype) for _ in range(2)]
    assert elementwise.store_kv(*ours, k, v, slots)
    theirs[0].view(hk, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    theirs[1].view(hk, -1, d).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    fresh = [torch.zeros_like(ours[0]) for _ in range(2)]
    write_kv(*fresh, k, v, slots)  # the engine's entry point takes the same path
    assert torch.equal(fresh[0], theirs[0]) and torch.equal(fresh[1], theirs[1])
    with pytest.raises(RuntimeError, match="slot out of range"):
        elementwise.store_kv(*fresh, k, v, torch.full_like(slots, blocks * block))
    assert not elementwise.store_kv(*fresh, k.to(torch.float16), v, slots)  # mixed dtypes: the torch path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 32000), (9, 151936), (3, 17), (2, 1)])
def test_argmax_is_torch_max_indices(dtype, rows, width):
    """Random rows, then the cases a wrong reduction gets wrong: ties (the first wins), the maximum in a
    masked tail, -inf rows, +-0, +inf and NaN (the first NaN wins, as torch.max propagates it)."""
    torch.manual_seed(width + rows)
    x = torch.randn(rows, width).to(dtype)
    assert torch.equal(elementwise._ext().argmax_rows(x), x.max(-1).indices)
    if width < 17:
        return
    nan, inf = float("nan"), float("inf")
    x = torch.randn(8, width).to(dtype)
    x[0, [3, width - 1]] = 50  # a tie: the first
    x[1, width - 1] = 50  # in the last (masked) vector
    x[2] = -inf
    x[3] = -1.0
    x[3, 5], x[3, 9] = -0.0, 0.0  # +0 and -0 compare equal: the first of the zeros
    x[4, [2, 7]] = inf
    x[5, [4, width - 2]] = nan  # NaN beats everything, the first one
    x[6, width - 1] = nan
    x[7, 0] = nan
    assert torch.equal(elementwise._ext().argmax_rows(x), x.max(-1).indices)
    assert torch.equal(elementwise.argmax(x[:, ::2]), x[:, ::2].max(-1).indices)  # strided: torch's path


def test_rope_tables_cast_once_give_the_rows_cast_per_step():
    """The rotary tables cast to the step's dtype once (`tables`) give the same rows as casting the gathered
    fp32 rows, for each dtype asked in turn, and are rebuilt when the fp32 tables are replaced
    (module.to())."""
    from sluice.engine.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 7, 511, 300, 7])
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        expected = rope.cos[positions].to(dtype)[:, None], rope.sin[positions].to(dtype)[:, None]
        assert all(torch.equal(a, b) for a, b in zip(rope.cos_sin(positions, dtype), expected, strict=True))
        cos, sin = rope.tables(dtype)
        assert cos.dtype == dtype and torch.equal(cos[positions][:, None], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(rope.cos_sin(positions, dtype), expected, strict=True))
    rope.cos, rope.sin = rope.cos * 2, rope.sin * 2
    assert torch.equal(rope.cos_sin(positions, torch.bfloat16)[0], rope.cos[positions].bfloat16()[:, None])
    assert torch.equal(rope.tables(torch.bfloat16)[0], rope.cos.bfloat16())
