"""bf16 decode tok/s at B rows past the GEMV's 16, the path before against the one in force here
(kernels.linear.gemv_serves), alternated in one process on the ~125M bench model.

With AMX: our GEMV past 16 rows (as before AMX hosts capped it) against oneDNN's AMX matmul. Where oneDNN has no
bf16 instructions and our AVX2 GEMM serves (`linear.gemm_rows`, the avx2 tier: SLUICE_CPU_ISA=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on any host): `widened_linear` (oneDNN's fp32 matmul on the weight
widened a slice at a time) against that GEMM.

Usage: python bench/gemv_row_limit.py --batch 32 64 --rounds 3"""

from __future__ import annotations

import argparse
import random
import time

from common import bench_model

from sluice import LLM, SamplingParams
from sluice.kernels import linear


def rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Generated tok/s over the batch (prompts already in the prefix cache: decode dominates)."""
    start = time.perf_counter()
    llm.generate(prompts, params, progress=False)
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm, rng = LLM(str(bench_model()), dtype="bfloat16"), random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    gemm = linear.gemm_rows() > 0
    name, in_force = ("gemm_rows", linear.gemm_rows) if gemm else ("onednn_amx", linear.onednn_amx)
    labels = ("widened_linear past 16 rows", "AVX2 GEMM") if gemm else ("GEMV past 16 rows", "limit in force")
    print(f"onednn_bf16={linear.onednn_bf16()} onednn_amx={linear.onednn_amx()} gemm_rows={linear.gemm_rows()}")
    for batch in args.batch:
        prompts = [[rng.randrange(4, 32000) for _ in range(128)] for _ in range(batch)]
        llm.generate(prompts, params, progress=False)
        for r in range(args.rounds):
            # the path before: widened_linear past 16 rows (gemm_rows 0), or our GEMV to 32 (64) rows (no AMX)
            setattr(linear, name, lambda gemm=gemm: 0 if gemm else False)
            before = rate(llm, prompts, params)
            setattr(linear, name, in_force)
            after = rate(llm, prompts, params)
            print(f"B={batch} round {r}: {labels[0]} {before:.0f} tok/s, {labels[1]} {after:.0f} tok/s, "
                  f"{after / before:.2f}x", flush=True)


if __name__ == "__main__":
    main()
