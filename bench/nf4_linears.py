"""One 4-bit linear, ours (kernels/nf4.py) vs bitsandbytes' Linear4bit (packed for its CPU kernel at its first
forward), the same NF4 weight and bf16 activations, alternated in one process; best of the rounds,
microseconds.

OMP_NUM_THREADS=1 python bench/nf4_linears.py [--rounds 15]
"""

from __future__ import annotations

import copy
import time

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
from common import BenchParser, add_baseline

from sluice.engine.quantization import four_bit

SHAPES = [(768, 768), (2048, 768), (768, 2048), (2048, 2048), (5632, 2048), (2048, 5632)]  # (out, in)
ROWS = [1, 8, 32, 64]


def linears(out_f: int, in_f: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """bitsandbytes' Linear4bit and ours over one random NF4 weight."""
    w = (torch.randn(out_f, in_f) / in_f**0.5).to(torch.bfloat16)
    packed, st = F.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    theirs = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                               device="meta")
    theirs.weight = bnb.nn.Params4bit(packed.clone(), requires_grad=False, quant_state=copy.deepcopy(st),
                                      blocksize=64, quant_type="nf4", module=theirs, bnb_quantized=True)
    theirs.quant_state = theirs.weight.quant_state
    stats = {k: v.clone() for k, v in st.as_dict(packed=True).items()}
    ours = four_bit.Linear4bitCpu(packed.clone(), four_bit.State4bit.from_dict(stats), None, torch.bfloat16)
    ours.pack()
    return theirs.eval(), ours


def per_call(mod: torch.nn.Module, x: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        mod(x)
    return (time.perf_counter() - start) / n


def main() -> None:
    p = add_baseline(BenchParser(description=__doc__))
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    print("| out x in | rows | bitsandbytes us | ours us | ours / bnb |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for out_f, in_f in SHAPES:
            theirs, ours = linears(out_f, in_f)
            for rows in ROWS:
                x = torch.randn(rows, in_f).to(torch.bfloat16)
                theirs(x), ours(x)
                n = max(3, int(5e7 / (out_f * in_f * max(rows, 4))))
                # alternated
                times = [(per_call(theirs, x, n), per_call(ours, x, n)) for _ in range(args.rounds)]
                a, b = min(t[0] for t in times), min(t[1] for t in times)
                print(f"| {out_f} x {in_f} | {rows} | {a * 1e6:.0f} | {b * 1e6:.0f} | {b / a:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
