"""bf16 decode tok/s at B rows with our GEMV past 16 rows (as before AMX hosts capped it) against the row limit
in force here (kernels.linear.gemv_serves), alternated in one process on the ~125M bench model.

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
    in_force = linear.onednn_amx
    print(f"onednn_bf16={linear.onednn_bf16()} onednn_amx={linear.onednn_amx()}")
    for batch in args.batch:
        prompts = [[rng.randrange(4, 32000) for _ in range(128)] for _ in range(batch)]
        llm.generate(prompts, params, progress=False)
        for r in range(args.rounds):
            linear.onednn_amx = lambda: False  # noqa: E731 - the limit before: our GEMV to 32 (64) rows
            before = rate(llm, prompts, params)
            linear.onednn_amx = in_force
            after = rate(llm, prompts, params)
            print(f"B={batch} round {r}: GEMV past 16 rows {before:.0f} tok/s, limit in force {after:.0f} tok/s, "
                  f"{after / before:.2f}x", flush=True)


if __name__ == "__main__":
    main()
