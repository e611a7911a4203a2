"""The fused CPU paged-attention kernel against the torch reference, and the reference against plain SDPA; the
linears' and RMSNorm's kernels against fp32 references. Kernel tests run on every tier in
tests.tiers.TEST_TIERS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import (
    cpp_build,
    cpu_attention,
    cpu_isa,
    int4_weights,
    int8_linear,
    int8_weights,
    rms_norm,
)
from sluice.kernels import linear as linear_kernels
from sluice.kernels.attention import build_metadata, paged_attention
from tests.tiers import tier_fixture

H, HK, D, BS, NB = 6, 2, 16, 4, 200
cpu_tier = tier_fixture(autouse=False)


def layout(query_lens, context_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB, generator=g).tolist()
    tables, used = [], 0
    for c in context_lens:
        n = -(-c // BS)
        tables.append(perm[used:used + n])
        used += n
    slots = []
    for q, c, t in zip(query_lens, context_lens, tables, strict=True):
        slots += [t[p // BS] * BS + p % BS for p in range(c - q, c)]
    return tables, torch.tensor(slots)


def caches(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HK, NB, BS, D, generator=g).to(dtype),
            torch.randn(HK, NB, BS, D, generator=g).to(dtype))


def dense_reference(q, kc, vc, query_lens, context_lens, tables):
    """Plain causal SDPA per sequence over its keys laid out contiguously."""
    out, start = [], 0
    for ql, c, t in zip(query_lens, context_lens, tables, strict=True):
        pos = torch.arange(c)
        idx = torch.tensor(t)[pos // BS] * BS + pos % BS
        k = kc.view(HK, -1, D)[:, idx].repeat_interleave(H // HK, 0)
        v = vc.view(HK, -1, D)[:, idx].repeat_interleave(H // HK, 0)
        qs = q[start:start + ql].transpose(0, 1)
        mask = torch.arange(c)[None, :] <= torch.arange(c - ql, c)[:, None]
        out.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask).transpose(0, 1))
        start += ql
    return torch.cat(out)


QUERY_LENS = [1, 1, 3, 5, 1, 20, 17, 1]
CONTEXT_LENS = [1, 9, 12, 5, 40, 20, 33, 64]


def test_torch_reference_matches_dense_sdpa():
    kc, vc = caches(torch.float32)
    tables, slots = layout(QUERY_LENS, CONTEXT_LENS)
    q = torch.randn(sum(QUERY_LENS), H, D)
    k_new = kc.view(HK, -1, D)[:, slots].transpose(0, 1)
    v_new = vc.view(HK, -1, D)[:, slots].transpose(0, 1)
    meta = build_metadata(QUERY_LENS, CONTEXT_LENS, tables, slots, BS, torch.device("cpu"))
    got = paged_attention(q, k_new, v_new, kc, vc, meta, D**-0.5)
    want = dense_reference(q, kc, vc, QUERY_LENS, CONTEXT_LENS, tables)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.skipif(not cpu_attention.available(), reason="no C++ toolchain for the optional CPU kernel")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_cpu_kernel_matches_reference(dtype, tol, cpu_tier):
    kc, vc = caches(dtype)
    tables, slots = layout(QUERY_LENS, CONTEXT_LENS)
    q = torch.randn(sum(QUERY_LENS), H, D).to(dtype)
    k_new = kc.view(HK, -1, D)[:, slots].transpose(0, 1)
    v_new = vc.view(HK, -1, D)[:, slots].transpose(0, 1)
    dev = torch.device("cpu")
    plain = paged_attention(q, k_new, v_new, kc, vc,
                            build_metadata(QUERY_LENS, CONTEXT_LENS, tables, slots, BS, dev), D**-0.5)
    meta = build_metadata(QUERY_LENS, CONTEXT_LENS, tables, slots, BS, dev, fused=True)
    assert meta.fused_short is not None and not meta.short_groups
    fused = paged_attention(q, k_new, v_new, kc, vc, meta, D**-0.5)
    assert (fused.float() - plain.float()).abs().max().item() < tol


def int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor,
                   quantize_x: bool = False) -> torch.Tensor:
    """The int8 linear in float64: x times the dequantized weight (codes times row scales), plus bias; with
    `quantize_x`, x first rounded to int8 codes per row (scale: the row's absmax / 127), as the dynamic path
    does."""
    xd = x.double()
    if quantize_x:
        step = x.float().abs().amax(-1, keepdim=True) / 127
        xd = (x.float() / step).round().double() * step.double()
    return xd @ (qweight.double() * scales.double()[:, None]).T + bias.double()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int8_linear_matches_dequantized_weights_on_every_path(dtype, tol, monkeypatch, cpu_tier):
    """Every path of int8_linear against the float64 dequantized product, each row count on the path the tier
    implies: fp32 rows up to 4 on torch's GEMV (K % 16 == 0 only); bf16 rows on the dynamic int8 matmul from
    one row where our exact int8 product builds (AVX512-VNNI or AVX2 tiers), else one row on our GEMV. bf16
    bound per element: two bf16 roundings (2^-8 relative each: the product, then its sum with the bias) of the
    reference with x as the path sees it (its int8 codes on the dynamic path), plus fp32 sums."""
    gemv_rows, int_mm_rows = [], []
    real, real_dynamic = torch._weight_int8pack_mm, int8_weights.dynamic_int8_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm",
                        lambda x, w, s: gemv_rows.append(x.shape[0]) or real(x, w, s))
    monkeypatch.setattr(int8_weights, "dynamic_int8_mm",
                        lambda x, *a: int_mm_rows.append(x.shape[0]) or real_dynamic(x, *a))
    ours = int8_weights._gemv_kernel(torch.ones(1, dtype=torch.bfloat16))  # ours for bf16 rows where built
    if ours is not None:
        spy = type("Spy", (), {"int8_gemv": staticmethod(lambda x, w, s: gemv_rows.append(x.shape[0])
                                                           or ours.int8_gemv(x, w, s))})()
        monkeypatch.setattr(int8_weights, "_gemv_kernel",
                            lambda scales: spy if scales.dtype is torch.bfloat16 else None)
    ours = cpp_build.enabled() and cpu_isa.at_least("avx2")  # our exact int8 product: VNNI or AVX2 madd
    gemv = [1, 3] if dtype == torch.float32 else [] if ours else [1]  # the GEMV's row counts at K = 384
    torch.manual_seed(0)
    for k in (384, 100):  # 100: not a multiple of 16, which torch's GEMV mis-computes, so it must not be used
        qweight = torch.randint(-127, 128, (200, k), dtype=torch.int8)
        scales, bias = (torch.rand(200) / 50).to(dtype), torch.randn(200).to(dtype)
        for m in (1, 3, 5, 40):
            x = torch.randn(1, m, k).to(dtype)
            got = int8_linear(x, qweight, scales, bias)
            assert got.shape == (1, m, 200) and got.dtype == dtype
            want = int8_reference(x, qweight, scales, bias)
            assert ((got.double() - want).norm() / want.norm()).item() < tol
            if dtype is torch.bfloat16:
                seen = int8_reference(x, qweight, scales, bias, quantize_x=m not in gemv or k % 16 != 0)
                bound = (seen.abs() + bias.double().abs()) * 2**-7 + 1e-4
                assert ((got.double() - seen).abs() <= bound).all(), (k, m)
    assert (dtype == torch.float32
            or int8_weights.dynamic_from_one_row() == ours), "bf16 takes ours where it builds"
    assert gemv_rows == gemv, "the int8 GEMV serves few rows, and only when in_features % 16 == 0"
    dynamic = [] if dtype == torch.float32 else [m for k in (384, 100) for m in (1, 3, 5, 40)
                                                 if m not in gemv or k % 16]
    assert int_mm_rows == dynamic, "bf16 rows past the GEMV run the dynamic int8 matmul; fp32 stays exact"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_linear_matches_its_dequantized_weight(dtype, tol, cpu_tier):
    torch.manual_seed(0)
    weight, bias = torch.randn(90, 128), torch.randn(90).to(dtype)  # 90: padded to 96 rows for the CPU packer
    packed = int4_weights.pack(weight, dtype)
    deq = int4_weights.dequantize(packed, torch.float64)
    assert (deq - weight.double()).abs().max() <= 0.6 * (weight.max() - weight.min()) / 15, "round to nearest"
    q, _ = int4_weights.quantize_int4(weight)
    assert torch.equal(int4_weights.codes(packed), q), "packing keeps every code"
    for m in (1, 5, 40):
        x = torch.randn(2, m, 128).to(dtype)
        got = int4_weights.int4_linear(x, packed, bias)
        want = x.double() @ deq.T + bias.double()
        assert got.shape == (2, m, 90) and got.dtype == dtype
        assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_int4_shapes_the_kernel_cannot_pack_are_named():
    assert int4_weights.shape_error(96, 100) == "in_features 100 is not a multiple of the group size 32"
    assert int4_weights.shape_error(40, 64) is None, "odd out_features are padded"


@pytest.mark.skipif(not rms_norm.fused_available(), reason="no C++ toolchain for the optional CPU kernel")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("width", [96, 100])  # whole 32-lane vectors; and a scalar tail
def test_fused_add_rms_norm_matches_hf_rounding(dtype, tol, width, cpu_tier):
    torch.manual_seed(0)
    x, delta = torch.randn(37, width).to(dtype), torch.randn(37, width).to(dtype)
    weight = (torch.rand(width) + 0.5).to(dtype)
    total, out = rms_norm.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta), "the residual sum rounds like `x + delta`"
    want = rms_norm.rms_norm_reference(x + delta, weight, 1e-6)
    assert (out.dtype == dtype
            and (out.float() - want.float()).abs().max().item() < tol * want.abs().max().item())
    if dtype == torch.bfloat16:
        assert (out != want).float().mean().item() < 0.01, "a rare last-bit difference from the sum order"
    same, normed = rms_norm.add_rms_norm(x, None, weight, 1e-6)
    assert same is x and (normed.float() - rms_norm.rms_norm_reference(x, weight,
                                                                       1e-6).float()).abs().max() < tol


def gemv_tier() -> bool:
    """Whether the chosen tier has a bf16 GEMV kernel."""
    return cpu_isa.at_least("avx2")


def test_bf16_gemv_is_served_on_every_x86_tier(cpu_tier):
    """The GEMV builds and serves on every tier from avx2 up (a silent fallback would lose its speed-up), and
    reports the tier it was built for."""
    assert linear_kernels.gemv_available() == (gemv_tier() and cpp_build.enabled())
    if linear_kernels.gemv_available():
        assert linear_kernels._gemv().TIER == ("avx512_bf16" if cpu_isa.at_least("avx512_bf16") else "avx2")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 12, 13, 16, 31, 64])
@pytest.mark.parametrize(("n", "k"), [(96, 256), (77, 100), (130, 33), (16, 2048)])
def test_bf16_linear_matches_the_fp32_reference(rows, n, k, cpu_tier):
    """Every row count the GEMV takes, K with a masked tail, N off its 16-row tiles, bias or not, rows with a
    stride: within a bf16 rounding of the fp32 product, as close as F.linear (oneDNN) is."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    base = torch.randn(rows, k + 7, generator=g).to(torch.bfloat16)
    x = base[:, 3 : 3 + k]  # rows with stride k + 7
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    for bias in (None, torch.randn(n, generator=g).to(torch.bfloat16)):
        ref = x.float() @ w.float().t() + (0 if bias is None else bias.float())
        with torch.inference_mode():
            got = linear_kernels.linear(x, w, bias)
        theirs = F.linear(x, w, bias).float()
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        tol = ref.abs() * 2**-8 + 1e-3 * k**0.5  # rounding to bf16, plus fp32 sums in another order
        assert ((got.float() - ref).abs() <= tol).all()
        assert ((theirs - ref).abs() <= tol).all()


def panels_tier() -> bool:
    """Whether the chosen tier packs bf16 weights into panels: our extension built for AVX512-BF16, oneDNN
    without AMX tiles."""
    ext = linear_kernels._gemv()
    return ext is not None and ext.TIER == "avx512_bf16" and not linear_kernels.onednn_amx()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64, 65, 300])
@pytest.mark.parametrize(("n", "k"), [(130, 768), (77, 101), (64, 2), (1, 33)])
def test_bf16_panels_serve_every_row_count_within_a_rounding(rows, n, k, cpu_tier):
    """Where the tier packs bf16 weights into panels, `linear` runs every row count from them (csrc/
    bf16_panels.h): N off the 64-output panels, odd K, bias or not, rows with a stride, within a bf16 rounding
    of the fp64 product; each row the same bits whatever rows share its call. Elsewhere no weight is
    packed."""
    g = torch.Generator().manual_seed(rows * 13 + n + k)
    x = torch.randn(rows, k + 5, generator=g).bfloat16()[:, 2 : 2 + k]
    w, b = (torch.randn(n, k, generator=g) / k**0.5).bfloat16(), torch.randn(n, generator=g).bfloat16()
    assert linear_kernels.panels_serve() == panels_tier()
    with torch.inference_mode():
        got = [linear_kernels.linear(x, w, bias) for bias in (None, b)]
        first = linear_kernels.linear(x[:1], w, b)
    panels = linear_kernels.weight_panels(w)
    if not panels_tier():
        assert panels is None and getattr(w, "_sluice_panels", None) is None
        return
    assert panels.shape == (-(-n // 64), -(-k // 2), 64, 2)
    with torch.inference_mode():
        assert torch.equal(got[1], linear_kernels._gemv().panels_linear(x, panels, n, b))
    assert torch.equal(first, got[1][:1]), "a row's bits do not depend on the rows beside it"
    want = x.double() @ w.double().t()
    for out, bias in zip(got, (None, b), strict=True):
        full = want if bias is None else want + bias.double()
        assert ((out.double() - full).abs() <= full.abs() * 2**-8 + 1e-5 * k**0.5).all()


def test_panels_are_packed_once_remade_after_a_write_and_bounded(monkeypatch, cpu_tier):
    """A weight's panels are packed on its first product and kept; writing to the weight makes the next
    product pack it again (never a stale copy); past the copies' memory share, and with
    SLUICE_PACKED_WEIGHTS=0, weights stay unpacked and the GEMV / F.linear serve them as before."""
    from sluice.kernels import options

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 96, generator=g).bfloat16(), torch.randn(70, 96, generator=g).bfloat16()
    with torch.inference_mode():
        before = linear_kernels.linear(x, w)
    kept = linear_kernels.weight_panels(w)
    if not panels_tier():
        assert kept is None
        return
    assert kept is not None and linear_kernels.weight_panels(w) is kept
    with torch.no_grad():
        w.mul_(-2)
    with torch.inference_mode():
        after = linear_kernels.linear(x, w)
    assert linear_kernels.weight_panels(w) is not kept
    share = linear_kernels._panel_budget[0]
    del kept  # the stale copy freed: its bytes back in the share
    assert linear_kernels._panel_budget[0] == share + w.numel() * 2
    assert torch.equal(after, linear_kernels.linear(x, w.clone()))
    assert torch.equal(after.float(), -2 * before.float())
    monkeypatch.setattr(linear_kernels, "_panel_budget", [w.numel() * 2 - 1])  # one byte short of a copy
    fresh = w.clone()
    with torch.inference_mode():
        unpacked = linear_kernels.linear(x, fresh)
    assert linear_kernels.weight_panels(fresh) is None and fresh._sluice_panels == (fresh._version, None)
    assert ((unpacked.float() - after.float()).abs() <= after.float().abs() * 2**-7 + 1e-3).all()
    options.use(options.current().merged(packed_weights=False))
    try:
        assert not linear_kernels.panels_serve() and linear_kernels.weight_panels(w.clone()) is None
    finally:
        options.reset()


def test_panels_lie_in_huge_pages(cpu_tier):
    """Decode steps stream a weight's panels as they stream the weight arena: in huge pages (the 2 MiB pages
    the copy spans whole, collapsed as it is made) where Linux has them (6.1+, THP not off)."""
    from tests.test_weight_memory import _collapse_supported, _mapping

    w = torch.randn(1024, 4096).bfloat16()
    panels = linear_kernels.weight_panels(w)
    if panels is None:
        assert not panels_tier()
        return
    huge = linear_kernels.HUGE_PAGE
    first = -(-panels.data_ptr() // huge) * huge  # the first huge page inside: its own mapping once advised
    whole = (panels.data_ptr() + panels.numel() * panels.element_size()) // huge * huge - first
    if _collapse_supported():
        assert whole >= 2 * huge and _mapping(first)["AnonHugePages"] * 1024 >= whole


def test_model_linears_run_the_gemv_at_decode_rows(monkeypatch, cpu_tier):
    """A bf16 decode step's linears go through the GEMV: to 32 rows, and to 64 while the rows stay small (rows
    x in_features <= MAX_GEMV_X); F.linear above. Where oneDNN has no bf16 instructions, to MAX_GEMV_ROWS_FP32
    rows, then the avx2 tier's GEMM at every row count (elsewhere widened to fp32); where it has AMX tiles, to
    MAX_GEMV_ROWS_FP32 rows, its bf16 matmul above."""
    calls = []
    ext = linear_kernels._gemv()
    serves = gemv_tier() and cpp_build.enabled()  # a tier with a GEMV: it must have built and must serve
    assert (ext is not None) == serves, "the GEMV builds exactly where the tier has one"

    class Spy:
        def bf16_gemv(self, x, w, b):
            calls.append(x.shape[0])
            return ext.bf16_gemv(x, w, b)

        SUPPORTED = True
        GEMM_MAX_ROWS = 0 if ext is None else ext.GEMM_MAX_ROWS

    monkeypatch.setattr(linear_kernels, "_gemv", lambda: None if ext is None else Spy())
    linear_kernels.gemm_rows.cache_clear()
    linear_kernels.panels_serve.cache_clear()  # the spy has no panels: the GEMV's rows, as without them
    small = linear_kernels.Linear(64, 48, bias=True).to(torch.bfloat16)
    wide = linear_kernels.Linear(4096, 8, bias=False).to(torch.bfloat16)  # 33 x 4096 rows > MAX_GEMV_X
    with torch.inference_mode():
        for rows in (1, 16, 17, 32, 33, 64, 65, 300):
            small(torch.randn(rows, 64, dtype=torch.bfloat16))
        for rows in (32, 33):
            wide(torch.randn(rows, 4096, dtype=torch.bfloat16))
    wide_gemv = linear_kernels.onednn_bf16() and not linear_kernels.onednn_amx()
    gemm = linear_kernels.gemm_rows() == 64  # the avx2 tier without oneDNN bf16: our GEMM at any row count
    linear_kernels.gemm_rows.cache_clear()
    want = [1, 16, 17, 32, 33, 64, 32] if wide_gemv else [1, 16, 17, 32, 33, 64, 65, 300, 32, 33] if gemm \
        else [1, 16]
    assert calls == (want if serves else []), "GEMV at decode rows, F.linear above"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 64, 65, 131, 700])
def test_bf16_rows_past_the_fp32_gemv_limit_widen_where_onednn_has_no_bf16(monkeypatch, rows, cpu_tier):
    """With oneDNN capped below its bf16 instructions, our GEMV serves to MAX_GEMV_ROWS_FP32 rows (where it is
    as fast as oneDNN's fp32 matmul) and above that, at every row count (decode batches and prefill), its AVX2
    GEMM on the avx2 tier (`gemm_rows`; on avx512 oneDNN's fp32 matmul has AVX-512) and `widened_linear`
    elsewhere, each within a bf16 rounding of the fp64 product."""
    from sluice.kernels import options

    ext, calls = linear_kernels._gemv(), []
    if ext is not None:
        spy = type("Spy", (),
                   {"SUPPORTED": True, "GEMM_MAX_ROWS": ext.GEMM_MAX_ROWS, "bf16_gemv": staticmethod(
            lambda x, w, b: calls.append(x.shape[0]) or ext.bf16_gemv(x, w, b))})()
        monkeypatch.setattr(linear_kernels, "_gemv", lambda: spy)
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 200, generator=g).bfloat16(), (torch.randn(70, 200, generator=g) / 14).bfloat16()
    want = x.double() @ w.double().t()
    options.use(options.current().merged(onednn_max_cpu_isa="AVX2"))
    try:
        gemm = linear_kernels.gemm_rows()
        with torch.inference_mode():
            got = linear_kernels.linear(x, w)
    finally:
        options.reset()
    assert gemm == (64 if ext is not None and cpu_isa.tier() == "avx2" else 0)
    served = ext is not None and (rows <= linear_kernels.MAX_GEMV_ROWS_FP32 or gemm)
    assert calls == ([rows] if served else [])
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5 * 200**0.5).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 13, 16, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(130, 768), (65, 100), (7, 16), (64, 2048)])
def test_bf16_gemv_widened_x_tiles_give_the_narrow_tiles_bits(rows, n, k, cpu_tier):
    """The tier's widened-x tiles (the avx2 tier, from a few rows: x widened to fp32 once, 3 x rows against 2
    weight rows) sum every product in the narrow tiles' order: the same bits at every row count, N off the
    weight row pairs, K with a tail, bias or not; and within a bf16 rounding of the fp64 product."""
    ext = linear_kernels._gemv()
    if ext is None:
        pytest.skip("SLUICE_CPU_KERNEL=0 or no C++ compiler: no GEMV on this tier")
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k + 5, generator=g).bfloat16()[:, 2 : 2 + k]  # rows with a stride
    w, b = (torch.randn(n, k, generator=g) / k**0.5).bfloat16(), torch.randn(n, generator=g).bfloat16()
    try:
        with torch.inference_mode():
            if ext.GEMM_MAX_ROWS:  # the tiles at every row count, not the avx2 tier's GEMM
                ext.set_gemm_min_rows(1 << 40)
            ext.set_wide_min_rows(1)
            wide = [ext.bf16_gemv(x, w, bias) for bias in (None, b)]
            ext.set_wide_min_rows(1 << 40)
            narrow = [ext.bf16_gemv(x, w, bias) for bias in (None, b)]
    finally:
        ext.set_wide_min_rows(ext.WIDE_MIN_ROWS)
        if ext.GEMM_MAX_ROWS:
            ext.set_gemm_min_rows(ext.GEMM_MIN_ROWS)
    want = x.double() @ w.double().t()
    for got, ref, bias in zip(wide, narrow, (None, b), strict=True):
        assert torch.equal(got, ref)
        full = want if bias is None else want + bias.double()
        assert ((got.double() - full).abs() <= full.abs() * 2**-8 + 1e-5 * k**0.5).all()


@pytest.mark.parametrize("rows", [12, 13, 17, 18, 23, 32, 33, 63, 64])
@pytest.mark.parametrize(("n", "k"), [(130, 768), (77, 100), (16, 2048), (1, 33), (48, 16)])
def test_bf16_gemv_rows_past_16_match_the_fp64_product(rows, n, k, cpu_tier):
    """12 to 64 rows through the GEMV call (the avx2 tier's GEMM, csrc/bf16_gemm_avx2.h: panels of 16 weight
    rows packed per call, 6 x rows a tile; other tiers' tiles): odd row counts off the 6-row tiles, N off the
    16-column panels, K with and without a tail, bias or not, rows with a stride; within a bf16 rounding of
    the fp64 product, and the GEMM and the GEMV's tiles agree as closely."""
    ext = linear_kernels._gemv()
    if ext is None:
        pytest.skip("SLUICE_CPU_KERNEL=0 or no C++ compiler: no GEMV on this tier")
    assert ext.GEMM_MAX_ROWS == (64 if ext.TIER == "avx2" else 0)
    g = torch.Generator().manual_seed(rows * 11 + n + k)
    x = torch.randn(rows, k + 9, generator=g).bfloat16()[:, 4 : 4 + k]  # rows with a stride
    w, b = (torch.randn(n, k, generator=g) / k**0.5).bfloat16(), torch.randn(n, generator=g).bfloat16()
    try:
        with torch.inference_mode():
            gemm = [ext.bf16_gemv(x, w, bias) for bias in (None, b)]
            if ext.GEMM_MAX_ROWS:
                ext.set_gemm_min_rows(1 << 40)
            tiles = [ext.bf16_gemv(x, w, bias) for bias in (None, b)]
    finally:
        if ext.GEMM_MAX_ROWS:
            ext.set_gemm_min_rows(ext.GEMM_MIN_ROWS)
    want = x.double() @ w.double().t()
    for got, other, bias in zip(gemm, tiles, (None, b), strict=True):
        full = want if bias is None else want + bias.double()
        tol = full.abs() * 2**-8 + 1e-5 * k**0.5
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert ((got.double() - full).abs() <= tol).all()
        assert ((other.double() - full).abs() <= tol).all()
        assert ((got.double() - other.double()).abs() <= 2 * tol).all()


@pytest.mark.parametrize("source", sorted(p.name for p in cpp_build.CSRC.glob("*.cpp")))
def test_every_cpu_kernel_builds_where_a_compiler_exists(source, cpu_tier):
    """A kernel that fails to compile or link falls back to torch at run time (and its tests skip), so the
    build itself is checked: with a C++ compiler present, every csrc/ source must load: a library of its own,
    or a part of the core library (cpp_build.PARTS) with its functions bound."""
    import shutil

    if not cpp_build.enabled() or shutil.which(cpp_build.options.current().cxx) is None:
        pytest.skip("SLUICE_CPU_KERNEL=0 or no C++ compiler: the torch paths serve")
    if source in cpp_build.EXTENSIONS:
        assert cpp_build.load(cpp_build.EXTENSIONS[source],
                              source) is not None, f"csrc/{source} did not build (see the warning)"
        return
    name = source.removesuffix(".cpp")
    assert name in cpp_build.PARTS and source in cpp_build._sources(cpp_build.CORE), (
        f"csrc/{source} is neither a library in cpp_build.EXTENSIONS nor one of the core library's PARTS: "
        "add it")
    part = cpp_build.part(name)
    assert part is not None and any(not k.startswith("__") for k in vars(part)), f"{name}: no functions bound"



@pytest.mark.parametrize("source", sorted(cpp_build.EXTENSIONS))
def test_every_library_compiles_for_the_generic_tier(source):
    """A CPU with no tier of ours still gets the libraries (their kernels fall back where they have no code
    for it), so each compiles with the generic tier's flags: no SIMD-only name outside its tier's guard."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    cxx = cpp_build.options.current().cxx
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    run = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", *cpp_build.cflags(cpu_isa.GENERIC), *includes,
                          "-DTORCH_EXTENSION_NAME=generic_check", str(cpp_build.CSRC / source)],
                         capture_output=True, text=True)
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert run.returncode == 0, "\n".join(errors[:10])

MAPPED = """
import json, os
from sluice.engine import LLM, SamplingParams
llm = LLM({model!r}, dtype="bfloat16", device="cpu", quantization={quantization!r}, max_num_seqs=2)
out = llm.generate(["O Romeo, Romeo, wherefore art thou Romeo? " * 3, "a rose"],
                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False)
assert [len(o.token_ids) for o in out] == [4, 4]
maps = [line.split()[-1] for line in open("/proc/self/maps") if "/sluice_" in line]
print(json.dumps(sorted({{os.path.realpath(path) for path in maps}})))
"""


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_step_maps_one_kernel_library(quantization):
    """A bf16, LLM.int8() or NF4 engine's prefill and decode steps (attention, norms, GEMVs, the quantized
    products, the decode stack, the sampler) run from one shared object, the core library: none of its parts
    is built or mapped a second time as a library of its own."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if not cpp_build.enabled() or shutil.which(cpp_build.options.current().cxx) is None:
        pytest.skip("SLUICE_CPU_KERNEL=0 or no C++ compiler: the torch paths serve")
    model = str(Path(__file__).resolve().parent.parent / "models" / "sluice-tiny")
    code = MAPPED.format(model=model, quantization=quantization)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    mapped = json.loads(result.stdout.strip().splitlines()[-1])
    core = cpp_build.library_path(cpp_build.EXTENSIONS[cpp_build.CORE], cpp_build.CORE)
    assert mapped == [os.path.realpath(core)], mapped


def test_bf16_linear_keeps_leading_dimensions(cpu_tier):
    """[..., in] inputs come back [..., out], each row as its 2-D product."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got = linear_kernels.linear(x, w)
        flat = linear_kernels.linear(x.reshape(6, 64), w)
    assert got.shape == (2, 3, 40) and torch.equal(got.reshape(6, 40), flat)


def test_bf16_rows_past_the_gemv_sum_in_fp32_where_onednn_has_no_bf16(monkeypatch):
    """With oneDNN capped below its bf16 instructions (ONEDNN_MAX_CPU_ISA=AVX2), prefill rows of a bf16 linear
    run in fp32: the avx2 tier's GEMM (the tests above), elsewhere widened (a bounded slice of the weight at a
    time, `widened_linear`): within one bf16 rounding of the fp64 product whatever the slice, and F.linear is
    not called on bf16 there; with bf16 allowed, F.linear serves (the weight's panels where the tier packs
    weights: `linear.panels_serve`)."""
    from sluice.kernels import options

    torch.manual_seed(0)
    x, w, b = torch.randn(100, 96).bfloat16(), torch.randn(200, 96).bfloat16(), torch.randn(200).bfloat16()
    want = (x.double() @ w.double().t() + b.double())
    bf16_calls = []
    real = F.linear
    monkeypatch.setattr(linear_kernels.F, "linear",
                        lambda a, *r: bf16_calls.append(a.dtype) or real(a, *r))
    options.use(options.current().merged(onednn_max_cpu_isa="AVX2"))
    try:
        with torch.inference_mode():
            whole = linear_kernels.widened_linear(x, w, b)
            monkeypatch.setattr(linear_kernels, "WIDEN_ELEMENTS", 96 * 7)  # slices of 7 output rows
            sliced = linear_kernels.widened_linear(x, w, b)
            linear_kernels.linear(x, w, b)
        assert torch.bfloat16 not in bf16_calls and bf16_calls
        assert whole.dtype is torch.bfloat16 and sliced.dtype is torch.bfloat16
        # oneDNN's summation order may follow the slice's shape and the CPU's caches
        for got in (whole, sliced):
            assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    finally:
        options.reset()
    if linear_kernels.onednn_bf16():  # this host's oneDNN, as the environment caps it
        bf16_calls.clear()
        with torch.inference_mode():
            linear_kernels.linear(x, w, b)
        assert bf16_calls == ([] if linear_kernels.panels_serve() else [torch.bfloat16])


def test_fp32_linears_of_many_rows_take_onednn_where_mkl_has_no_avx512(monkeypatch):
    """oneDNN multiplies fp32 linears of ONEDNN_FP32_MIN_ROWS rows and more on an AVX-512 CPU that is not
    Intel's (MKL's AVX2 "zen" kernels there), never on Intel's or below AVX-512 or when ONEDNN_MAX_CPU_ISA
    caps it at AVX2; where it serves, `linear` and `residual_linear` give F.linear's answer without calling
    it, and fewer rows stay on F.linear."""
    from sluice.kernels import cpu_isa, options

    avx512 = cpu_isa.cpu_flags() | {"avx512f"}
    cases = [("AuthenticAMD", avx512, "", True), ("GenuineIntel", avx512, "", False),
             ("AuthenticAMD", avx512 - {"avx512f"}, "", False), ("AuthenticAMD", avx512, "AVX2", False)]
    try:
        for vendor, flags, cap, want in cases:
            monkeypatch.setattr(cpu_isa, "cpu_vendor", lambda v=vendor: v)
            monkeypatch.setattr(cpu_isa, "cpu_flags", lambda f=flags: f)
            options.use(options.current().merged(onednn_max_cpu_isa=cap))
            assert linear_kernels.onednn_fp32() == (want and torch.backends.mkldnn.is_available()), vendor
    finally:
        options.reset()
    if not torch.backends.mkldnn.is_available():
        return
    monkeypatch.setattr(linear_kernels, "onednn_fp32", lambda: True)
    calls, real = [], F.linear
    monkeypatch.setattr(linear_kernels.F, "linear", lambda a, *r: calls.append(len(a)) or real(a, *r))
    torch.manual_seed(0)
    w, b = torch.randn(200, 96), torch.randn(200)
    for rows in (linear_kernels.ONEDNN_FP32_MIN_ROWS - 1, linear_kernels.ONEDNN_FP32_MIN_ROWS, 300):
        x, res = torch.randn(rows, 96), torch.randn(rows, 200)
        want = x.double() @ w.double().t() + b.double()
        with torch.inference_mode():
            got = linear_kernels.linear(x, w, b)
            summed = linear_kernels.residual_linear(x, w, b, res, torch.empty(rows, 200))
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(summed.double(), want + res.double(), atol=1e-4, rtol=1e-5)
    assert calls == [linear_kernels.ONEDNN_FP32_MIN_ROWS - 1]
