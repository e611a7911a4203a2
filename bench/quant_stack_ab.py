"""Quantized decode on the C++ decode stack against the same engine's Python layers, alternated in one process.

python bench/quant_stack_ab.py [--mode int8|int4] [--batches 1,4,16] [--rounds 4] [--tokens 24] [--threshold 6.0]

One engine of the mode (int8: LLM.int8(); int4: NF4; both bitsandbytes' format) on coldstart.py's pre-quantized
1 GB checkpoint (hidden 2048 x 12 layers); each round generates `--tokens` greedy tokens for B random 32-token prompts twice, once with the
decode stack and once with it refused (`decode_stack.step_fits` answering False: every step on the Python
layers), the order the same every round. A decode step's time is the run's time less a one-token run of the same
prompts (the prefill, served from the prefix cache after the first round), over the decode steps; the median of
the rounds is printed, with whether both ways gave the same tokens (they must: the stack runs the layers' C++
passes in their order).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from coldstart import checkpoint, prequantized

from sluice.engine import LLM, SamplingParams
from sluice.kernels import decode_stack


def step_ms(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """(ms per decode step, the tokens) of one greedy run of `tokens` tokens."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts, one, progress=False)  # the prompts' blocks cached, as in every timed run
    start = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), progress=False)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, one, progress=False)
    prefill = time.perf_counter() - start
    return (whole - prefill) / (tokens - 1) * 1000, [o.token_ids for o in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("int8", "int4"), default="int8")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threshold", type=float, default=6.0, help="int8's llm_int8_threshold (outlier columns)")
    args = p.parse_args()
    model = prequantized(checkpoint(2048, 12), args.mode)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(model), dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.5, max_num_seqs=max(batches),
              **(dict(llm_int8_threshold=args.threshold) if args.mode == "int8" else {}))
    vocab = llm.engine.model_config.vocab_size
    fits, refused = decode_stack.step_fits, (lambda *a: False)
    g = torch.Generator().manual_seed(0)
    print("| B | stack ms/step | Python layers ms/step | stack speed-up | same tokens |\n|---|---|---|---|---|")
    for b in batches:
        prompts = [torch.randint(4, vocab, (32,), generator=g).tolist() for _ in range(b)]
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[list[int]]] = {}
        for _ in range(args.rounds):
            for stacked in (True, False):
                decode_stack.step_fits = fits if stacked else refused
                ms, tokens[stacked] = step_ms(llm, prompts, args.tokens)
                times[stacked].append(ms)
        decode_stack.step_fits = fits
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {b} | {on:.2f} | {off:.2f} | {off / on:.2f}x | {tokens[True] == tokens[False]} |", flush=True)


if __name__ == "__main__":
    main()
