"""Quantized CPU memory: the LLM.int8() product keeps no per-shape oneDNN state, and no float copy of a
weight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bitsandbytes  # noqa: F401  (defines the torch.ops.bitsandbytes ops)
import pytest
import torch

from sluice.engine.quantization.int8_cpu import llm_int8_linear
from sluice.kernels import int8_weights

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "sluice-tiny"


def test_int8_outlier_product_is_bitsandbytes_arithmetic():
    """Our LLM.int8() linear with outlier columns gives bitsandbytes' int8 product dequantized (its own op),
    plus the outlier inputs times their dequantized weight columns (its own op, rounded to bf16) summed in
    float32 and rounded once (where bitsandbytes' default kernel runs a bf16 `addmm`, one oneDNN primitive per
    shape), for several row, output and outlier counts: where our C++ pass serves (x86, AVX2 and up) the
    products summed in column order, bit for bit, else torch's float32 `addmm`."""
    ops = torch.ops.bitsandbytes
    ours = int8_weights._fused() is not None and int8_weights._fused().BNB_INT8_EPILOGUE
    g = torch.Generator().manual_seed(0)
    for out_features in (96, 100):
        cb, scb = ops.int8_vectorwise_quant.default((torch.randn(out_features, 64,
                                                                 generator=g) * 0.05).half())[:2]
        for rows, spikes in ((1, 2), (3, 1), (17, 5), (40, 0), (70, 12)):
            a = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
            a[:, :spikes] *= 40  # columns with an outlier
            ca, sca, cols = ops.int8_vectorwise_quant.default(a.clone().half(), 6.0)
            assert cols.numel() == spikes
            want = ops.int8_scaled_mm.default(ca, cb, sca, scb, bias=None, dtype=a.dtype)
            if spikes:
                sub_a = a[:, cols].float()
                sub_b = ops.int8_vectorwise_dequant.default(cb[:, cols].contiguous(), scb).to(a.dtype).float()
                if ours:
                    products = torch.zeros(rows, out_features)
                    for k in range(spikes):
                        products += sub_a[:, k, None] * sub_b[None, :, k]
                    want = (want.float() + products).to(a.dtype)
                else:
                    want = want.float().addmm_(sub_a, sub_b.t()).to(a.dtype)
            got = llm_int8_linear(a, cb, scb, None, 6.0)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (out_features, rows, spikes)


def test_int8_engine_makes_no_onednn_matmul_per_step_shape():
    """An int8 (LLM.int8(), outliers on) engine on CPU serving prompts of several lengths creates no oneDNN
    matmul primitive: each distinct step shape used to make one (milliseconds each) and keep it resident in
    oneDNN's primitive cache, hundreds of MiB after one batch of mixed lengths."""
    code = (
        "from sluice.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(TINY)!r}, dtype='bfloat16', device='cpu', quantization='int8', max_num_seqs=4)\n"
        "prompts = ['O Romeo, Romeo', 'wherefore art thou ' * 3, 'a rose by any other name ' * 5]\n"
        "out = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),"
        " progress=False)\n"
        "assert [len(o.token_ids) for o in out] == [3, 3, 3]\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    made = [line for line in result.stdout.splitlines() if ",primitive,exec," in line and ",matmul," in line]
    assert made == [], made[:3]


FLOAT_COPY_CHECK = """
import json, sys
import torch
from sluice.engine import LLM, SamplingParams
from sluice.engine.quantization.four_bit import Linear4bitCpu
from sluice.engine.quantization.int8_cpu import LLMInt8Linear

def anon():
    line = next(x for x in open("/proc/self/status") if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024

def tensors(obj):
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value

base = anon()
llm = LLM(sys.argv[1], dtype="bfloat16", device="cpu", max_model_len=96, max_num_seqs=2,
          quantization=sys.argv[2], kv_cache_memory_gb=0.05)
model, float_copies, linears = llm.engine.model, [], 0
held = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
for mod in model.modules():
    if isinstance(mod, (LLMInt8Linear, Linear4bitCpu)):
        linears += 1
        owned = [*tensors(mod), *mod.buffers(recurse=False), *mod.parameters(recurse=False)]
        if isinstance(mod, Linear4bitCpu):  # packed at load: bitsandbytes' state replaced by the bf16 absmax
            assert mod.state is None, "a 4-bit linear still holds bitsandbytes' state after the load"
            dense = mod.codes.numel() // 2  # a quarter of the weight's values: a bf16 copy is 4x the codes
        else:
            dense = mod.weight.numel() // 2
        float_copies += [tuple(t.shape) for t in owned if t.is_floating_point() and t.numel() >= dense]
        held |= {t.data_ptr(): t.numel() * t.element_size() for t in owned}
after_load = anon() - base
out = llm.generate(["O Romeo, Romeo"] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                   progress=False)
assert [len(o.token_ids) for o in out] == [4, 4]
print(json.dumps({"linears": linears, "float_copies": float_copies, "weights": sum(held.values()),
                  "load": after_load, "served": anon() - base}))
"""


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory) -> Path:
    """A bf16 llama whose linears hold ~20 M parameters: a float copy of them is tens of MiB."""
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("mid"), dtype=torch.bfloat16, hidden_size=512,
                           intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                           num_key_value_heads=4)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_load_keeps_no_float_copy_of_its_weights(mid_llama, mode):
    """After an int8 (LLM.int8()) or int4 (NF4) load, no quantized linear holds a floating-point tensor the
    size of its weight (its parameters and buffers: codes, scales, absmax), and the process's private memory
    grew by the model's own tensors and a few MiB (tokenizer, tables), after load and after serving a request:
    the full-precision weights the load read, and any transient float copy made while quantizing, are released
    (a float copy of the linears would add more than twice this slack)."""
    out = subprocess.run([sys.executable, "-c", FLOAT_COPY_CHECK, str(mid_llama), mode], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["linears"] == 6 * 7 and got["float_copies"] == [], got
    slack = 8 << 20
    assert got["load"] <= got["weights"] + slack and got["served"] <= got["weights"] + slack, got
