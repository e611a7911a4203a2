"""The C++ weight-only quantized kernels (int4: our int8 x int4 VNNI product and bf16 tiles, the tile dequant
+ matmul on torch's int4pack layout; fused int8 activation quantization and rescale) against the
  dequantized-weight
reference, their dispatch by row count, and the engine's greedy output with them against the torch paths they
replace."""

from __future__ import annotations

import pytest
import torch

import sluice.kernels.int4_weights as int4
import sluice.kernels.int8_weights as int8
from sluice.engine import LLM, SamplingParams
from sluice.kernels import cpu_isa
from tests.tiers import tier_fixture

ROWS = (1, 7, 8, 64, 65)
TILE_KERNEL = int4.cpu_layout() is not None
needs_kernel = pytest.mark.skipif(not TILE_KERNEL, reason="no C++ toolchain (or unknown int4pack layout)")
cpu_tier = tier_fixture(autouse=False)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@needs_kernel
def test_the_tile_kernel_reads_every_int4pack_code_including_a_tail_block():
    torch.manual_seed(0)
    weight = torch.randn(200, 96)  # 200 rows: padded to 208, three blocks of 64 and a tail of 16
    packed = int4.pack(weight, torch.bfloat16, "int4pack")
    q, _ = int4.quantize_int4(weight)
    codes = int4._tile_kernel().int4_codes(packed.packed, 96, 208, *int4.cpu_layout())[:200] + 8
    assert torch.equal(codes, q)


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_tiles_match_the_dequantized_weight(monkeypatch, dtype, tol, with_bias):
    monkeypatch.setattr(int4, "MAX_INT4PACK_ROWS", 0)  # every row count through the tiles
    monkeypatch.setattr(int4, "TILE_BYTES", 64 * 128 * 4)  # several tiles per thread, the last one short
    tiles, real = [], int4._tile_kernel().int4_tile_mm
    spy = type("Spy", (),
               {"int4_tile_mm": staticmethod(lambda x, *a: tiles.append(x.shape[0]) or real(x, *a))})
    monkeypatch.setattr(int4, "_tile_kernel", lambda: spy)
    torch.manual_seed(0)
    for out_features in (90, 200, 333):  # none a multiple of the tile or of the packer's 64-row block
        weight = torch.randn(out_features, 128)
        bias = torch.randn(out_features).to(dtype) if with_bias else None
        packed = int4.pack(weight, dtype, "int4pack")
        deq = int4.dequantize(packed, torch.float64)
        for m in ROWS:
            x = torch.randn(m, 128).to(dtype)
            got = int4.int4_linear(x, packed, bias)
            want = x.double() @ deq.T + (bias.double() if with_bias else 0)
            assert got.shape == (m, out_features) and got.dtype == dtype
            assert rel_err(got, want) < tol, (out_features, m)
    assert tiles == [m for _ in range(3) for m in ROWS], "the tile kernel served every call"


@needs_kernel
def test_int4_rows_past_the_threshold_take_the_tiles_and_agree_with_int4pack(monkeypatch):
    tiles, real = [], int4._tile_kernel().int4_tile_mm
    spy = type("Spy", (),
               {"int4_tile_mm": staticmethod(lambda x, *a: tiles.append(x.shape[0]) or real(x, *a))})
    monkeypatch.setattr(int4, "_tile_kernel", lambda: spy)
    torch.manual_seed(0)
    packed = int4.pack(torch.randn(256, 256), torch.bfloat16, "int4pack")
    limit = int4.MAX_INT4PACK_ROWS
    for m in (1, limit, limit + 1, 64):
        x = torch.randn(m, 256).bfloat16()
        got = int4.int4_linear(x, packed)
        pack_mm = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.packed, int4.GROUP,
                                                             packed.scales_zeros)
        assert rel_err(got, pack_mm.double()) < 1e-2
    assert tiles == [limit + 1, 64], "int4pack up to MAX_INT4PACK_ROWS rows, the tiles above"




def w4a8_reference(x: torch.Tensor, w: int4.Int4Weight) -> torch.Tensor:
    """What the int8 x int4 product stands for, in float64: x quantized per group of 32 (a = round(x / d),
    d = absmax / 127), sum_g s_g d_g sum (q - 8) a + z_g sum x."""
    m, k = x.shape
    xg = x.float().view(m, k // int4.GROUP, int4.GROUP)
    d = xg.abs().amax(-1) / 127
    a = torch.where(d[..., None] > 0, xg / d[..., None], torch.zeros_like(xg)).round().double()
    sz = int4.scales_zeros(w).double()  # [groups, out, 2]
    q = (int4.codes(w).double() - 8).view(w.out_features, k // int4.GROUP, int4.GROUP)
    dots = torch.einsum("mgk,ngk->mng", a, q) * d.double()[:, None, :]
    return (dots * sz[..., 0].t()).sum(-1) + xg.double().sum(-1) @ sz[..., 1]


@needs_kernel
def test_bf16_int4_weights_take_our_vnni_layout_and_keep_every_code(cpu_tier):
    """Every x86 tier has the int8 x int4 product (AVX512-VNNI or AVX2), so bf16 weights take its layout."""
    torch.manual_seed(0)
    assert int4.layout_for(torch.device("cpu"), torch.bfloat16) == "vnni"
    assert int4.layout_for(torch.device("cpu"), torch.float32) == "int4pack", "fp32 and fp16 stay on torch's"
    for n, k in ((90, 128), (37, 160), (8, 2048)):  # 160: padded to 256 columns
        weight = torch.randn(n, k)
        packed = int4.pack(weight, torch.bfloat16)
        assert packed.layout == "vnni" and packed.packed.shape == (n, -(-k // 128) * 64)
        assert torch.equal(int4.codes(packed), int4.quantize_int4(weight)[0])
        plain = int4.pack(weight, torch.bfloat16, "plain")
        assert torch.equal(int4.dequantize(packed, torch.float64), int4.dequantize(plain, torch.float64))


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_our_int8_x_int4_product_is_the_w4a8_sum_and_close_to_the_dequantized_weight(monkeypatch, with_bias,
                                                                                       cpu_tier):
    """On every tier, every tile shape (4 weight rows x 1-4 x rows, N tails), K tails (padded chunks, partial
    blocks of four chunks) and an all-zero group: the W4A8 kernel computes the W4A8 sum to fp32 rounding (then
    one bf16 rounding), within 1% of the unquantized activations' product; int4_linear runs it to
    MAX_VNNI_ROWS rows and the product requantized to int8 per row above (within 2%; a spy) where the tier has
    VNNI, at every row count without it (w4a8_avx2.h)."""
    torch.manual_seed(0)
    kernel, calls = int4.vnni_kernel(), []
    assert kernel is not None and kernel.VNNI == ("-mavx512vnni" in cpu_isa.compile_flags(cpu_tier))
    spy = type("Spy", (), {
        "VNNI": kernel.VNNI, "W4A8": True,
        "int4_vnni_mm": staticmethod(lambda x, *a: calls.append(("mm", x.shape[0]))
                                     or kernel.int4_vnni_mm(x, *a)),
        "int4_vnni_int8_mm": staticmethod(
            lambda x, *a: calls.append(("int8", x.shape[0])) or kernel.int4_vnni_int8_mm(x, *a))})
    monkeypatch.setattr(int4, "_tile_kernel", lambda: spy)
    limit, expected = int4.w4a8_max_rows(kernel), []
    for n, k in ((90, 128), (333, 96), (64, 768), (37, 160), (5, 2048), (6, 1536), (9, 640)):
        w = int4.pack(torch.randn(n, k), torch.bfloat16)
        bias = torch.randn(n).bfloat16() if with_bias else None
        b64 = bias.double() if with_bias else 0
        deq = int4.dequantize(w, torch.float64)
        for m in (1, 2, 3, 4, 5, 7, 16, 17, 40):
            x = torch.randn(m, k).bfloat16()
            x[0, :32] = 0  # a group of zeros: scale 0, nothing added
            got = int4.int4_linear(x, w, bias).double()
            assert rel_err(got, x.double() @ deq.T + b64) < (1e-2 if m <= limit else 2e-2), (n, k, m)
            if m <= limit:
                want = w4a8_reference(x, w) + b64
                assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-4).all(), (n, k, m)
            expected.append(("mm" if m <= limit else "int8", m))
    assert calls == expected


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_int8_quantize_and_rescale_are_bitwise_the_torch_ops(dtype):
    torch.manual_seed(0)
    fused = int8._fused()
    for m, k, n in ((1, 64, 48), (7, 768, 200), (65, 96, 333), (3, 40, 17), (2, 45, 9)):  # 8 / 16 lane tails
        x = (torch.randn(m, k) * 3).to(dtype)
        x[0] = 0  # an all-zero row: the 1e-12 floor on its scale
        q_want, s_want = int8.quantize_rows(x)
        q_got, s_got = fused.quantize_rows(x)
        assert torch.equal(q_got, q_want) and torch.equal(s_got, s_want)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales, bias = (torch.rand(n) / 50).to(dtype), torch.randn(n).to(dtype)
        acc = q_want.int() @ weight.int().T
        plain = acc.float().mul(s_want).mul(scales.float()).to(dtype)
        assert torch.equal(fused.int8_rescale(acc, s_want, scales, None), plain)
        assert torch.equal(fused.int8_rescale(acc, s_want, scales, bias), plain + bias)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int8_linear_matches_the_dequantized_weight_at_every_row_count(dtype, tol, with_bias):
    torch.manual_seed(0)
    for out_features in (200, 333):
        qweight = torch.randint(-127, 128, (out_features, 384), dtype=torch.int8)
        scales = (torch.rand(out_features) / 50).to(dtype)
        bias = torch.randn(out_features).to(dtype) if with_bias else None
        deq = qweight.double() * scales.double()[:, None]
        for m in ROWS:
            x = torch.randn(m, 384).to(dtype)
            got = int8.int8_linear(x, qweight, scales, bias)
            want = x.double() @ deq.T + (bias.double() if with_bias else 0)
            assert got.shape == (m, out_features) and got.dtype == dtype
            assert rel_err(got, want) < tol, (out_features, m)


@pytest.mark.skipif(int8._gemv_kernel(torch.ones(1, dtype=torch.bfloat16)) is None,
                    reason="no C++ toolchain (or not x86)")
def test_our_int8_gemv_serves_bf16_rows_and_rounds_as_torchs(monkeypatch, cpu_tier):
    """bf16 rows up to BF16_GEMV_ROWS run our int8 GEMV (a spy) where VNNI does not serve, within the error of
    torch's own GEMV against the float64 product at every row count and K tail (it sums in fp32, scales after,
    rounds once, as torch does)."""
    torch.manual_seed(0)
    monkeypatch.setattr(int8, "dynamic_from_one_row", lambda: False)
    ext, calls = int8._gemv_kernel(torch.ones(1, dtype=torch.bfloat16)), []
    monkeypatch.setattr(int8, "_gemv_kernel", lambda scales: type("Spy", (), {
        "int8_gemv": staticmethod(lambda *a: calls.append(a[0].shape[0]) or ext.int8_gemv(*a))})())
    for n, k in ((200, 384), (333, 768), (64, 16)):
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        scales = (torch.rand(n) / 50).to(torch.bfloat16)
        for m in range(1, int8.BF16_GEMV_ROWS + 1):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            want = (x.double() @ qweight.double().T) * scales.double()
            got, theirs = int8.int8_linear(x, qweight, scales), torch._weight_int8pack_mm(x, qweight, scales)
            err, their_err = (got.double() - want).abs().max(), (theirs.double() - want).abs().max()
            assert err <= their_err * 1.01 + 1e-3, (n, k, m)
    assert calls == list(range(1, int8.BF16_GEMV_ROWS + 1)) * 3
    for k in (40, 200):  # any K (torch's GEMV needs K % 16 == 0): exact to bf16 rounding
        qweight, scales = torch.randint(-128, 128, (50, k),
                                        dtype=torch.int8), torch.rand(50).to(torch.bfloat16)
        x = torch.randn(3, k, dtype=torch.bfloat16)
        want = (x.double() @ qweight.double().T) * scales.double()
        assert rel_err(ext.int8_gemv(x, qweight, scales), want) < 4e-3


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
def test_int8_mm_is_the_exact_int32_product_on_every_tier(cpu_tier):
    """int8 x int8 -> int32 through `int8_mm` equals the int32 reference on every tier, extreme codes
    included: VNNI where the tier has it, else ours (int8_mm_avx2.h), never oneDNN's saturating non-VNNI
    product; and the dynamic int8 linear built on it is within int8 rounding of the dequantized weight."""
    fused = int8._fused()
    assert fused.VNNI == ("-mavx512vnni" in cpu_isa.compile_flags(cpu_tier))
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 4, 5, 40, 65, 130):
        for n, k in ((1, 1), (5, 63), (37, 64), (203, 768), (9, 2048)):
            x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
            assert torch.equal(fused.int8_mm(x, w), x.int() @ w.int().T), (m, n, k)
    x, w = torch.full((3, 300), -128, dtype=torch.int8), torch.full((11, 300), 127, dtype=torch.int8)
    assert torch.equal(fused.int8_mm(x, w), torch.full((3, 11), -128 * 127 * 300, dtype=torch.int32))
    qweight, scales = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=g), torch.rand(96) / 50
    for m in (2, 8, 70):
        rows = torch.randn(m, 256, generator=g).to(torch.bfloat16)
        want = rows.double() @ (qweight.double() * scales.double()[:, None]).T
        assert rel_err(int8.int8_linear(rows, qweight, scales.to(torch.bfloat16)), want) < 2e-2, m


def test_the_torch_int8_path_is_exact_where_onednn_saturates(monkeypatch):
    """Without our kernels the dynamic int8 product is torch._int_mm only where oneDNN sums exactly (VNNI),
    else fp64: within int8 rounding of the dequantized weight on any host (ONEDNN_MAX_CPU_ISA=AVX2
    included)."""
    monkeypatch.setattr(int8, "_fused", lambda: None)
    g = torch.Generator().manual_seed(2)
    qweight, scales = torch.randint(-127, 128, (200, 384), dtype=torch.int8,
                                    generator=g), torch.rand(200) / 50
    rows = torch.randn(5, 384, generator=g).to(torch.bfloat16)
    want = rows.double() @ (qweight.double() * scales.double()[:, None]).T
    assert rel_err(int8.dynamic_int8_mm(rows, qweight, scales.to(torch.bfloat16)), want) < 2e-2
    xq = torch.randint(-128, 128, (7, 384), dtype=torch.int8, generator=g)
    if int8.int_mm_exact():
        assert torch.equal(torch._int_mm(xq, qweight.t()), xq.int() @ qweight.int().T)


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
def test_our_int8_matmul_is_exact_at_every_tile_and_serves_the_dynamic_rows(monkeypatch, cpu_tier):
    """int8 x int8 -> int32 by our kernel (VNNI where the tier has it, int8_mm_avx2.h without) equals the
    int32 product at every tile shape (1-8 weight rows x 1-4 x rows, N and K tails, extreme codes), and the
    dynamic int8 path runs it for bf16 rows from one row (VNNI) or past the GEMV's rows (without) to
    VNNI_MAX_ROWS and above."""
    torch.manual_seed(0)
    fused = int8._fused()
    ours = fused.int8_mm_vnni if fused.VNNI else fused.int8_mm
    for m in (1, 2, 3, 4, 5, 7, 9, 16, 33, 64):
        for n, k in ((1, 1), (5, 63), (37, 64), (64, 130), (203, 768), (9, 2048)):
            x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
            want = x.int() @ w.int().T
            assert torch.equal(ours(x, w), want), (m, n, k)
            assert torch.equal(fused.int8_mm(x, w), want), (m, n, k)
    x, w = torch.full((3, 300), -128, dtype=torch.int8), torch.full((11, 300), -128, dtype=torch.int8)
    assert torch.equal(ours(x, w), torch.full((3, 11), 128 * 128 * 300, dtype=torch.int32))
    _dynamic_rows_take_our_int8_mm(monkeypatch, fused)


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
def test_our_int8_matmul_is_exact_at_extreme_codes_and_tails(cpu_tier):
    """The VNNI product flips each weight's sign bit (w + 128 as the u8 operand) and subtracts 128 x each
    activation row's sum: exact against float64 sums and torch._int_mm's (where it is exact) with weights of
    only -128/-127/127 and activations of +-127/-128, K off multiples of 64 (the masked tail: a flipped
    masked-off weight lane, 0x80, meets a 0 activation lane), one row and many, N off every tile width."""
    fused = int8._fused()
    ours = fused.int8_mm_vnni if fused.VNNI else fused.int8_mm
    g = torch.Generator().manual_seed(3)
    extreme_w, extreme_x = torch.tensor([-128, -127, 127], dtype=torch.int8), torch.tensor([-128, -127, 127])
    for m in (1, 2, 3, 5, 17, 64):
        for n, k in ((1, 1), (3, 65), (13, 127), (31, 129), (45, 300), (67, 1000), (9, 2047)):
            w = extreme_w[torch.randint(0, 3, (n, k), generator=g)]
            x = extreme_x[torch.randint(0, 3, (m, k), generator=g)].to(torch.int8)
            want = (x.double() @ w.double().T).to(torch.int32)
            assert torch.equal(ours(x, w), want), (m, n, k)
            assert torch.equal(fused.int8_mm(x, w), want), (m, n, k)
            if int8.int_mm_exact():
                assert torch.equal(torch._int_mm(x, w.t()), want), (m, n, k)
    for value in (-128, 127):  # every activation lane at one end: the row sum's correction at its largest
        x = torch.full((5, 1000), value, dtype=torch.int8)
        w = torch.randint(-128, 128, (40, 1000), dtype=torch.int8, generator=g)
        assert torch.equal(ours(x, w), (x.double() @ w.double().T).to(torch.int32)), value


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
def test_int8_panels_give_the_exact_int32_product_and_serve_the_dynamic_rows(cpu_tier):
    """Where the tier packs int8 weights into panels (AVX512-VNNI without AMX; csrc/int8_panels.h: 64 outputs
    in K quads, sign bits flipped), the product from them is the exact int32 sum at every row count (tiles of
    4 x rows and their tails, blocks of rows), N off the panels, K off the quads, extreme codes; the dynamic
    int8 path takes them, bitwise the row-major product's outputs. Elsewhere no int8 weight is packed."""
    from sluice.kernels import linear

    fused = int8._fused()
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (70, 301), dtype=torch.int8, generator=g)
    assert int8.int8_panels_serve() == (bool(fused.INT8_PANELS) and not linear.onednn_amx())
    assert fused.INT8_PANELS == bool(fused.VNNI)
    if not int8.int8_panels_serve():
        assert int8.int8_panels(w) is None
        return
    extreme = torch.tensor([-128, -127, 127], dtype=torch.int8)
    for m in (1, 2, 3, 4, 5, 17, 64, 300):
        for n, k in ((1, 1), (3, 65), (64, 4), (67, 130), (9, 2047)):
            wk = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
            x = extreme[torch.randint(0, 3, (m, k), generator=g)]
            want = (x.double() @ wk.double().T).to(torch.int32)
            assert torch.equal(fused.int8_panels_mm(x, fused.pack_int8_panels(wk), n), want), (m, n, k)
    rows, scales = torch.randn(20, 301, generator=g).bfloat16(), torch.rand(70, generator=g).bfloat16()
    with torch.inference_mode():
        got = int8.dynamic_int8_mm(rows, w, scales)
    assert int8.int8_panels(w) is not None
    xq, row_scale = fused.quantize_rows(rows)
    assert torch.equal(got, fused.int8_rescale(fused.int8_mm(xq, w), row_scale, scales, None))


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
def test_our_int8_matmul_is_exact_across_tiles_blocks_and_threads(cpu_tier):
    """Our product's register tiles (x rows by weight rows, with row and column tails), its L2 blocks of
    weight rows (K large enough that N spans several) and its parallel runs sum exactly as float64 does, at
    the dynamic path's extremes (+-127) and int8's (-128), K off every multiple of 16 and 32, odd N."""
    fused = int8._fused()
    g = torch.Generator().manual_seed(4)
    values = torch.tensor([-128, -127, -1, 0, 1, 127], dtype=torch.int8)
    for m in (1, 3, 5, 17, 300):
        for n, k in ((1, 17), (67, 2047), (203, 771), (131, 4100)):
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            x[:, ::3] = values[torch.randint(0, 6, (m, (k + 2) // 3), generator=g)]
            w[:, 1::2] = values[torch.randint(0, 6, (n, k // 2), generator=g)]
            want = (x.double() @ w.double().T).to(torch.int32)
            assert torch.equal(fused.int8_mm(x, w), want), (m, n, k)
    for value in (-127, 127):  # every product at +-127 x +-127: each lane's sum at its largest
        x = torch.full((300, 4100), value, dtype=torch.int8)
        w = torch.full((7, 4100), -127, dtype=torch.int8)
        assert torch.equal(fused.int8_mm(x, w), torch.full((300, 7), -value * 127 * 4100, dtype=torch.int32))


def _dynamic_rows_take_our_int8_mm(monkeypatch, fused) -> None:
    calls, real = [], fused.int8_mm
    spy = type("Spy", (), {"quantize_rows": staticmethod(fused.quantize_rows),
                           "int8_rescale": staticmethod(fused.int8_rescale),
                           "int8_mm": staticmethod(lambda x, w: calls.append(x.shape[0]) or real(x, w)),
                           "VNNI": fused.VNNI})
    monkeypatch.setattr(int8, "_fused", lambda: spy)
    qweight, scales = torch.randint(-127, 128, (96, 256),
                                    dtype=torch.int8), (torch.rand(96) / 50).to(torch.bfloat16)
    first = int8.gemv_rows(torch.bfloat16) + 1
    assert first == (1 if fused.VNNI or cpu_isa.at_least("avx2") else int8.BF16_GEMV_ROWS + 1)
    for m in (first, 8, fused.VNNI_MAX_ROWS, fused.VNNI_MAX_ROWS + 1):
        rows = torch.randn(m, 256, dtype=torch.bfloat16)
        xq, row_scale = int8.quantize_rows(rows)
        want = ((xq.int() @ qweight.int().T).float() * row_scale * scales.float()).to(torch.bfloat16)
        assert torch.equal(int8.int8_linear(rows, qweight, scales, None), want), m
    assert calls == [first, 8, fused.VNNI_MAX_ROWS, fused.VNNI_MAX_ROWS + 1], "bf16 rows past the GEMV's"


DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
PROMPTS = [[1, *range(5, 5 + n)] for n in (6, 30, 70)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def greedy_tokens(path, method: str) -> list[list[int]]:
    llm = LLM(path, dtype="bfloat16", device="cpu", quantization=method)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, progress=False)]


@needs_kernel
def test_int8_weight_only_greedy_output_is_unchanged_by_the_fused_kernels(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama", **DIMS)
    fused = greedy_tokens(path, "int8_weight_only")
    monkeypatch.setattr(int8, "_fused", lambda: None)
    assert fused == greedy_tokens(path, "int8_weight_only")


# bf16 logits of the tiny model (all under 1 in magnitude) from the tiles and from int4pack: both dequantize
# the same int4 codes, summing in another order, so they may differ by a few bf16 ulps. A position agrees when
# both pick the same token or the tiles' pick is within TIE_MARGIN of int4pack's maximum (a near-tie).
INT4_LOGIT_DIFF = 4 * 2**-8
TIE_MARGIN = 2 * INT4_LOGIT_DIFF


def int4_scores(path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of `sequences` under int4_weight_only."""
    llm = LLM(path, dtype="bfloat16", device="cpu", quantization="int4_weight_only")
    return [t.float() for t in llm.score(sequences)]


@needs_kernel
def test_int4_weight_only_argmax_is_unchanged_by_the_tiles_teacher_forced(checkpoint_factory, monkeypatch):
    """Teacher-forced (issue 27: not free-running greedy, whose paths fork on near-ties): the prompts and the
    int4pack kernel's greedy continuations scored through the tiles (prefill and decode) and through int4pack
    alone; logits within INT4_LOGIT_DIFF and every position's argmax the same, near-ties within TIE_MARGIN."""
    path = checkpoint_factory("llama", **DIMS)
    # torch's layout, not our VNNI one
    monkeypatch.setattr(int4, "layout_for", lambda device, dtype: "int4pack")
    monkeypatch.setattr(int4, "MAX_INT4PACK_ROWS", 1 << 30)  # the int4pack kernel alone, as before the tiles
    sequences = [p + t for p, t in zip(PROMPTS, greedy_tokens(path, "int4_weight_only"), strict=True)]
    plain = int4_scores(path, sequences)
    monkeypatch.setattr(int4, "MAX_INT4PACK_ROWS", 0)  # prefill and decode through the tiles
    tiles = int4_scores(path, sequences)
    for ours, theirs in zip(tiles, plain, strict=True):
        assert ours.shape == theirs.shape and ours.shape[0] > 1
        assert theirs.abs().max() < 1 and (ours - theirs).abs().max() <= INT4_LOGIT_DIFF
        picked = theirs.gather(1, ours.argmax(1, keepdim=True)).squeeze(1)
        assert bool((picked >= theirs.max(1).values - TIE_MARGIN).all())


@pytest.mark.skipif(int8._fused() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_int8_quantization_while_loading_gives_bitsandbytes_own_bits(dtype, monkeypatch):
    """Our one-pass row quantization is bitsandbytes' int8_vectorwise_quant of the fp16 copy bit for bit
    (codes and row absmax): K with a tail, a zero row, a value past fp16's range (its row's codes 0), a row of
    tiny values, and ties that the fast-math compiler would round differently had the factor been folded; so
    is the torch fallback (no C++ kernels); the int8 linears built while loading on CPU use it."""
    import bitsandbytes as bnb

    from sluice.engine.quantization import linears
    from sluice.engine.quantization.spec import QuantSpec

    torch.manual_seed(0)
    for n, k in ((301, 77), (640, 2048), (33, 16)):
        w = (torch.randn(n, k) * 3).to(dtype)
        w[5 % n] = 0
        w[7 % n, 3] = 6e4 if dtype == torch.float16 else 7e4
        w[9 % n] *= 1e-6
        want_cb, want_scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16))
        for cb, scb in (int8.bnb_int8_rows(w), int8.bnb_int8_act(w, 0.0)[:2]):
            assert cb.dtype == torch.int8 and scb.dtype == torch.float32
            assert torch.equal(cb, want_cb) and torch.equal(scb, want_scb), (n, k, (cb != want_cb).sum())
    calls = []
    real = int8.bnb_int8_rows
    monkeypatch.setattr(int8, "bnb_int8_rows", lambda weight: calls.append(weight.shape) or real(weight))
    w = torch.randn(48, 64).to(torch.bfloat16)
    layer = linears.quantized_linear(QuantSpec("int8"), w, None, torch.bfloat16)
    want_cb, want_scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16))
    assert calls == [(48, 64)]
    assert torch.equal(layer.weight.data, want_cb) and torch.equal(layer.SCB, want_scb)
    monkeypatch.setattr(int8, "_fused", lambda: None)
    assert torch.equal(linears.quantized_linear(QuantSpec("int8"), w, None, torch.bfloat16).weight, want_cb)


def test_nf4_and_fp4_quantization_while_loading_gives_bitsandbytes_own_bits(monkeypatch):
    """Our one-pass CPU 4-bit quantization (four_bit.quantize_4bit, no bitsandbytes) gives F.quantize_4bit's
    own codes and serialized state (NF4 and FP4, double quantization or not, a zero block, a short last block,
    an odd count); an int4 model quantized while loading runs it and generates."""
    import bitsandbytes.functional as F

    from sluice.engine.quantization import four_bit

    torch.manual_seed(0)
    cases = []
    for shape in ((640, 2048), (33, 77), (7, 9), (3, 64)):
        w = (torch.randn(*shape) * 2).to(torch.bfloat16)
        w.view(-1)[:70] = 0
        cases += [(w, kind, double) for kind in ("nf4", "fp4") for double in (False, True)]

    def same(w, kind, double) -> bool:
        packed, state = F.quantize_4bit(w, blocksize=64, quant_type=kind, compress_statistics=double)
        ours, mine = four_bit.quantize_4bit(w, kind, double)
        x, y = state.as_dict(packed=True), mine.as_dict()
        return torch.equal(ours, packed) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    assert len(cases) == 16 and [same(*c) for c in cases] == [True] * 16
    calls, real = [], four_bit.quantize_4bit
    monkeypatch.setattr(four_bit, "quantize_4bit", lambda *a: calls.append(a[1]) or real(*a))
    from pathlib import Path

    llm = LLM(Path(__file__).resolve().parent.parent / "models/sluice-tiny", dtype="bfloat16", device="cpu",
              max_model_len=64, max_num_seqs=2, quantization="int4")
    out = llm.generate(["O Romeo"], SamplingParams(max_tokens=4, temperature=0), progress=False)
    assert calls and set(calls) == {"nf4"} and len(out[0].token_ids) == 4


def test_int8_prefill_rows_widen_the_dequantized_weight_where_onednn_has_no_bf16(monkeypatch):
    """With oneDNN capped below its bf16 instructions, bf16 int8 rows from `widen_min_rows` multiply the
    dequantized weight in fp32 (W8A16, no dynamic int8 product): within one bf16 rounding of fp64 x · (q ·
    scale) + bias, for any slice of the weight; one row fewer keeps the dynamic int8 product."""
    from sluice.kernels import linear as linear_kernels
    from sluice.kernels import options

    torch.manual_seed(0)
    qweight, scales = torch.randint(-127, 128, (70, 256), dtype=torch.int8), (torch.rand(70) / 50).bfloat16()
    limit = int8.widen_min_rows()
    bias, rows = torch.randn(70).bfloat16(), torch.randn(limit, 256).bfloat16()
    want = rows.double() @ (qweight.double() * scales.double()[:, None]).t() + bias.double()
    dynamic, real = [], int8.dynamic_int8_mm
    monkeypatch.setattr(int8, "dynamic_int8_mm", lambda x, *a: dynamic.append(x.shape[0]) or real(x, *a))
    options.use(options.current().merged(onednn_max_cpu_isa="AVX2"))
    try:
        with torch.inference_mode():
            got = int8.int8_linear(rows, qweight, scales, bias)
            monkeypatch.setattr(linear_kernels, "WIDEN_ELEMENTS", 256 * 3)
            sliced = int8.int8_linear(rows, qweight, scales, bias)
            int8.int8_linear(rows[1:], qweight, scales, bias)
    finally:
        options.reset()
    assert got.dtype is torch.bfloat16 and sliced.dtype is torch.bfloat16
    for out in (got, sliced):  # oneDNN's summation order may follow the slice's shape and the CPU's caches
        assert ((out.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert dynamic == [limit - 1]


@needs_kernel
def test_int4_prefill_rows_widen_the_dequantized_weight_where_onednn_has_no_bf16(monkeypatch, cpu_tier):
    """The vnni layout dequantizes to exactly int4.dequantize's fp32 (any slice of rows). oneDNN capped below
    bf16, without VNNI, bf16 rows from `int4.widen_min_rows` multiply that weight in fp32 (within one bf16
    rounding of fp64 x · w + bias, any slice); a row fewer keeps W4A8. With VNNI the int8 product serves."""
    from sluice.kernels import linear as linear_kernels
    from sluice.kernels import options

    torch.manual_seed(0)
    kernel, calls = int4.vnni_kernel(), []
    limit = int4.widen_min_rows(kernel)
    spy = type("Spy", (), {
        "VNNI": kernel.VNNI, "W4A8": True, "int4_vnni_dequant": staticmethod(kernel.int4_vnni_dequant),
        "int4_vnni_mm": staticmethod(lambda x, *a: calls.append(("mm", x.shape[0]))
                                     or kernel.int4_vnni_mm(x, *a)),
        "int4_vnni_int8_mm": staticmethod(
            lambda x, *a: calls.append(("int8", x.shape[0])) or kernel.int4_vnni_int8_mm(x, *a))})
    monkeypatch.setattr(int4, "_tile_kernel", lambda: spy)
    for n, k in ((70, 160), (37, 768)):  # a padded partial block; whole blocks then two chunks in group order
        w = int4.pack(torch.randn(n, k), torch.bfloat16)
        exact = int4.dequantize(w, torch.float32)
        assert torch.equal(kernel.int4_vnni_dequant(w.packed, w.scales_zeros, k, 0, n), exact)
        assert torch.equal(kernel.int4_vnni_dequant(w.packed, w.scales_zeros, k, 5, 12), exact[5:12])
        bias, rows = torch.randn(n).bfloat16(), torch.randn(limit, k).bfloat16()
        want = rows.double() @ int4.dequantize(w, torch.float64).t() + bias.double()
        options.use(options.current().merged(onednn_max_cpu_isa="AVX2"))
        try:
            with torch.inference_mode():
                got = int4.int4_linear(rows, w, bias)
                with monkeypatch.context() as m:
                    m.setattr(linear_kernels, "WIDEN_ELEMENTS", k * 3)  # slices of 3 output rows
                    sliced = int4.int4_linear(rows, w, bias)
                int4.int4_linear(rows[1:], w, bias)
        finally:
            options.reset()
        if not kernel.VNNI:
            assert got.dtype is torch.bfloat16 and sliced.dtype is torch.bfloat16
            for out in (got, sliced):  # oneDNN's summation order may follow the slice's shape
                assert ((out.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all(), (n, k)
    expected = [("int8", limit)] * 2 + [("int8", limit - 1)] if kernel.VNNI else [("mm", limit - 1)]
    assert calls == expected * 2


def test_llm_int8_epilogue_passes_are_bitsandbytes_arithmetic_on_every_tier(cpu_tier):
    """LLM.int8()'s bf16 epilogue in C++ on every x86 tier (16 lanes on AVX512-VNNI, 8 on AVX2): the dequant
    is bitsandbytes' own int8_mm_dequant op bit for bit, and the outlier pass gives the outlier columns'
    products summed in fp32 in column order, added to the output and rounded once; at N tails of both widths,
    row counts past and within the passes' blocks of rows, up to every column an outlier, with and without
    bias; on the generic tier neither is built (the torch ops serve)."""
    import bitsandbytes  # noqa: F401  (its ops)

    fused = int8._fused()
    if fused is None or cpu_tier == cpu_isa.GENERIC:
        assert fused is None or not fused.BNB_INT8_EPILOGUE
        return
    assert fused.BNB_INT8_EPILOGUE
    g = torch.Generator().manual_seed(0)
    for m, k, n, spikes in ((1, 64, 48, 1), (3, 40, 17, 2), (16, 96, 333, 5), (65, 64, 100, 0),
                            (9, 64, 40, 64),
                            (20, 128, 24, 100)):  # blocks of 8 rows and a rest; every column an outlier
        acc = torch.randint(-(2**20), 2**20, (m, n), generator=g, dtype=torch.int32)
        row, col = torch.rand(m, generator=g) * 8, torch.rand(n, generator=g) * 0.2
        for bias in (None, torch.randn(n, generator=g).to(torch.bfloat16)):
            want = torch.ops.bitsandbytes.int8_mm_dequant.default(acc, row, col, dtype=torch.bfloat16,
                                                                  bias=bias)
            assert torch.equal(fused.bnb_int8_dequant(acc, row, col, bias), want), (m, n, bias is None)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        cb = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        cols = torch.randperm(k, generator=g)[:spikes].sort().values
        out = torch.randn(m, n, generator=g).to(torch.bfloat16)
        sub_b = (cb[:, cols].float() * col.view(-1, 1) * 7.874015718698502e-3).to(torch.bfloat16).float()
        products = torch.zeros(m, n)
        for j in range(spikes):
            products += x[:, cols[j], None].float() * sub_b[None, :, j]
        got = out.clone()
        assert fused.bnb_int8_outliers(got, x, cols, cb, col)
        assert torch.equal(got, (out.float() + products).to(torch.bfloat16)), (m, n, spikes)
