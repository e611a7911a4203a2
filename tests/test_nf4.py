"""bitsandbytes' 4-bit format on CPU without bitsandbytes: our parser and quantizer against bitsandbytes
itself (the oracle, imported here only), our kernels (kernels/nf4.py, every tier the host runs) against an
fp64 product of the weight a plain-torch reading of bitsandbytes' format gives, and a CPU int4 engine that
never imports it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

from sluice.engine.quantization import four_bit
from sluice.kernels import nf4
from tests.tiers import tier_fixture

KINDS = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
BF16_EPS = 2.0**-7  # bf16's machine epsilon: a rounding to nearest errs by at most half of it, relatively


def bnb_state(w: torch.Tensor, quant_type: str, nested: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """bitsandbytes' packed codes and serialized state (as a checkpoint holds them) of a weight."""
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type=quant_type)
    return packed, {k: v.clone() for k, v in state.as_dict(packed=True).items()}


def reference_weight(packed: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] in fp64, read from bitsandbytes' serialized format with plain torch ops: codes two
    a byte (high nibble first), quant_map[code] * absmax per block of `blocksize`, the absmax itself
    nested_quant_map [code] * nested_absmax per nested block, plus the offset, when nested."""
    meta = json.loads(bytes(next(v for k, v in stats.items() if k.startswith("quant_state")).tolist()))
    out_f, in_f = meta["shape"]
    absmax = stats["absmax"].double()
    if "nested_absmax" in stats:
        nb = meta["nested_blocksize"]
        codes = stats["nested_quant_map"].double()[stats["absmax"].long()]
        scale = stats["nested_absmax"].double().repeat_interleave(nb)[: codes.numel()]
        absmax = (codes * scale).float().double() + torch.tensor(meta["nested_offset"],
                                                                 dtype=torch.float32).double()
    b = packed.view(torch.uint8).reshape(-1)
    idx = torch.stack((b >> 4, b & 15), -1).reshape(-1).long()
    values = stats["quant_map"].double()[idx] * absmax.repeat_interleave(meta["blocksize"])
    return values.view(out_f, in_f)


def weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    w = (torch.randn(out_f, in_f,
                     generator=torch.Generator().manual_seed(seed)) / in_f**0.5).to(torch.bfloat16)
    w[0, :64] = 0  # a block of zeros
    return w


@pytest.mark.parametrize(("quant_type", "nested"), KINDS)
def test_the_plain_reference_reads_bitsandbytes_format_as_bitsandbytes_does(quant_type, nested):
    w = weight(96, 320)
    packed, stats = bnb_state(w, quant_type, nested)
    _, state = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type=quant_type)
    state.dtype = torch.float32  # bitsandbytes' fp32 values, not rounded to the weight's dtype
    theirs = F.dequantize_4bit(packed, state).double()
    assert ((reference_weight(packed, stats) - theirs).abs() <= theirs.abs() * 2**-22).all()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_code_tables_are_bitsandbytes_computed_without_torch_kernels(quant_type):
    """The 16 levels, the sort order and the 15 quantize bounds, computed in Python, are bit for bit what
    bitsandbytes' get_4bit_type and torch's argsort and fp32 midpoints give (FP4's two zeros in argsort's
    order)."""
    code = four_bit.code_table(quant_type)
    theirs = F.get_4bit_type(quant_type, device="cpu")
    assert code.dtype == torch.float32 and torch.equal(code, theirs)
    assert torch.equal(code.view(torch.int32), theirs.view(torch.int32))  # FP4's zeros: both +0, as theirs
    bounds, order = four_bit._bounds(quant_type)
    assert torch.equal(order, torch.argsort(theirs))
    assert torch.equal(bounds, (theirs[order[:-1]] + theirs[order[1:]]) / 2)


@pytest.mark.parametrize(("quant_type", "nested"), KINDS)
@pytest.mark.parametrize("shape", [(96, 320), (33, 64), (5, 64 * 3 + 17)])
def test_our_quantizer_gives_bitsandbytes_bits_and_state(quant_type, nested, shape):
    """`four_bit.quantize_4bit` (C++ blocks pass, our blockwise 8-bit absmax) against bitsandbytes'
    quantize_4bit: the same packed bytes and serialized state, a zero block and a short last block (odd
    element count) included; the state parses back and writes out unchanged."""
    w = weight(*shape)
    packed, stats = bnb_state(w, quant_type, nested)
    ours, state = four_bit.quantize_4bit(w, quant_type, nested)
    assert torch.equal(ours, packed)
    mine = state.as_dict()
    assert mine.keys() == stats.keys()
    for key, value in stats.items():
        assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), key
    again = four_bit.State4bit.from_dict(stats).as_dict()
    assert all(torch.equal(again[k], stats[k]) for k in stats)


def test_the_torch_fallback_quantizes_as_the_kernel(monkeypatch):
    """Without the C++ kernels (`int4_weights.bnb_4bit_kernel` None) the torch ops give the same bits."""
    w = weight(40, 64 * 5 + 3)
    want = four_bit.quantize_4bit(w, "fp4", True)
    monkeypatch.setattr(four_bit.int4_weights, "bnb_4bit_kernel", lambda: None)
    got = four_bit.quantize_4bit(w, "fp4", True)
    got_state, want_state = got[1].as_dict(), want[1].as_dict()
    assert torch.equal(got[0], want[0]) and all(torch.equal(got_state[k], v) for k, v in want_state.items())


cpu_tier = tier_fixture(autouse=False)


def packed_linear(out_f: int, in_f: int, quant_type: str, nested: bool, bias: bool, seed: int = 0):
    """Our linear over bitsandbytes' serialized weight, packed for the kernels, and the fp64 reference
    weight."""
    w = weight(out_f, in_f, seed)
    packed, stats = bnb_state(w, quant_type, nested)
    b = torch.randn(out_f,
                    generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16) if bias else None
    mod = four_bit.Linear4bitCpu(packed, four_bit.State4bit.from_dict(copy.deepcopy(stats)), b,
                                 torch.bfloat16)
    assert mod.pack()
    return mod, reference_weight(packed, stats), b


@pytest.mark.parametrize(("quant_type", "nested"), KINDS)
def test_the_bf16_absmax_errs_by_at_most_half_a_bf16_step(quant_type, nested, cpu_tier):
    """The kernels' weight, table[code] * bf16(absmax) in fp32, against the fp64 reference: every weight
    within half a bf16 step (the absmax's rounding) plus one fp32 rounding, relatively: the accuracy bound of
    keeping the absmax in bf16 (what bitsandbytes' own CPU kernel does per call)."""
    mod, ref, _ = packed_linear(70, 256, quant_type, nested, bias=False)
    got = nf4.dequantize(mod.codes, mod.absmax, mod.table, torch.float32).double()
    assert ((got - ref).abs() <= ref.abs() * (BF16_EPS / 2 + 2**-23)).all()
    ext = nf4.kernel()
    if ext is not None:  # the tiles' dequantization: the same fp32 values, rounded once to bf16
        tiles = ext.nf4_dequant(mod.codes, mod.absmax, mod.table, 0, 70, torch.float32)
        assert torch.equal(tiles, got.float())
        bf16 = ext.nf4_dequant(mod.codes, mod.absmax, mod.table, 3, 70, torch.bfloat16)
        assert torch.equal(bf16, got.float()[3:].to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize(("out_f", "in_f"), [(70, 256), (1, 64), (33, 192), (8, 1024)])
@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", False)])
def test_the_kernels_match_the_fp64_product_on_every_tier(rows, out_f, in_f, quant_type, nested, cpu_tier):
    """x times our linear (the tier's GEMV; the torch fallback where no kernel builds) against x times the
    fp64 reference weight: per output row within the absmax's bf16 rounding plus the output's (bf16 x) or fp32
    sums (fp32 x) plus, in the tiles, the weights' bf16 rounding."""
    mod, ref, b = packed_linear(out_f, in_f, quant_type, nested, bias=rows % 2 == 1, seed=rows)
    g = torch.Generator().manual_seed(rows * 31 + out_f)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, in_f, generator=g).to(dtype)
        with torch.inference_mode():
            got = mod(x.view(rows, 1, in_f)).view(rows, out_f)
        assert got.dtype == dtype
        want = x.double() @ ref.t() + (0 if b is None else b.double())
        # |terms|: the error scale
        scale = x.double().abs() @ ref.abs().t() + (0 if b is None else b.double().abs())
        tiles = nf4.kernel() is None  # the fallback multiplies the dequantized weight in x's dtype
        steps = 1 + (dtype is torch.bfloat16 or tiles) + (tiles and dtype is torch.bfloat16)
        bound = scale * (steps * BF16_EPS / 2 + in_f * 2**-24) + want.abs() * BF16_EPS / 2
        assert ((got.double() - want).abs() <= bound).all(), (dtype, (got.double() - want).abs().max())


@pytest.mark.parametrize("rows", [1, 40])
def test_the_tiles_give_the_product_of_the_rounded_weight(rows, cpu_tier):
    """`nf4_tile_mm` (kernels/nf4.py's path from TILE_MIN_ROWS): x times the weight dequantized and rounded to
    bf16 (its tiles), plus bias, as at::mm multiplies them; weight rows off the tile size."""
    ext = nf4.kernel()
    mod, _, b = packed_linear(70, 256, "fp4", True, bias=True)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    if ext is None:
        return  # no C++ kernels here: nothing but the torch fallback serves (tested above)
    got = ext.nf4_tile_mm(x, mod.codes, mod.absmax, mod.table, b, 256 * 2 * 16)  # tiles of 16 rows
    w = ext.nf4_dequant(mod.codes, mod.absmax, mod.table, 0, 70, torch.bfloat16)
    assert torch.equal(got, torch.mm(x, w.t()) + b)


def test_our_linear_and_bitsandbytes_linear4bit_are_equally_close_to_the_fp64_product():
    """bitsandbytes' Linear4bit (its CPU kernel) and ours on the same serialized weight: both within the same
    bound of the fp64 product at decode and prefill rows (neither is the other's reference)."""
    w = weight(256, 512)
    packed, stats = bnb_state(w, "nf4", True)
    _, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    theirs = bnb.nn.Linear4bit(512, 256, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                               quant_type="nf4", device="meta")
    theirs.weight = bnb.nn.Params4bit(packed.clone(), requires_grad=False, quant_state=state, blocksize=64,
                                      compress_statistics=True, quant_type="nf4", module=theirs,
                                      bnb_quantized=True)
    theirs.quant_state = state
    ours = four_bit.Linear4bitCpu(packed.clone(), four_bit.State4bit.from_dict(stats), None, torch.bfloat16)
    ref = reference_weight(packed, stats)
    for rows in (1, 31):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.double() @ ref.t()
        with torch.inference_mode():
            errs = [((m.eval()(x).double() - want).norm() / want.norm()).item() for m in (theirs, ours)]
        assert max(errs) < 2 * BF16_EPS and errs[1] < 1.5 * errs[0] + BF16_EPS / 4, errs


# An int4 engine generating on CPU in a fresh process, then whether bitsandbytes was imported.
FRESH = """
import sys
from sluice.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", device="cpu",
          **({"quantization": "int4"} if sys.argv[2] == "load" else {}))
out = llm.generate([[1, 5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                   progress=False)
print("TOKENS", len(out[0].token_ids), "BNB", "bitsandbytes" in sys.modules)
"""


def test_a_cpu_int4_engine_never_imports_bitsandbytes(checkpoint_factory, tmp_path):
    """Pre-quantized (a bitsandbytes-format int4 checkpoint) and quantized while loading: each generates in a
    fresh process without bitsandbytes in sys.modules."""
    from sluice.cli.quantize import quantize

    ckpt = checkpoint_factory("llama", hidden_size=128, intermediate_size=256, num_attention_heads=2,
                              num_key_value_heads=1)
    quantize(ckpt, tmp_path / "int4", "int4", "nf4", True, dtype="bfloat16")
    for path, mode in ((tmp_path / "int4", "prequantized"), (ckpt, "load")):
        run = subprocess.run([sys.executable, "-c", FRESH, str(path), mode], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "TOKENS 4 BNB False" in run.stdout, (mode, run.stdout[-2000:])
