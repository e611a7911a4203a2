"""Quantized CPU memory: bitsandbytes' int8 product keeps no per-shape oneDNN state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import bitsandbytes  # noqa: F401  (defines the torch.ops.bitsandbytes ops)
import torch

from sluice.engine.quantization.int8_cpu import serve_int8_on_cpu

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "sluice-tiny"


def test_int8_outlier_product_is_bitsandbytes_arithmetic():
    """The CPU kernel gives what bitsandbytes' default kernel computes (the int8 product dequantized, plus
    `addmm` of the outlier columns by their dequantized weight columns in bf16), for several row and outlier
    counts, none included; the outlier inputs come back as bitsandbytes returns them."""
    assert serve_int8_on_cpu()
    ops = torch.ops.bitsandbytes
    g = torch.Generator().manual_seed(0)
    CB, SCB = ops.int8_vectorwise_quant.default((torch.randn(96, 64, generator=g) * 0.05).half())[:2]
    for rows, spikes in ((3, 1), (17, 5), (40, 0), (70, 12)):
        A = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        A[:, :spikes] *= 40  # columns with an outlier
        CA, SCA, cols = ops.int8_vectorwise_quant.default(A.clone().half(), 6.0)
        assert cols.numel() == spikes
        out, subA = ops.int8_mixed_scaled_mm.default(A, CA, CB, SCA, SCB, cols, None)
        theirs = ops.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=None, dtype=A.dtype)
        if spikes:
            sub_b = ops.int8_vectorwise_dequant.default(CB[:, cols].contiguous(), SCB).to(A.dtype)
            theirs = theirs.addmm(A[:, cols].contiguous(), sub_b.t())
            assert torch.equal(subA, A[:, cols])
        assert out.dtype == torch.bfloat16 and torch.equal(out, theirs)


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
